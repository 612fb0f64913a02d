"""A returned cache (Note [A returned cache]): a call's K/V parked in pinned host memory of its
own when generate returns the cache (park), and written into the cache of a later call that
continues from it (load_parked). ReturnedCache is RevivaCache's mixin; state it writes: the
cache's parked, parked_length and parked_bytes (and, through write, the store).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from reviva.cache import fp8 as fp8rows

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
# window); a call that raises parks nothing (it returns no cache). As HF's generate: a call with
# use_cache=False returns no cache (its output's past_key_values None, nothing parked; it still
# runs with the manager's cache, the same tokens), and an HF cache holding no token passed as
# past_key_values is no cache to continue from (the call's own is returned; the caller's empty
# cache is left empty, where HF fills it in place).


def without_cache(out: Any) -> Any:
    """HF's generate output `out` as HF returns it from a call without a cache (use_cache=False):
    its past_key_values None, no key for it (a ModelOutput keeps a key set to None in its
    items, so the output is made again from its other fields)."""
    # (the field is `cache` from transformers 5.25 on, `past_key_values` before)
    return type(out)(**{k: v for k, v in out.items() if k not in ("cache", "past_key_values")})


class ReturnedCache:
    """Parking a RevivaCache and loading a parked one (its mixin; see the module)."""

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
            # (no shared prompt with pages: per-row copies, Note [Beams] in cache/sequence_rows.py)
            if self.paged(i):
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
        self, parked: Sequence[tuple[torch.Tensor, torch.Tensor]], fp8: bool, length: int = 0
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
            # Note [Window rings] (cache/window_rings.py): the tokens a ring can hold, at their
            # places
            if i in self.rings:
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
