"""RevivaCache: a HuggingFace `Cache` whose layers live in a Reviva KVStore.

A layer's K/V is one token-major buffer [capacity, 2, batch, kv_heads, head_dim] in the core's
device arena (a new token is one contiguous row, so it is appended and copied out alone; memory
is mapped as tokens arrive). Resident layers keep their buffers on the device; the others live
in pinned host memory and are streamed through staging slots, filled `prefetch_layers` ahead of
use by the core (reviva._C.KVStore). `update` returns views of the buffers in HF's [batch,
kv_heads, tokens, head_dim] layout; for batch 1 they are exactly the layout flash attention
reads, so nothing is copied or expanded to attend.

With page_tokens > 0 (RevivaConfig(kv_page_tokens=...); Note [Paged layers] in
src/kv_store.cpp) a streamed layer's K/V lives in pages instead: it is written page by page and
read by `page_blocks` (attention merged across pages), never as one buffer.

The decoder-layer wrappers of RevivaManager acquire a layer before its forward and release it
after; `update` appends into the acquired buffer. One cache serves one generate call: the
manager closes it before generate returns, which gives its device memory back (`close`). Its
layers reach it through a weak reference, so that nothing keeps a cache alive in a cycle.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Iterator

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from reviva import kv_fp8 as fp8rows
from reviva import switches
from reviva._C import DeviceArena, KVStore, Runtime, TransferEngine
from reviva.block_attention import attention_with_lse, merge

# The largest head_dim the fused fp8 decode attention takes (reviva::kFp8DecodeMaxHeadDim).
FP8_DECODE_MAX_HEAD_DIM = 256

# Note [Shared prompt K/V]
# Beam search and several sequences per prompt run batch x n rows that share each prompt's
# tokens: HF repeats each prompt's row n times before prefill. Kept as n rows, a prompt's K/V
# is n identical copies: at 64k with 4 beams of the 8B shape, 32 GB where 8 GB hold it, and on
# a 24 GB card 28 of 32 layers streamed a step 11.8x greedy's (the H200 at f6651f0). So, when
# the rows need nothing per row in the prompt (no padding, full K/V, not fp8 or paged: the
# manager decides, call_inputs.share_rows), the cache holds each prompt's K/V once (the
# store's batch is the prompts) and each row's generated tokens in device buffers of their own
# (`generated rows`, a few tokens per row); the manager runs prefill over one row per prompt
# (its layer wrappers keep every n-th row) and hands HF's head the last token's row repeated.
# A decode step's queries attend to their prompt's K/V with the n rows' queries as one batch of
# queries (grouped heads read in place: one read of the prompt per step, not n), and to their
# own generated rows, the two merged by log-sum-exp (attend_shared). A beam's reorder gathers its
# generated rows only, at once (they are on the device), never the prompt's.
#
# Note [A returned cache]
# generate(..., return_dict_in_generate=True) returns the call's cache (past_key_values), which a
# later call may continue from (a chat's next turn: the new call's input_ids start with the
# tokens the cache holds). A cache holds device memory only within its call, so at the end of
# such a call its K/V is parked: each layer's tokens are copied into pinned host memory of its
# own (the pool's), one row per sequence (a shared prompt's rows repeated), and the store's
# device memory and host copies go back as after any call. The parked cache answers
# get_seq_length and holds that host memory until it is dropped. A call continuing from it
# (RevivaManager.generate(..., past_key_values=cache), or from any HF cache whose layers hold
# keys and values, e.g. DynamicCache) plans for every token, writes the parked K/V into its own
# cache (load_parked) and runs the tokens after them as a prefill from that offset; its own cache
# is parked in turn when it returns one. The parked cache itself is never written again.
# Details: the continued call is planned for its new tokens' working set and every token's K/V
# (Plan.past_tokens); a padded batch's new tokens attend under HF's mask of their rows; a paged
# layer is parked page by page and loaded into pages; an HF cache's sliding layer that keeps its
# window alone is written at its positions, zeros before (never read: its queries start at their
# window); a call that raises parks nothing (it returns no cache).
#
# Note [Beams]
# Beam search (HF's) runs batch x num_beams rows: generate repeats each prompt's row num_beams
# times before prefill, and after each step reorders the cache's rows by beam_idx, each new row
# a copy of a row of the same prompt. So every row of one prompt holds the same K/V for the
# prompt's tokens (the same computation on the same inputs), and only the generated tokens' rows
# differ between beams: a reorder gathers those alone, never the prompt's. HF's own caches copy
# every token's rows per step (index_select); here a step's reorder of a layer moves its
# generated tokens only (a few rows per beam against a prompt of thousands), on the device,
# when the layer is next acquired (acquire() applies what reorder() recorded, composed over
# reorders in between), and a streamed layer's rewritten rows go on to its host copy like any
# write. Paged layers are refused with beams (their rows are spread over pages).


# Note [Prefill masks left to Reviva]
# HF's model builds each attention type's 4D mask before its layers run. For a sliding window
# shorter than the prompt it cannot leave the mask to SDPA's is_causal, so a 64k prompt gets a
# [1, 1, 64k, 64k] boolean mask: 4 GiB at once, more than a 24 GB card has beside a 7B model's
# weights (the H200 at da88db7: Mistral-7B's shape at 64k ran out of memory there, in
# masking_utils.sdpa_mask, with and without rings). Reviva's prefill needs no such mask where no
# row is padded: its chunks apply the causal rule and the window's band themselves
# (chunk_attention), and a layer whose window is shorter than the prompt never goes to HF's
# attention call over the whole prompt (LlamaLayerPath.prefill). So for an unpadded call from an
# empty cache with such a window (the manager sets skip_prefill_masks), each layer answers HF's
# mask sizes for the prompt as one key at offset 0: HF's mask then comes out None (its is_causal
# shortcut), and Reviva's calls, which take a mask only to apply padding, get none. From the
# first decode step on the sizes are the true ones (HF's decode path reads them).
#
# Note [Window rings]
# A sliding-window layer's query at position p reads the keys of (p - W, p] alone (Note [Sliding
# windows] in layer_attention.py), so once a call's tokens pass its window, every older token is
# dead weight: held on the device when the layer is resident, pinned on the host and copied each
# step when it streams. Such a layer is kept as a ring of R = W - 1 + S tokens instead (S: the
# most tokens written at once after the window, a prefill chunk or RING_SLACK_TOKENS at least,
# planner.window_ring_tokens): position p lives in row p mod R of the store's block for the
# layer, whose capacity is R (Note [Layers of their own size] in src/kv_store.cpp), so its
# device memory, its pinned host copy and each fetch are R tokens however long the call, and the
# planner counts it so (Plan.kv_bytes: more layers stay resident). A write of positions
# [first, first + n) goes to rows first mod R on, in two writes where it wraps (each written
# through to the host copy as any write); the rows of positions [high - R, high) are the ones
# intact (high: the furthest position written). A read of positions [lo, hi) (window_kv) is a
# view of the rows, or both pieces in position order where it wraps (a copy of at most R
# tokens). Reviva's own attention reads the window of its first query on, with the band mask
# in those coordinates (attend_cache); HF's own attention reads what update() returns: the
# window's last W - 1 tokens and the new ones, as HF's DynamicSlidingWindowLayer returns them,
# and the layer reports is_sliding and HF's mask sizes, so HF's masks start where they do. A
# crop (assisted decoding) keeps rows intact for up to S tokens back; a returned cache holds a
# ring layer's last W - 1 tokens, as HF's sliding layers do. Not with fp8 or paged K/V (refused
# with short windows) nor a shared prompt, and not for layers attended on the host (the manager
# plans without rings when the host attends: their K/V lives in host memory). REVIVA_WINDOW_RINGS=0
# keeps every token, to compare.


# Note [fp8 prefill shadow]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# fp8 rows are attended in prefill by blocks (llama_layer.attend_cache): each chunk's queries
# read every earlier key, a block at a time dequantized into a temporary, merged by log-sum-exp.
# Summed over a prompt's chunks that dequantizes the prefix once per chunk (a 16-bit copy of the
# whole prefix per chunk): 5.75 s against bf16's 3.84 at 64k on the H200 (Llama-3-8B shape).
# With a shadow, a layer's prefill also holds its K/V dequantized, 16-bit and token-major like a
# bf16 layer's store, written chunk by chunk as the rows are (each chunk's rows dequantized once,
# by the core's kernel, in place), and attends it exactly as a bf16 layer attends its store:
# the same values the blocks read, the bf16 path's calls. The shadow is one layer's 16-bit K/V
# of the prompt (64k, 8 kv heads of 128: 256 MiB), made when the layer's prefill starts and
# dropped when it ends; the planner takes it only where the plan keeps the same residency with
# it as without (else the blocks, in less memory: at 512k it would be 2 GiB, two layers' rows).


class RevivaCacheLayer(CacheLayerMixin):
    """One layer of a RevivaCache (HF's per-layer interface over the shared store)."""

    is_sliding = False
    is_compileable = False
    is_croppable = True  # (assisted and prompt-lookup decoding cut the rejected candidates)

    def __init__(self, cache: RevivaCache, layer_idx: int) -> None:
        super().__init__()
        self._cache_ref = weakref.ref(cache)
        self._layer_idx = layer_idx
        self.is_initialized = True

    @property
    def _cache(self) -> RevivaCache:
        cache = self._cache_ref()
        if cache is None:
            raise RuntimeError("RevivaCacheLayer: its RevivaCache is gone")
        return cache

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):  # noqa: ANN001, ANN201
        return self._cache.append(self._layer_idx, key_states, value_states)

    def get_seq_length(self) -> int:
        return self._cache.get_seq_length(self._layer_idx)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self._cache.skip_prefill_masks and query_length > 1 and self.get_seq_length() == 0:
            return 1, 0  # Note [Prefill masks left to Reviva]: HF builds no prompt-sized mask
        ring = self._cache.rings.get(self._layer_idx)
        if ring is None:
            return self.get_seq_length() + query_length, 0
        # Note [Window rings]: the keys update() returns, as HF's sliding layers
        window, length = ring[0], self.get_seq_length()
        return min(length, window - 1) + query_length, max(length - window + 1, 0)

    def get_max_length(self) -> int:
        return self._cache.capacity

    def reset(self) -> None:
        raise NotImplementedError("RevivaCache cannot be reset layer by layer; build a new one")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._cache.reorder(self._layer_idx, beam_idx)

    def crop(self, tokens_to_remove: int) -> None:
        # HF's convention (a number or a 0-d tensor): a negative count removes that many tokens,
        # 0 removes none, a positive one (legacy) is the length to keep
        n = int(tokens_to_remove)
        if n == 0:
            return
        length = self.get_seq_length()
        keep = length + n if n < 0 else min(n, length)
        self._cache.truncate(self._layer_idx, max(keep, 0))

    def offload(self) -> None:
        pass  # the store decides where layers live

    def prefetch(self) -> None:
        pass


