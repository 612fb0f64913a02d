"""Attention of a Llama-layout layer's queries over a RevivaCache, in Reviva's own calls: a
decode step's (write_and_attend: the new tokens written, then attended), the blocks of a layer
whose K/V is fp8 or paged (attend_cache), and a chunk's queries against the keys so far with
grouped heads read in place (chunk_attention). Note [Sliding windows]."""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import torch
import torch.nn.functional as F

from reviva.cache import fp8 as kv_fp8
from reviva.cache.block_attention import block_attention, split_blocks, use_cudnn
from reviva.cache.kv_cache import RevivaCache

# Note [Sliding windows]
# ~~~~~~~~~~~~~~~~~~~~~~
# A sliding-window layer's query at position p attends to the keys of positions (p - W, p] (HF's
# sliding mask: kv > q - W and kv <= q). Reviva's own attention calls (chunked prefill, decode,
# the decode graphs' step) read only the keys from the first query's window on, and a band mask
# when several queries are attended at once; HF's own calls (whole-prompt attention, HF's decode
# path) get HF's sliding mask from the model. The cache keeps every token of such a layer (the
# bytes of a full layer are moved: a window-sized ring is still to come), and fp8 and paged K/V,
# whose blocks are attended by Reviva's block merge, refuse sliding layers by name.


def write_and_attend(
    cache: RevivaCache,
    i: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    first: int,
    last: int,
    scale: float,
    mask: torch.Tensor | None,
    window: int | None = None,
) -> torch.Tensor:
    """Writes the K/V k, v of tokens [first, last) into layer i of the cache and returns their
    queries' attention (attend_cache). A paged layer attends first, to its pages and k, v
    themselves, then writes: the last page read stays on the device for the write (Note [Paged
    layers] in src/kv_store_pages.cpp)."""
    if cache.host_attended(i):  # Note [Attention on the host] (src/host_attention.cpp)
        if mask is not None:
            raise ValueError(
                f"RevivaManager: layer {i} is attended on the host, which takes no padding mask "
                "(decode_attention='device' does)"
            )
        return cache.host_attend(i, q, k, v, scale, window)
    if cache.attends_fp8_in_place(i, q, mask):  # Note [fp8 decode attention]
        return cache.attend_fp8_decode(i, first, q, k, v, scale, window)
    if cache.paged(i):
        out = attend_cache(cache, i, q, first, last, scale, mask, k, v, window)
        cache.write(i, first, k, v)
        return out
    cache.write(i, first, k, v)
    return attend_cache(cache, i, q, first, last, scale, mask, window=window)


