"""RevivaCache: a HuggingFace `Cache` whose layers live in a Reviva KVStore.

A layer's K/V is one token-major buffer [capacity, 2, batch, kv_heads, head_dim] in the core's
device arena (a new token is one contiguous row, so it is appended and copied out alone; memory
is mapped as tokens arrive). Resident layers keep their buffers on the device; the others live
in pinned host memory and are streamed through staging slots, filled `prefetch_layers` ahead of
use by the core (reviva._C.KVStore). `update` returns views of the buffers in HF's [batch,
kv_heads, tokens, head_dim] layout; for batch 1 they are exactly the layout flash attention
reads, so nothing is copied or expanded to attend.

With page_tokens > 0 (RevivaConfig(kv_page_tokens=...); Note [Paged layers] in
src/kv_store_pages.cpp) a streamed layer's K/V lives in pages instead: it is written page by page
and read by `page_blocks` (attention merged across pages), never as one buffer.

The decoder-layer wrappers of RevivaManager acquire a layer before its forward and release it
after; `update` appends into the acquired buffer. One cache serves one generate call: the
manager closes it before generate returns, which gives its device memory back (`close`). Its
layers reach it through a weak reference, so that nothing keeps a cache alive in a cycle.

RevivaCache's parts live in one module each, as its mixins: HF's per-layer interface
(cache/layer.py), shared prompts and beams (cache/sequence_rows.py), a returned cache
(cache/returned.py), window rings (cache/window_rings.py), the reads of fp8 rows
(cache/fp8_reads.py) and attention on the host (cache/host_attention.py); this module holds the
store, its layers' acquire, write and read, and HF's Cache interface.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from transformers.cache_utils import Cache

from reviva import switches
from reviva._C import DeviceArena, KVStore, Runtime, TransferEngine
from reviva.cache import fp8 as fp8rows
from reviva.cache.fp8_reads import Fp8Reads
from reviva.cache.host_attention import HostAttention
from reviva.cache.layer import RevivaCacheLayer
from reviva.cache.returned import ReturnedCache
from reviva.cache.sequence_rows import SequenceRows
from reviva.cache.window_rings import WindowRings


class RevivaCache(SequenceRows, ReturnedCache, WindowRings, Fp8Reads, HostAttention, Cache):
    """A Cache over a KVStore; built by RevivaManager for one generate call. (Its mixins: see
    the module.)"""

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
        disk_layers: tuple[int, ...] = (),
        disk_staged_layers: int = 0,
        disk_path: str | None = None,
    ) -> None:
        super().__init__(layers=[RevivaCacheLayer(self, i) for i in range(num_layers)])
        # Note [Window rings] (cache/window_rings.py): layer -> (window, ring tokens)
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
        # Note [Prefill masks left to Reviva] (cache/layer.py): set by the manager for an
        # unpadded call from empty
        self.skip_prefill_masks = False
        # Note [A stop decided a step late] (generate/stop_check.py): set for a call that defers its
        # stop; the decode steps taken back after a stop
        self.defers_stop = False
        self.undone_steps = 0
        self._ring_len = dict.fromkeys(self.rings, 0)  # positions held
        self._ring_high = dict.fromkeys(self.rings, 0)  # the furthest position written
        # Note [Shared prompt K/V] (cache/sequence_rows.py): `batch` rows, every `share` of them one
        # prompt's; the store holds batch // share rows (the prompts) and the rows' generated
        # tokens live apart.
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
        # Note [A returned cache] (cache/returned.py): each layer's (K, V) in pinned host memory
        # once parked
        self.parked: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.parked_length = 0
        self.parked_bytes = 0
        self.num_kv_heads, self.head_dim = kv_heads, head_dim
        # Note [Fetch tails] (src/append_blocks.cpp): sliding layers whose streamed K/V is
        # fetched as its last `window` tokens alone (set_fetch_windows)
        self.fetch_windows: dict[int, int] = {}
        # Prefill's attention calls on CUDA: "flash" or "cudnn" (Note [Prefill attention kernel]
        # in cache/block_attention.py).
        self.attention_kernel = attention_kernel
        self.runtime = runtime  # the core's, for its kernels (fp8 rows' dequantization)
        self.capacity = capacity
        self.batch = batch
        self.dtype = dtype
        # Note [fp8 K/V rows] (cache/fp8.py): the store holds uint8 rows of head_dim + 4 bytes, read
        # by blocks of `block_tokens` (layer_attention.attend_cache).
        self.fp8 = kv_fp8
        self.block_tokens = block_tokens if kv_fp8 else 0
        self.fp8_error = 0.0  # the largest relative round-trip error seen (first writes)
        if kv_fp8 and block_tokens <= 0:
            raise ValueError(f"RevivaCache: fp8 K/V needs block_tokens > 0, got {block_tokens}")
        # Note [fp8 prefill shadow] (cache/fp8_reads.py): whether prefill keeps a layer's K/V
        # dequantized while it runs (the plan's choice), and the layer and its K and V ([tokens,
        # batch, kv_heads, D])
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
            # Note [Spilled layers] (src/kv_store_disk.cpp): "" is a new folder under $TMPDIR
            disk_path=(disk_path or "") if disk_layers else None,
            disk_staged_layers=disk_staged_layers,
        )
        self.page_tokens = page_tokens
        for layer in resident_layers:
            self.store.make_resident(layer)
        for layer in disk_layers:
            self.store.spill_to_disk(layer)
        for _ in range(slots):
            self.store.add_slot()
        self._acquired: set[int] = set()
        # Note [Beams] (cache/sequence_rows.py): per layer, the rows its generated tokens are to be
        # gathered from at its next acquire, and the prompt's length (rows before it are never
        # reordered).
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

    # --- used by the layer wrappers --------------------------------------------------------------

    def paged(self, layer_idx: int) -> bool:
        """Whether the layer's K/V lives in pages (read by page_blocks, never whole)."""
        return self.page_tokens > 0 and self.store.paged(layer_idx)

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
        of use (Note [Paged prefill order] in src/kv_store_pages.cpp); nothing for a whole layer."""
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
        a shared prompt (Note [Shared prompt K/V] in cache/sequence_rows.py): the prompt's tokens
        one row per prompt, the tokens after it one row per sequence (into the generated rows)."""
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
        if self.shadowed(layer_idx):  # Note [fp8 prefill shadow] (cache/fp8_reads.py)
            _, k, v = self._shadow
            return k[:length].permute(1, 2, 0, 3), v[:length].permute(1, 2, 0, 3)
        if self.fp8:
            raise RuntimeError(
                "RevivaCache: fp8 K/V is read by blocks (rows() and layer_attention.attend_cache), "
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
        # Note [Window rings] (cache/window_rings.py): as HF's DynamicSlidingWindowLayer
        if layer_idx in self.rings:
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

    def crop(self, tokens_to_remove: int) -> None:
        # (HF's convention, per layer: cache/layer.py; a negative count under a deferred stop
        # is the step run past it: Note [A stop decided a step late])
        n = int(tokens_to_remove)
        if n == 0:
            return  # (HF's deferred check asks it every step: nothing to walk the layers for)
        if n < 0 and self.defers_stop:
            self.undone_steps -= n
        super().crop(n)

    def batch_repeat_interleave(self, repeats: int) -> None:
        # (several sequences per prompt repeat the prompt's rows before prefill, when the cache
        # is still empty: the manager plans that many rows; a filled cache is never expanded)
        raise NotImplementedError("RevivaCache does not support beams or expanding its rows")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("RevivaCache does not support batch selection")