class RevivaCache(Cache):
    """A Cache over a KVStore; built by RevivaManager for one generate call."""

    def __init__(
        self,
        engine: TransferEngine,
        arena: DeviceArena,
        num_layers: int,
        batch: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        capacity: int,
        resident_layers: list[int],
        slots: int,
        prefetch_layers: int,
        timeline_capacity: int = 0,
        kv_fp8: bool = False,
        block_tokens: int = 0,
        runtime: Runtime | None = None,
        page_tokens: int = 0,
        attention_kernel: str = "flash",
        share: int = 1,
        device: torch.device | None = None,
        rings: dict[int, tuple[int, int]] | None = None,
    ) -> None:
        super().__init__(layers=[RevivaCacheLayer(self, i) for i in range(num_layers)])
        # Note [Window rings]: layer -> (window, ring tokens)
        self.rings: dict[int, tuple[int, int]] = dict(rings or {})
        for i, (window, ring) in self.rings.items():
            if not 0 <= i < num_layers or not 1 <= window <= ring <= capacity:
                raise ValueError(
                    f"RevivaCache: ring of layer {i}: window {window}, {ring} tokens; needs a "
                    f"layer in [0, {num_layers}) and 1 <= window <= ring tokens <= the capacity "
                    f"({capacity})"
                )
            self.layers[i].is_sliding = True
        if self.rings and (kv_fp8 or page_tokens or share > 1):
            raise ValueError(
                "RevivaCache: window rings need whole layers of bf16/fp32 K/V, one per row, got "
                f"kv_fp8={kv_fp8}, page_tokens={page_tokens}, share={share}"
            )
        # Note [Prefill masks left to Reviva]: set by the manager for an unpadded call from empty
        self.skip_prefill_masks = False
        self._ring_len = dict.fromkeys(self.rings, 0)  # positions held
        self._ring_high = dict.fromkeys(self.rings, 0)  # the furthest position written
        # Note [Shared prompt K/V]: `batch` rows, every `share` of them one prompt's; the store
        # holds batch // share rows (the prompts) and the rows' generated tokens live apart.
        if share < 1 or batch % share:
            raise ValueError(
                f"RevivaCache: share={share} must be >= 1 and divide the batch ({batch})"
            )
        if share > 1 and (kv_fp8 or page_tokens):
            raise ValueError(
                "RevivaCache: a shared prompt (share > 1) needs whole layers of bf16/fp32 K/V, "
                f"got kv_fp8={kv_fp8}, page_tokens={page_tokens}"
            )
        self.share = share
        self.device = device if device is not None else torch.device("cpu")  # compute's
        self._generated: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._generated_len: dict[int, int] = {}
        self.generated_bytes = 0
        # Note [A returned cache]: each layer's (K, V) in pinned host memory once parked
        self.parked: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.parked_length = 0
        self.parked_bytes = 0
        self.num_kv_heads, self.head_dim = kv_heads, head_dim
        # Note [Fetch tails] (src/append_blocks.cpp): sliding layers whose streamed K/V is
        # fetched as its last `window` tokens alone (set_fetch_windows)
        self.fetch_windows: dict[int, int] = {}
        # Prefill's attention calls on CUDA: "flash" or "cudnn" (Note [Prefill attention kernel]
        # in block_attention.py).
        self.attention_kernel = attention_kernel
        self.runtime = runtime  # the core's, for its kernels (fp8 rows' dequantization)
        self.capacity = capacity
        self.batch = batch
        self.dtype = dtype
        # Note [fp8 K/V rows] (kv_fp8.py): the store holds uint8 rows of head_dim + 4 bytes, read
        # by blocks of `block_tokens` (llama_layer.attend_cache).
        self.fp8 = kv_fp8
        self.block_tokens = block_tokens if kv_fp8 else 0
        self.fp8_error = 0.0  # the largest relative round-trip error seen (first writes)
        if kv_fp8 and block_tokens <= 0:
            raise ValueError(f"RevivaCache: fp8 K/V needs block_tokens > 0, got {block_tokens}")
        # Note [fp8 prefill shadow]: whether prefill keeps a layer's K/V dequantized while it
        # runs (the plan's choice), and the layer and its K and V ([tokens, batch, kv_heads, D])
        self.fp8_shadow = False
        self._shadow: tuple[int, torch.Tensor, torch.Tensor] | None = None
        self.store = KVStore(
            engine,
            arena,
            num_layers,
            batch // share,
            kv_heads,
            fp8rows.row_bytes(head_dim) if kv_fp8 else head_dim,
            torch.uint8 if kv_fp8 else dtype,
            capacity,
            prefetch_layers,
            timeline_capacity,
            page_tokens,
            [self.rings[i][1] if i in self.rings else capacity for i in range(num_layers)]
            if self.rings
            else [],
        )
        self.page_tokens = page_tokens
        for layer in resident_layers:
            self.store.make_resident(layer)
        for _ in range(slots):
            self.store.add_slot()
        self._acquired: set[int] = set()
        # Note [Beams]: per layer, the rows its generated tokens are to be gathered from at its
        # next acquire, and the prompt's length (rows before it are never reordered).
        self._pending_rows: dict[int, torch.Tensor] = {}
        self._beam_prefix: dict[int, int] = {}
        # Note [Attention on the host] (src/host_attention.cpp): layers whose decode reads their
        # K/V on the host, the host threads that do it, and what it took (seconds)
        self._host_layers: set[int] = set()
        self.host_threads = switches.host_attention_threads()
        self.host_wait_s = 0.0  # waiting for compute before the queries could cross
        self.host_attention_s = 0.0  # the host's attention calls (writes of the new rows in)
        self.host_attention_calls = 0
        self._staging: tuple[object, tuple[torch.Tensor, ...]] | None = None

    def promote(self, layer_idx: int) -> bool:
        """Makes a streamed layer resident (device memory freed up, e.g. after prefill); False
        when the device has no memory for it (it stays streamed)."""
        return self.store.promote(layer_idx)

    def drop_slot(self) -> bool:
        """Gives up a staging slot no layer uses (its memory goes back); False if none."""
        return self.store.drop_slot()

    def close(self) -> None:
        """Waits for the cache's copies and gives its device memory and pinned host copies back
        (device memory after compute's last use). Idempotent; the cache is unusable after."""
        self._acquired.clear()
        self._generated.clear()
        self._generated_len.clear()
        self.store.close()

    @property
    def closed(self) -> bool:
        return self.store.closed

    def set_fetch_windows(self, windows: dict[int, int]) -> None:
        """Note [Fetch tails] (src/append_blocks.cpp): each layer in `windows` (index: its
        window in tokens) is read only within its window from here on (Reviva's own attention
        calls slice it, Note [Sliding windows]), so a fetch of it copies its last `window`
        tokens alone; the tokens before are stale on the device. Only for layers that no
        reader takes whole (HF's attention would read them masked: not with its calls)."""
        for i, w in windows.items():
            if not self.paged(i):
                self.store.set_fetch_window(i, w)
                self.fetch_windows[i] = w

    def park(self, pool: object) -> None:
        """Note [A returned cache]: every layer's tokens into pinned host memory of its own
        ([batch, kv_heads, tokens, D]: bf16/fp32 values, or fp8 rows as they are), then the
        store closes (its device memory and host copies go back). Waits for the copies. A
        paged layer's pages are copied in turn into its place."""
        length = self.get_seq_length(0)
        for i in list(self.fetch_windows):  # (every token is read here: fetched whole)
            self.store.set_fetch_window(i, 0)
        self.fetch_windows.clear()
        parked = []
        for i in range(len(self.layers)):
            if self.get_seq_length(i) != length:
                raise RuntimeError(
                    f"RevivaCache: layer {i} holds {self.get_seq_length(i)} tokens, layer 0 "
                    f"{length}: only a cache whose layers hold one length can be parked"
                )
            if self.paged(i):  # (no shared prompt with pages: per-row copies, Note [Beams])
                parked.append(self._park_pages(pool, i, length))
                continue
            self.acquire(i)
            try:
                prompt = self.store.length(i)
                # (a host-attended layer is read where it lives: its host copy)
                host = self.host_attended(i)
                if i in self.rings:  # (its window's last W - 1 tokens, as HF's sliding layers)
                    k, v = self.window_kv(i, max(length - self.rings[i][0] + 1, 0), length)
                elif host:
                    k, v = self.store.host_kv(i, prompt)
                else:
                    k, v = self.store.kv(i, prompt)
                if self.share > 1:  # (one row per sequence: the prompt's rows repeated)
                    k_g, v_g = self._generated.get(i, (k[:, :, :0], v[:, :, :0]))
                    g = self._generated_len.get(i, 0)
                    k = torch.cat([k.repeat_interleave(self.share, 0), k_g[:, :, :g]], dim=2)
                    v = torch.cat([v.repeat_interleave(self.share, 0), v_g[:, :, :g]], dim=2)
                pair = []
                for x in (k, v):
                    host = pool.tensor(list(x.shape), x.dtype)
                    host.copy_(x, non_blocking=x.is_cuda)
                    pair.append(host)
                parked.append((pair[0], pair[1]))
                del k, v, x  # (views of the store: the store closes after, KVStore.host_kv)
            finally:
                self.release(i)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.parked = parked
        self.parked_length = length
        self.parked_bytes = sum(2 * k.numel() * k.element_size() for k, _ in parked)
        self.close()

    def _park_pages(self, pool: object, i: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A paged layer's tokens [0, length) into pinned host memory, page by page."""
        host = None
        for k, v, first in self.page_blocks(i, length):
            if host is None:
                shape = [k.shape[0], k.shape[1], length, k.shape[3]]
                host = (pool.tensor(shape, k.dtype), pool.tensor(shape, v.dtype))
            n = k.shape[2]
            host[0][:, :, first : first + n].copy_(k, non_blocking=k.is_cuda)
            host[1][:, :, first : first + n].copy_(v, non_blocking=v.is_cuda)
            if k.is_cuda:  # (the page goes back at the next one: its copy done first)
                torch.cuda.current_stream(k.device).synchronize()
        assert host is not None  # (length >= 1: one page at least)
        return host

    def load_parked(
        self, parked: list[tuple[torch.Tensor, torch.Tensor]], fp8: bool, length: int = 0
    ) -> None:
        """Note [A returned cache]: writes a parked cache's tokens ([batch, kv_heads, tokens, D]
        per layer; fp8 rows when `fp8`) into this empty cache, layer by layer. A layer holding
        fewer than `length` tokens holds the last ones (a sliding layer's window, from HF's
        cache): the tokens before them are written as zeros, which no query of that layer
        reads (its attention starts at its window)."""
        if len(parked) != len(self.layers):
            raise ValueError(
                f"RevivaCache: the cache to continue from has {len(parked)} layers, the model "
                f"{len(self.layers)}"
            )
        for i, (k, v) in enumerate(parked):
            if k.shape[0] != self.batch:
                raise ValueError(
                    f"RevivaCache: the cache to continue from holds {k.shape[0]} rows, the call "
                    f"runs {self.batch}"
                )
            k, v = k.to(self.device, non_blocking=True), v.to(self.device, non_blocking=True)
            writer = self.write
            if fp8 and self.fp8:  # (rows as they are: no second rounding)
                writer = self.store.write
            elif fp8:
                k = fp8rows.dequantize(k, self.dtype, self.runtime)
                v = fp8rows.dequantize(v, self.dtype, self.runtime)
            elif not self.fp8:
                k, v = k.to(self.dtype), v.to(self.dtype)
            first = max(length - k.shape[2], 0)
            if i in self.rings:  # Note [Window rings]: the tokens a ring can hold, at their places
                self.acquire(i)
                try:
                    self._load_ring(i, first, k, v)
                finally:
                    self.release(i)
                continue
            self.acquire(i)
            try:
                self.reserve(i, first + k.shape[2])
                for s in range(0, first, 4096):  # (zeros by blocks: no tensor of every token)
                    zeros = k.new_zeros(k.shape[0], k.shape[1], min(4096, first - s), k.shape[3])
                    writer(i, s, zeros, zeros)
                writer(i, first, k, v)
            finally:
                self.release(i)

    def _load_ring(self, i: int, first: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """An empty ring layer takes a parked layer's tokens [first, first + n): the last ring's
        worth of them, at their rows; rows before the first of them are zeros, never read. (The
        store's rows are written directly: a ring is never fp8, and the zeros are rows, not
        positions.)"""
        ring = self.rings[i][1]
        n = k.shape[2]
        if n > ring:
            k, v, first, n = k[:, :, n - ring :], v[:, :, n - ring :], first + n - ring, ring
        row = first % ring
        if row:  # (the store's rows fill from 0: rows before the first one, zeros never read)
            zeros = k.new_zeros(k.shape[0], k.shape[1], row, k.shape[3])
            self.store.write(i, 0, zeros, zeros)
        self._ring_len[i] = self._ring_high[i] = first
        self._write_ring(i, first, k, v, bulk=True)

    # --- used by the layer wrappers --------------------------------------------------------------

    def ring(self, layer_idx: int) -> tuple[int, int] | None:
        """Note [Window rings]: (window, ring tokens) of a layer kept as a ring, else None."""
        return self.rings.get(layer_idx)

    def window_kv(self, layer_idx: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Note [Window rings]: an acquired ring layer's K and V of positions [lo, hi) in order,
        [batch, kv_heads, hi - lo, D]: views of its rows, or (where they wrap) a copy of both
        pieces. Raises when the ring no longer holds them."""
        ring = self.rings[layer_idx][1]
        high, length = self._ring_high[layer_idx], self._ring_len[layer_idx]
        if not (0 <= lo <= hi <= length and hi - lo <= ring and lo >= high - ring):
            raise RuntimeError(
                f"RevivaCache: layer {layer_idx} is a ring of {ring} tokens holding positions "
                f"[{max(high - ring, 0)}, {length}); positions [{lo}, {hi}) were asked"
            )
        # (the rows written: min(high, ring), the store's length, without asking the store)
        k_all, v_all = self.store.kv(layer_idx, min(high, ring))
        start = lo % ring
        end = start + (hi - lo)
        if end <= ring:
            return k_all[:, :, start:end], v_all[:, :, start:end]
        k = torch.cat([k_all[:, :, start:], k_all[:, :, : end - ring]], dim=2)
        v = torch.cat([v_all[:, :, start:], v_all[:, :, : end - ring]], dim=2)
        return k, v

    def _write_ring(self, i: int, first: int, key, value, bulk=False) -> None:  # noqa: ANN001
        """Note [Window rings]: positions [first, first + n) into rows first mod R on (at most
        R - W + 1 of them, so that their queries' windows stay in the ring; `bulk`: a parked
        layer's, up to R, read by later queries alone)."""
        window, ring = self.rings[i]
        n = key.shape[2]
        limit = ring if bulk else ring - window + 1
        if first > self._ring_len[i]:
            raise ValueError(
                f"RevivaCache: layer {i}'s tokens written from {first} would leave a gap after "
                f"its {self._ring_len[i]}"
            )
        if n > limit:
            raise ValueError(
                f"RevivaCache: {n} tokens written at once into layer {i}, a ring of {ring} "
                f"tokens for a window of {window}: at most {limit} (Note [Window rings]: the "
                "planner sizes rings by the prefill chunk)"
            )
        if self.capacity < first + n:
            raise ValueError(
                f"RevivaCache: {first + n} tokens exceed the {self.capacity} planned for the call"
            )
        row = first % ring
        head = min(n, ring - row)
        self.store.write(i, row, key[:, :, :head], value[:, :, :head])
        if head < n:
            self.store.write(i, 0, key[:, :, head:], value[:, :, head:])
        self._ring_len[i] = max(self._ring_len[i], first + n)
        self._ring_high[i] = max(self._ring_high[i], first + n)

    def paged(self, layer_idx: int) -> bool:
        """Whether the layer's K/V lives in pages (read by page_blocks, never whole)."""
        return self.page_tokens > 0 and self.store.paged(layer_idx)

    def host_attended(self, layer_idx: int) -> bool:
        """Whether decode attends the layer's K/V on the host (attend_on_host)."""
        return layer_idx in self._host_layers

    def attends_fp8_in_place(
        self, layer_idx: int, q: torch.Tensor, mask: torch.Tensor | None
    ) -> bool:
        """Whether the queries q ([batch, heads, n, D]) of a decode step of the layer go through
        the fused fp8 decode attention (attend_fp8_decode): fp8 rows of a whole layer on the
        device, one query per sequence, 16-bit, no padding mask."""
        return (
            self.fp8
            and q.shape[2] == 1
            and mask is None
            and q.dtype in (torch.bfloat16, torch.float16)
            and self.head_dim <= FP8_DECODE_MAX_HEAD_DIM
            and not self.paged(layer_idx)
            and layer_idx not in self._host_layers
        )

    def fp8_graphable(self, layer_idx: int) -> bool:
        """Whether the layer's decode steps can hold its fp8 attention in their graph (Note
        [fp8 attention in the decode graphs] in decode_graphs.py): what attends_fp8_in_place asks
        of a layer, in 16 bits on CUDA."""
        return (
            self.fp8
            and self.device.type == "cuda"
            and self.dtype in (torch.bfloat16, torch.float16)
            and self.head_dim <= FP8_DECODE_MAX_HEAD_DIM
            and not self.paged(layer_idx)
            and layer_idx not in self._host_layers
        )

    def attend_fp8_decode(
        self,
        layer_idx: int,
        first: int,
        q: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float,
        window: int | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Note [fp8 decode attention] (src/fp8_attention.cpp): the new token's key and value
        ([batch, kv_heads, 1, D]) quantized into row `first` of the acquired layer and its
        queries' attention ([batch, heads, 1, D]) to keys [0, first] (a sliding layer's last
        `window` of them), the rows read in place, in one core call: into `out` ([batch, heads,
        1, D], any strides with a dense last dimension) when given; returned."""
        first_key = 0 if window is None else max(first + 1 - window, 0)
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        return self.store.attend_fp8_decode(layer_idx, first, q, key, value, scale, first_key, out)

    def attend_on_host(self, layer_idx: int) -> None:
        """Note [Attention on the host] (src/host_attention.cpp): the streamed layer's K/V stays
        in its pinned host copy from now on; decode steps write their rows there and attend them
        on the host's cores (host_attend). It leaves the device and is never fetched again."""
        if layer_idx in self.rings:
            raise RuntimeError(
                f"RevivaCache: layer {layer_idx} is a window ring (Note [Window rings]); the host "
                "attends whole layers (the manager plans without rings when the host attends)"
            )
        self.store.attend_on_host(layer_idx)
        self._host_layers.add(layer_idx)

    def host_attend(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        """A decode step of a host-attended layer: the new tokens' keys and values ([B,
        kv_heads, n, D]) written into its host copy, and their queries' ([B, heads, n, D])
        attention to every token up to each (causal; within `window` tokens for a sliding
        layer), computed on the host; [B, heads, n, D] in
        q's dtype on q's device. On CUDA, q, k and v cross in one wait for compute (the queries
        depend on this step's work) and the output goes back by a pinned copy that torch's
        stream orders before its readers."""
        t0 = time.perf_counter()
        if self.fp8:  # (the host copy holds rows as the store does: Note [fp8 K/V rows])
            k, v = fp8rows.quantize(k), fp8rows.quantize(v)
        if q.device.type == "cuda":
            qs, ks, vs, out_pinned = self._host_staging(q, k)
            qs.copy_(q, non_blocking=True)
            ks.copy_(k, non_blocking=True)
            vs.copy_(v, non_blocking=True)
            torch.cuda.current_stream(q.device).synchronize()
            t1 = time.perf_counter()
            out = self.store.host_attend(
                layer_idx, qs, ks, vs, scale, self.host_threads, window or 0
            )
            out_pinned.copy_(out)
            result = out_pinned.to(q.device, non_blocking=True).to(q.dtype)
        else:
            t1 = time.perf_counter()
            rows = torch.uint8 if self.fp8 else self.dtype
            out = self.store.host_attend(
                layer_idx,
                q,
                k.to(rows),
                v.to(rows),
                scale,
                self.host_threads,
                window or 0,
            )
            result = out.to(q.dtype)
        t2 = time.perf_counter()
        self.host_wait_s += t1 - t0
        self.host_attention_s += t2 - t1
        self.host_attention_calls += 1
        return result

    def _host_staging(
        self, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pinned buffers for a step's q, k, v and output, made once per shape. Reused layer
        after layer: each host_attend waits for compute, by which point the previous layer's
        output copy has been read."""
        key = (tuple(q.shape), tuple(k.shape), q.dtype, k.dtype)
        if self._staging is None or self._staging[0] != key:
            qs = torch.empty(q.shape, dtype=q.dtype, pin_memory=True)
            ks = torch.empty(k.shape, dtype=k.dtype, pin_memory=True)
            vs = torch.empty(k.shape, dtype=k.dtype, pin_memory=True)
            out = torch.empty(q.shape, dtype=torch.float32, pin_memory=True)
            self._staging = (key, (qs, ks, vs, out))
        return self._staging[1]

    def acquire(self, layer_idx: int) -> None:
        """The layer's buffer holds its tokens so far for compute from now until release. (A
        paged layer's pages are acquired page by page as they are written and read; a
        host-attended layer stays on the host.)"""
        if layer_idx in self._host_layers:
            self._acquired.add(layer_idx)
            return
        if not self.paged(layer_idx):
            self.store.acquire(layer_idx)
        self._acquired.add(layer_idx)
        rows = self._pending_rows.pop(layer_idx, None)
        if rows is not None:
            self._gather_generated(layer_idx, rows)

    def reorder(self, layer_idx: int, beam_idx: torch.Tensor) -> None:
        """Beam search's reorder of the layer's rows (Note [Beams]): recorded, and applied to
        the generated tokens' rows when the layer is next acquired."""
        if self.paged(layer_idx):
            raise RuntimeError(
                f"RevivaCache: layer {layer_idx} is paged; beams need whole layers (the manager "
                "refuses kv_page_tokens with num_beams > 1)"
            )
        if beam_idx.shape != (self.batch,):
            raise ValueError(
                f"RevivaCache.reorder: beam_idx of shape {tuple(beam_idx.shape)}, expected "
                f"({self.batch},)"
            )
        if self.share > 1:  # Note [Shared prompt K/V]: the generated rows alone, now
            n = self._generated_len.get(layer_idx, 0)
            if n:
                k, v = self._generated[layer_idx]
                rows = beam_idx.to(device=k.device, dtype=torch.long)
                k[:, :, :n] = k[rows, :, :n]
                v[:, :, :n] = v[rows, :, :n]
            return
        self._beam_prefix.setdefault(layer_idx, self.get_seq_length(layer_idx))
        earlier = self._pending_rows.get(layer_idx)
        beam_idx = beam_idx.to(torch.long)
        # (row j after both reorders is row earlier[beam_idx[j]] before either)
        self._pending_rows[layer_idx] = beam_idx if earlier is None else earlier[beam_idx]

    def _gather_generated(self, layer_idx: int, rows: torch.Tensor) -> None:
        """Rewrites the acquired layer's generated tokens [prompt, length) with each row taken
        from `rows` (written through to its host copy like any write)."""
        first, length = self._beam_prefix[layer_idx], self.store.length(layer_idx)
        if layer_idx in self.rings:  # (positions: the generated ones the ring still holds)
            length = self._ring_len[layer_idx]  # (<= high: its rows intact from high - R)
            first = max(first, self._ring_high[layer_idx] - self.rings[layer_idx][1])
            if length <= first:
                return
            k, v = self.window_kv(layer_idx, first, length)
            rows = rows.to(k.device)
            self._write_ring(layer_idx, first, k[rows], v[rows], bulk=True)
            return
        if length <= first:
            return
        k, v = self.store.kv(layer_idx, length)  # (fp8: uint8 rows, moved as they are)
        rows = rows.to(k.device)
        k_new, v_new = k[rows, :, first:length], v[rows, :, first:length]  # (copies)
        self.store.write(layer_idx, first, k_new, v_new)

    def release(self, layer_idx: int) -> None:
        self._acquired.discard(layer_idx)
        if layer_idx in self._host_layers:
            return
        if not self.paged(layer_idx):
            self.store.release(layer_idx)

    def reserve(self, layer_idx: int, tokens: int) -> None:
        """Maps an acquired whole layer's first `tokens` tokens at once (a paged layer maps its
        pages as they are written)."""
        if layer_idx in self.rings:  # (a ring holds its rows at most)
            tokens = min(tokens, self.rings[layer_idx][1])
        if not self.paged(layer_idx):
            self.store.reserve(layer_idx, tokens)

    @contextlib.contextmanager
    def prefill_order(self, layer_idx: int, tokens: int, chunk: int) -> Iterator[None]:
        """Around a layer's prefill by chunks of `chunk` over `tokens` tokens: a paged layer's
        page reads and writes in that order declared to the store, so its pages come in ahead
        of use (Note [Paged prefill order] in src/kv_store.cpp); nothing for a whole layer."""
        if not self.paged(layer_idx) or tokens == 0:
            yield
            return
        self.store.declare_prefill_order(layer_idx, 0, tokens, chunk)
        try:
            yield
        finally:
            self.store.end_prefill_order()

    def page_blocks(
        self, layer_idx: int, end: int
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]:
        """A paged layer's tokens [0, end) page by page, for block_attention: (K, V, first
        token), [batch, kv_heads, tokens, D] views (fp8: uint8 rows, Note [fp8 K/V rows]). Each
        page is acquired as it is reached and released when the next is asked for (the work
        already queued on it keeps its memory: release is stream-ordered)."""
        page = self.page_tokens
        for j in range((end + page - 1) // page):
            first = j * page
            self.store.acquire_page(layer_idx, j)
            try:
                k, v = self.store.page_kv(layer_idx, j, min(page, end - first))
                yield k, v, first
            finally:
                self.store.release_page(layer_idx, j)

    def write(self, layer_idx: int, first: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Writes tokens [first, first + n) of key/value ([batch, kv_heads, n, head_dim]); raises
        naming the numbers when they exceed the capacity planned for the call. fp8 K/V: as
        e4m3 rows with their scales (the first write of a layer also measures the error). With
        a shared prompt (Note [Shared prompt K/V]): the prompt's tokens one row per prompt,
        the tokens after it one row per sequence (into the generated rows)."""
        if self.share > 1 and key.shape[0] == self.batch:
            self._write_generated(layer_idx, first, key, value)
            return
        if layer_idx in self.rings:
            self._write_ring(layer_idx, first, key, value)
            return
        if not self.fp8:
            self.store.write(layer_idx, first, key, value)
            return
        k_rows, v_rows = fp8rows.quantize(key), fp8rows.quantize(value)
        if first == 0:
            self.fp8_error = max(
                self.fp8_error,
                fp8rows.relative_error(key, k_rows),
                fp8rows.relative_error(value, v_rows),
            )
        self.store.write(layer_idx, first, k_rows, v_rows)
        if self._shadow is not None and self._shadow[0] == layer_idx:
            # the rows just written, as the blocks would read them (token-major, in place)
            _, k_sh, v_sh = self._shadow
            n = key.shape[2]
            k_all, v_all = self.store.kv(layer_idx, first + n)
            for rows, out in ((k_all, k_sh), (v_all, v_sh)):
                part = rows[:, :, first : first + n].permute(2, 0, 1, 3)
                if self.runtime is not None and fp8rows._kernel_takes(part, self.dtype):
                    self.runtime.dequantize_fp8_rows(part, out[first : first + n])
                else:
                    out[first : first + n] = fp8rows.dequantize(part, self.dtype)

    @contextlib.contextmanager
    def prefill_shadow(self, layer_idx: int, tokens: int) -> Iterator[None]:
        """Note [fp8 prefill shadow]: around an fp8 layer's prefill over its first `tokens`
        tokens, when the plan chose it (fp8_shadow) and the layer is whole: its K/V also
        dequantized as written, attended as a bf16 layer's (view(), HF's call); dropped after."""
        if not (self.fp8 and self.fp8_shadow) or self.paged(layer_idx) or tokens == 0:
            yield
            return
        shape = (tokens, self.batch, self.num_kv_heads, self.head_dim)
        k = torch.empty(shape, dtype=self.dtype, device=self.device)
        self._shadow = (layer_idx, k, torch.empty_like(k))
        try:
            if self.store.length(layer_idx):  # (rows written before: a returned cache's)
                held = self.store.length(layer_idx)
                k_all, v_all = self.store.kv(layer_idx, held)
                for rows, out in ((k_all, k), (v_all, self._shadow[2])):
                    out[:held] = fp8rows.dequantize(rows.permute(2, 0, 1, 3), self.dtype)
            yield
        finally:
            self._shadow = None

    def shadowed(self, layer_idx: int) -> bool:
        """Whether the layer's prefill holds its K/V dequantized (prefill_shadow)."""
        return self._shadow is not None and self._shadow[0] == layer_idx

    def read_by_blocks(self, layer_idx: int) -> bool:
        """Whether the layer's fp8 rows are attended by dequantized blocks: fp8 without a
        prefill shadow (Note [fp8 prefill shadow])."""
        return self.fp8 and not self.shadowed(layer_idx)

    def _write_generated(
        self, layer_idx: int, first: int, key: torch.Tensor, value: torch.Tensor
    ) -> None:
        """Note [Shared prompt K/V]: tokens [first, first + n) of every row, after the prompt."""
        prompt = self.store.length(layer_idx)
        n = key.shape[2]
        have = self._generated_len.get(layer_idx, 0)
        if first != prompt + have:
            raise ValueError(
                f"RevivaCache: layer {layer_idx}'s rows are written at token {first}, where "
                f"{prompt + have} tokens are held (a prompt of {prompt} shared by {self.share} "
                "rows): tokens after a shared prompt are written in order"
            )
        room = self.capacity - prompt
        if have + n > room:
            raise ValueError(
                f"RevivaCache: {have + n} tokens after the prompt exceed the {room} planned for "
                "the call"
            )
        if layer_idx not in self._generated:
            shape = (self.batch, key.shape[1], room, key.shape[3])
            k = torch.empty(shape, dtype=key.dtype, device=key.device)
            self._generated[layer_idx] = (k, torch.empty_like(k))
            self.generated_bytes += 2 * k.numel() * k.element_size()
        k, v = self._generated[layer_idx]
        k[:, :, have : have + n] = key
        v[:, :, have : have + n] = value
        self._generated_len[layer_idx] = have + n

    def attend_shared(
        self, layer_idx: int, q: torch.Tensor, first: int, last: int, scale: float
    ) -> torch.Tensor:
        """Note [Shared prompt K/V]: attention of the queries of tokens [first, last) of every
        row ([batch, heads, n, D]) to their prompt's K/V (the `share` rows' queries of a prompt
        as one batch of queries: non-causal, the prompt precedes them) and to their own tokens
        after it up to `last` (bottom-right causal), merged by log-sum-exp; [batch, heads, n, D]
        in q's dtype."""
        prompt = self.store.length(layer_idx)
        if first < prompt:
            raise ValueError(
                f"RevivaCache: queries from token {first} of layer {layer_idx}, inside its shared "
                f"prompt of {prompt} tokens"
            )
        rows, heads, n, dim = q.shape
        s, b = self.share, rows // self.share
        k_p, v_p = self.store.kv(layer_idx, prompt)  # [b, kv_heads, prompt, D]
        q_p = q.reshape(b, s, heads, n, dim).transpose(1, 2).reshape(b, heads, s * n, dim)
        o_p, l_p = attention_with_lse(q_p, k_p, v_p, False, scale)
        o_p = o_p.reshape(b, heads, s, n, dim).transpose(1, 2).reshape(rows, heads, n, dim)
        l_p = l_p.reshape(b, heads, s, n).transpose(1, 2).reshape(rows, heads, n)
        k_g, v_g = self._generated[layer_idx]
        after = last - prompt
        o_g, l_g = attention_with_lse(q, k_g[:, :, :after], v_g[:, :, :after], True, scale)
        out, lse = merge(None, None, o_p, l_p)
        out, _ = merge(out, lse, o_g, l_g)
        return out.to(q.dtype)

    def truncate(self, layer_idx: int, tokens: int) -> None:
        """Keeps the layer's first `tokens` tokens (a rollback: rejected candidates of assisted
        decoding); the next write continues from there. Not while the layer is acquired."""
        if layer_idx in self.rings:
            window, ring = self.rings[layer_idx]
            high = self._ring_high[layer_idx]
            if tokens > self._ring_len[layer_idx]:
                raise ValueError(
                    f"RevivaCache: truncate layer {layer_idx} to {tokens} tokens, of "
                    f"{self._ring_len[layer_idx]}"
                )
            if high <= ring:  # (never wrapped: its rows are its positions)
                self.store.truncate(layer_idx, tokens)
                self._ring_high[layer_idx] = tokens
            elif max(tokens - window + 1, 0) < high - ring:
                raise ValueError(
                    f"RevivaCache: layer {layer_idx} is a ring of {ring} tokens (window "
                    f"{window}) that wrote up to {high}: cut back to {tokens}, its window's "
                    "tokens are overwritten (Note [Window rings]: at most "
                    f"{ring - window + 1} tokens back)"
                )
            self._ring_len[layer_idx] = tokens
            return
        if self.share > 1:
            prompt = self.store.length(layer_idx)
            if tokens >= prompt:
                have = self._generated_len.get(layer_idx, 0)
                self._generated_len[layer_idx] = min(have, tokens - prompt)
                return
            self._generated_len[layer_idx] = 0
        self.store.truncate(layer_idx, tokens)

    def view(self, layer_idx: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The acquired layer's first `length` tokens: K and V, [batch, kv_heads, length, D]."""
        if self.shadowed(layer_idx):  # Note [fp8 prefill shadow]
            _, k, v = self._shadow
            return k[:length].permute(1, 2, 0, 3), v[:length].permute(1, 2, 0, 3)
        if self.fp8:
            raise RuntimeError(
                "RevivaCache: fp8 K/V is read by blocks (rows() and llama_layer.attend_cache), "
                "or through prefill's shadow, never as a whole layer"
            )
        if self.paged(layer_idx):
            raise RuntimeError(
                f"RevivaCache: layer {layer_idx} is paged (kv_page_tokens={self.page_tokens}): "
                "it is read page by page (page_blocks), never as a whole layer"
            )
        if layer_idx in self.rings:  # (whole only while its rows are its positions)
            return self.window_kv(layer_idx, 0, length)
        return self.store.kv(layer_idx, length)

    def rows(self, layer_idx: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """fp8 K/V: the acquired layer's first `length` tokens as K and V rows, uint8 [batch,
        kv_heads, length, head_dim + 4] views (Note [fp8 K/V rows])."""
        return self.store.kv(layer_idx, length)

    def append(
        self, layer_idx: int, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """HF's update: appends the new tokens and returns the whole layer."""
        if layer_idx not in self._acquired:
            raise RuntimeError(
                f"RevivaCache: layer {layer_idx} was updated outside RevivaManager's layer "
                "wrappers (use the cache through manager.generate)"
            )
        if self.fp8 or self.paged(layer_idx) or self.share > 1:
            raise RuntimeError(
                "RevivaCache: with fp8 or paged K/V, or a prompt shared by several rows (Note "
                "[Shared prompt K/V]), the layers attend through Reviva's own path; HF's "
                "attention would need each layer's K/V whole, one copy per row"
            )
        if key.shape[0] != self.batch:
            raise ValueError(
                f"RevivaCache: batch {key.shape[0]} differs from the planned batch {self.batch}"
            )
        if layer_idx in self.rings:  # Note [Window rings]: as HF's DynamicSlidingWindowLayer
            first = self._ring_len[layer_idx]
            self.write(layer_idx, first, key, value)
            lo = max(first - self.rings[layer_idx][0] + 1, 0)
            return self.window_kv(layer_idx, lo, first + key.shape[2])
        first = self.store.length(layer_idx)
        self.write(layer_idx, first, key, value)
        return self.view(layer_idx, first + key.shape[2])

    # --- HF Cache interface ----------------------------------------------------------------------

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if self.parked is not None:
            return self.parked_length
        if layer_idx in self.rings:
            return self._ring_len[layer_idx]
        return self.store.length(layer_idx) + self._generated_len.get(layer_idx, 0)

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.capacity

    @property
    def batch_size(self) -> int:
        return self.batch

    def reset(self) -> None:
        self.store.clear()
        self._host_layers.clear()
        self._generated_len.clear()
        for i in self.rings:
            self._ring_len[i] = self._ring_high[i] = 0

    def batch_repeat_interleave(self, repeats: int) -> None:
        # (several sequences per prompt repeat the prompt's rows before prefill, when the cache
        # is still empty: the manager plans that many rows; a filled cache is never expanded)
        raise NotImplementedError("RevivaCache does not support beams or expanding its rows")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("RevivaCache does not support batch selection")