def attend_cache(
    cache: RevivaCache,
    i: int,
    q: torch.Tensor,
    first: int,
    last: int,
    scale: float,
    mask: torch.Tensor | None,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Attention of the queries of tokens [first, last) to layer i's keys [0, last) in the
    cache (bottom-right causal; within `window` positions for a sliding layer, Note [Sliding
    windows]), [B, H, n, D]. fp8 K/V: block by block, each dequantized only
    while it is attended, merged by log-sum-exp (Note [fp8 K/V rows], Note [Block-merged
    attention]). A paged layer (Note [Paged layers] in src/kv_store_pages.cpp): its pages up to
    `first`, then the queries' own keys and values k and v ([B, kv_heads, n, D], written to the
    cache after this call; fp8: before quantization), merged the same way."""
    if (
        cache.share > 1 and q.shape[0] == cache.batch
    ):  # Note [Shared prompt K/V] (cache/sequence_rows.py)
        if mask is not None:
            raise ValueError("RevivaManager: a shared prompt with a padding mask is not supported")
        return cache.attend_shared(i, q, first, last, scale)
    if window is not None and window < last and (cache.paged(i) or cache.read_by_blocks(i)):
        raise ValueError(
            f"RevivaManager: layer {i} attends within a sliding window of {window} tokens, which "
            "fp8 and paged K/V (attended by blocks) do not support yet; use kv_dtype='auto' and "
            "kv_page_tokens=0"
        )
    if cache.paged(i):
        if mask is not None:
            raise ValueError("RevivaManager: paged K/V with a padding mask is not supported")
        if k is None or v is None:
            raise ValueError("attend_cache: a paged layer needs the queries' own keys and values")
        earlier: Iterable[tuple[torch.Tensor, torch.Tensor, int]] = cache.page_blocks(i, first)
        if cache.fp8:
            earlier = (
                (
                    kv_fp8.dequantize(kb, q.dtype, cache.runtime),
                    kv_fp8.dequantize(vb, q.dtype, cache.runtime),
                    start,
                )
                for kb, vb, start in earlier
            )
        blocks = itertools.chain(earlier, [(k, v, first)])
        return block_attention(q, blocks, first, scale, cache.attention_kernel)
    ring = cache.ring(i)
    if (
        ring is not None
    ):  # Note [Window rings] (cache/window_rings.py): from the first query's window on
        lo = max(first - ring[0] + 1, 0)
        # (a wrapped window is copied whole, W rows: at 64k of the Mistral-7B shape on the
        # H200 at ea39408, two calls merged by log-sum-exp instead made a decode step 12.5 ms
        # against 9.1 ms without rings, the merge's small kernels costing more than the copy)
        k_w, v_w = cache.window_kv(i, lo, last)
        rows = None if mask is None else mask[:, :, :, lo:]
        return chunk_attention(
            q, k_w, v_w, rows, first - lo, last - lo, scale, cache.attention_kernel, ring[0]
        )
    if not cache.read_by_blocks(i):  # (an fp8 layer's prefill: Note [fp8 prefill shadow])
        k_all, v_all = cache.view(i, last)
        return chunk_attention(
            q, k_all, v_all, mask, first, last, scale, cache.attention_kernel, window
        )
    if mask is not None:
        raise ValueError("RevivaManager: fp8 K/V with a padding mask is not supported")
    k_rows, v_rows = cache.rows(i, last)
    split = split_blocks(k_rows, v_rows, first, last - first, cache.block_tokens)
    blocks = (
        (
            kv_fp8.dequantize(kb, q.dtype, cache.runtime),
            kv_fp8.dequantize(vb, q.dtype, cache.runtime),
            start,
        )
        for kb, vb, start in split
    )
    return block_attention(q, blocks, first, scale, cache.attention_kernel)


def chunk_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    start: int,
    end: int,
    scale: float,
    kernel: str = "flash",
    window: int | None = None,
) -> torch.Tensor:
    """Attention of the queries of tokens [start, end) to the keys of tokens [0, end):
    causal aligned at the bottom right (query j sees keys <= start + j), and with a sliding
    `window` only keys > start + j - window (Note [Sliding windows]). [B, H, n, D] out.
    mask: HF's 4D mask (padding) of these queries, [B, 1, n, >= end], or None.
    kernel "cudnn": the earlier keys and the chunk's own in two calls merged by log-sum-exp
    (Note [Prefill attention kernel] in cache/block_attention.py)."""
    if window is not None and end > window:  # (some query's window leaves keys out)
        # the first query's oldest key: older ones are outside every window
        lo = max(start - window + 1, 0)
        n = end - start
        if mask is not None:  # HF's sliding mask (with padding): its columns in the window
            band = mask[:, :, :, lo:end]
        elif n == 1:
            band = None  # one query: every key from lo on is in its window
        else:
            pos_q = torch.arange(start, end, device=q.device)[:, None]
            pos_k = torch.arange(lo, end, device=q.device)[None, :]
            band = (pos_k <= pos_q) & (pos_k > pos_q - window)
        k, v = k[:, :, lo:end], v[:, :, lo:end]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=band, scale=scale, enable_gqa=True)
    if mask is not None:  # HF's 4D mask (padding), this chunk's rows: its columns so far
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask[:, :, :, :end], scale=scale, enable_gqa=True
        )
    if kernel == "cudnn" and use_cudnn(q):
        return block_attention(q, [(k[:, :, :end], v[:, :, :end], 0)], start, scale, kernel)
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256:
        # Flash attention's causal mask is bottom-right aligned when queries and keys differ in
        # length, and it reads grouped K/V heads without expanding them.
        return torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, True, False, scale=scale
        )[0]
    n = end - start
    causal = torch.ones(n, end, dtype=torch.bool, device=q.device).tril(diagonal=start)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal, scale=scale, enable_gqa=True)
