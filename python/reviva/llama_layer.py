"""The Llama-layout decoder layer, computed by Reviva where HF's forward cannot run as is.

Prefill: one decoder layer over the whole prompt, by token chunks (projections, attention of a
chunk's queries against the keys so far, MLP), writing the layer's K/V into a RevivaCache and
updating the hidden states in place, so that the working set does not grow with the prompt.
Decode with Reviva's own attention call: the new token's queries against the cache's
token-major K/V, grouped heads read in place. A cache stores and this module computes
(STYLE.md): the cache never calls into here, the manager wires the two together.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from reviva import kv_fp8
from reviva.adapters import DecoderLayout
from reviva.block_attention import block_attention, split_blocks, use_cudnn
from reviva.kv_cache import RevivaCache
from reviva.planner import Plan

log = logging.getLogger(__name__)


def attention_interface(attn: nn.Module) -> Callable | None:
    """The attention function HF's layer calls for its config's attn_implementation: the
    registered one, or for "eager" (HF's fallback, registered nowhere) the modeling module's own
    eager_attention_forward, as the layer takes it; None where there is neither."""
    impl = attn.config._attn_implementation
    if impl == "eager" or impl is None:
        return getattr(sys.modules.get(type(attn).__module__), "eager_attention_forward", None)
    return ALL_ATTENTION_FUNCTIONS.get_interface(impl, None)


class LlamaLayerPath:
    """Prefill and own-decode of one layout's decoder layers (see the module docstring)."""

    def __init__(self, layout: DecoderLayout) -> None:
        self.layout = layout
        # Copy streams of the residual stream's chunks (in, out), made at first use on CUDA.
        self._residual_streams: tuple[torch.cuda.Stream, torch.cuda.Stream] | None = None

    def prefill(
        self,
        cache: RevivaCache,
        plan: Plan,
        i: int,
        layer: nn.Module,
        h: torch.Tensor,
        kwargs: dict[str, Any],
        past: int = 0,
        padded: bool = False,
    ) -> torch.Tensor:
        """One decoder layer over the whole prompt, by token chunks, in place on `h`. `past` >
        0: the prompt's tokens after the `past` the cache holds already (Note [A returned
        cache] in returned_cache.py): bottom-right causal attention, and HF's mask of these tokens'
        rows when the batch is `padded` (else HF's mask is left out: causal alone)."""
        if torch.is_grad_enabled():
            raise RuntimeError("RevivaManager prefill runs under torch.no_grad() (generate does)")
        attn = layer.self_attn
        mask = kwargs.get("attention_mask") if past == 0 or padded else None
        if "position_embeddings" not in kwargs:
            raise ValueError(
                "RevivaManager: the decoder layer was called without position_embeddings "
                "(the Llama layout passes them from model.model.rotary_emb)"
            )
        cos, sin = kwargs["position_embeddings"]
        whole = plan.chunk_tokens >= h.shape[1]
        interface = attention_interface(attn)
        # Note [Prefill masks left to Reviva] (cache_layer.py): a window shorter than the prompt is
        # applied by Reviva's own calls (a band per chunk), never by HF's over the whole prompt
        window = self.layout.windows[i]
        windowed = window is not None and window < past + h.shape[1]
        if (whole or plan.whole_attention) and interface is None and not windowed:
            raise ValueError(
                f"RevivaManager: attention implementation {attn.config._attn_implementation!r} "
                "is not registered with transformers"
            )
        cache.acquire(i)
        try:
            # All of the prompt's K/V is written in this call: map it at once, not by chunks.
            cache.reserve(i, past + h.shape[1])
            with cache.prefill_shadow(i, past + h.shape[1]):  # Note [fp8 prefill shadow]
                self._prefill_layer(cache, plan, i, layer, h, cos, sin, mask, interface, past)
        finally:
            cache.release(i)
        return h

    def _prefill_layer(self, cache, plan, i, layer, h, cos, sin, mask, interface, past) -> None:  # noqa: ANN001
        """prefill()'s way through one acquired layer: by chunks, or whole attention."""
        whole = plan.chunk_tokens >= h.shape[1]
        window = self.layout.windows[i]
        windowed = window is not None and window < past + h.shape[1]
        if past:
            self._prefill_fused(cache, plan, i, layer, h, cos, sin, mask, None, past)
        elif whole or not plan.whole_attention or cache.paged(i) or windowed:
            # (pages and windows: by chunks)
            hf = None if windowed else interface
            with cache.prefill_order(i, h.shape[1], plan.chunk_tokens):
                self._prefill_fused(cache, plan, i, layer, h, cos, sin, mask, hf)
        else:
            self._prefill_whole_attention(cache, plan, i, layer, h, cos, sin, mask, interface)

    def prefill_from_host(
        self,
        cache: RevivaCache,
        plan: Plan,
        i: int,
        layer: nn.Module,
        residual: torch.Tensor,
        positions: torch.Tensor,
        rotary: Any,
    ) -> None:
        """One decoder layer over the whole prompt whose hidden states live on the host
        (Note [Residual stream on the host]): residual [tokens, batch, hidden] pinned, updated
        by chunks; positions [1 or batch, tokens]; rotary(x, positions) gives a chunk's cos and
        sin."""
        if torch.is_grad_enabled():
            raise RuntimeError("RevivaManager prefill runs under torch.no_grad() (generate does)")
        tokens, chunk = residual.shape[0], plan.chunk_tokens
        cache.acquire(i)
        try:
            cache.reserve(i, tokens)
            with cache.prefill_order(i, tokens, chunk), cache.prefill_shadow(i, tokens):
                self._prefill_from_host_chunks(cache, i, layer, residual, positions, rotary, chunk)
        finally:
            cache.release(i)

    def _prefill_from_host_chunks(
        self, cache, i, layer, residual, positions, rotary, chunk
    ) -> None:  # noqa: ANN001
        if self.layout.device.type == "cuda":
            self._prefill_chunks_streamed(cache, i, layer, residual, positions, rotary, chunk)
            return
        tokens = residual.shape[0]
        for s in range(0, tokens, chunk):
            e = min(tokens, s + chunk)
            # (the host backend: the device is the host, so a copy of the chunk)
            h = residual[s:e].transpose(0, 1).clone(memory_format=torch.contiguous_format)
            cos, sin = rotary(h, positions[:, s:e])
            self._rows(cache, i, layer, h, 0, e - s, s, cos, sin, None, None)
            residual[s:e].copy_(h.transpose(0, 1))

    def _prefill_chunks_streamed(
        self,
        cache: RevivaCache,
        i: int,
        layer: nn.Module,
        residual: torch.Tensor,
        positions: torch.Tensor,
        rotary: Any,
        chunk: int,
    ) -> None:
        """prefill_from_host's chunks on CUDA (Note [Residual stream on the host]): chunk k+1
        is read in on one copy stream while chunk k computes, and chunk k written back on
        another, into two device buffers used in turn."""
        device = self.layout.device
        if self._residual_streams is None:
            self._residual_streams = (
                torch.cuda.Stream(device=device),
                torch.cuda.Stream(device=device),
            )
        up, down = self._residual_streams
        compute = torch.cuda.current_stream(device)
        tokens, batch, hidden = residual.shape
        starts = list(range(0, tokens, chunk))
        n = min(chunk, tokens)
        bufs = [torch.empty(n, batch, hidden, dtype=residual.dtype, device=device) for _ in "ab"]
        filled = [torch.cuda.Event(), torch.cuda.Event()]  # a buffer's chunk is in
        free = [torch.cuda.Event(), torch.cuda.Event()]  # a buffer's chunk is written back
        # The host rows this layer reads were written by the previous layer's write-backs (or
        # the embedding's, on the compute stream) and the buffers are new on compute's stream.
        up.wait_stream(down)
        up.wait_stream(compute)

        def read(k: int) -> None:
            s, e, b = starts[k], min(tokens, starts[k] + chunk), k % 2
            with torch.cuda.stream(up):
                if k >= 2:
                    up.wait_event(free[b])  # chunk k-2 left this buffer
                bufs[b][: e - s].copy_(residual[s:e], non_blocking=True)
                filled[b].record(up)

        read(0)
        try:
            for k, s in enumerate(starts):
                e, b = min(tokens, s + chunk), k % 2
                if k + 1 < len(starts):
                    read(k + 1)  # ahead, while chunk k computes
                compute.wait_event(filled[b])
                h = bufs[b][: e - s].transpose(0, 1)
                if not h.is_contiguous():  # (batch > 1: a copy, written back from there)
                    h = h.contiguous()
                cos, sin = rotary(h, positions[:, s:e])
                self._rows(cache, i, layer, h, 0, e - s, s, cos, sin, None, None)
                down.wait_stream(compute)
                with torch.cuda.stream(down):
                    residual[s:e].copy_(h.transpose(0, 1), non_blocking=True)
                    free[b].record(down)
                if h.data_ptr() != bufs[b].data_ptr():
                    h.record_stream(down)  # (compute's memory, read on the copy stream)
        finally:
            # The buffers go back to compute's stream: after every copy that used them.
            compute.wait_stream(up)
            compute.wait_stream(down)

    def decode(
        self,
        cache: RevivaCache,
        i: int,
        layer: nn.Module,
        h: torch.Tensor,
        kwargs: dict[str, Any],
        graphs: DecodeGraphs | None = None,
    ) -> torch.Tensor:
        """A decode step of one layer with Reviva's own attention call: the new tokens' queries
        against the cache's token-major K/V, grouped heads read in place (no concatenation, no
        expansion). For CUDA in half precision without a padding mask. With `graphs`, the layer's
        compute before and after attention replays CUDA graphs once captured (until then the
        step runs eagerly and the layer waits for capture); the result is then in the graphs'
        static hidden state, which is returned."""
        past = cache.get_seq_length(i)
        cos, sin = kwargs["position_embeddings"]
        cache.acquire(i)
        try:
            if graphs is not None and graphs.ready(i, h):
                return graphs.step(cache, i, h, cos, sin, past)
            self._rows(cache, i, layer, h, 0, h.shape[1], past, cos, sin, None, None)
            if graphs is not None:
                graphs.defer(i, layer, cos, sin)
        finally:
            cache.release(i)
        return h

    def _qkv(
        self,
        layer: nn.Module,
        h: torch.Tensor,
        s: int,
        e: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys (both with RoPE, except in a NoPE layer: SmolLM3's `use_rope` false, as
        HF's attention reads it) and values of tokens [s, e), [B, heads, n, D]."""
        attn = layer.self_attn
        x = layer.input_layernorm(h[:, s:e])
        lay = self.layout
        shape = (h.shape[0], e - s, -1, lay.head_dim)
        if lay.fused_qkv:  # Phi-3: one projection, queries then keys then values
            qkv = attn.qkv_proj(x)
            nq, nkv = lay.num_heads * lay.head_dim, lay.num_kv_heads * lay.head_dim
            q = qkv[..., :nq].view(shape)
            k = qkv[..., nq : nq + nkv].view(shape)
            v = qkv[..., nq + nkv :].view(shape).transpose(1, 2)
        else:
            q = attn.q_proj(x).view(shape)
            k = attn.k_proj(x).view(shape)
            v = attn.v_proj(x).view(shape).transpose(1, 2)
        if hasattr(attn, "q_norm"):
            q = attn.q_norm(q)
        if hasattr(attn, "k_norm"):
            k = attn.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        if getattr(attn, "use_rope", True):
            q, k = lay.apply_rotary_pos_emb(q, k, cos[:, s:e], sin[:, s:e])
        return q, k, v

    @staticmethod
    def _finish(layer: nn.Module, h: torch.Tensor, s: int, e: int, out: torch.Tensor) -> None:
        """o_proj of the attention output [B, n, heads, D], residual, MLP: h[:, s:e] in place.
        Gemma 2/3 (a pre_feedforward_layernorm): each sublayer's output normalized before its
        residual add (post_attention_layernorm, post_feedforward_layernorm), the MLP's input by
        pre_feedforward_layernorm; Llama: post_attention_layernorm is the MLP's input norm."""
        o = layer.self_attn.o_proj(out.reshape(h.shape[0], e - s, -1))
        if hasattr(layer, "pre_feedforward_layernorm"):
            r = h[:, s:e] + layer.post_attention_layernorm(o)
            m = layer.mlp(layer.pre_feedforward_layernorm(r))
            h[:, s:e] = r + layer.post_feedforward_layernorm(m)
            return
        r = h[:, s:e] + o
        h[:, s:e] = r + layer.mlp(layer.post_attention_layernorm(r))

    @staticmethod
    def _attend_hf(attn: nn.Module, q, k, v, mask, interface) -> torch.Tensor:  # noqa: ANN001
        # Exactly HF's call (same function, same arguments): the same numbers. The keys and
        # values as HF's cache holds them, contiguous, not the token-major views of Reviva's
        # cache: on those strides cuDNN's attention builds a kernel of its own in the process's
        # first call (H200: 0.89 s against 0.12 s for contiguous K/V at 64k, later calls 0.06 s
        # both), which made the first generate's prefill 1.3x a later one's. The copy is one
        # layer's K/V, counted in the planner's whole-attention working set.
        k, v = k.contiguous(), v.contiguous()
        out, _ = interface(
            attn,
            q,
            k,
            v,
            mask,
            dropout=0.0,
            scaling=attn.scaling,
            sliding_window=getattr(attn, "sliding_window", None),
        )
        return out

    def _prefill_fused(self, cache, plan, i, layer, h, cos, sin, mask, interface, past=0) -> None:  # noqa: ANN001
        """Chunk by chunk: a chunk's queries attend to the keys of all tokens up to its end, which
        this and earlier chunks have written (and the `past` tokens before h's), so one pass
        suffices and a chunk's input rows are dead once its output is written."""
        tokens, chunk = h.shape[1], plan.chunk_tokens
        for s in range(0, tokens, chunk):
            e = min(tokens, s + chunk)
            whole = s == 0 and e == tokens and past == 0
            hf = interface if whole else None
            self._rows(cache, i, layer, h, s, e, past + s, cos, sin, mask, hf)

    def _rows(self, cache, i, layer, h, s, e, first, cos, sin, mask, interface) -> None:  # noqa: ANN001
        """Rows [s, e) of h are tokens [first, first + e - s): their projections, their K/V into
        the cache, their attention to every token up to the last of them, o_proj and the MLP, in
        place. With `interface`, attention is HF's own call (the whole prompt at once: the same
        numbers as HF); else Reviva's bottom-right causal call on the cache's layout."""
        q, k, v = self._qkv(layer, h, s, e, cos, sin)
        last = first + e - s
        if interface is not None and not (cache.paged(i) or cache.read_by_blocks(i)):
            cache.write(i, first, k, v)
            k_all, v_all = cache.view(i, last)
            out = self._attend_hf(layer.self_attn, q, k_all, v_all, mask, interface)
        else:  # (fp8 and paged layers: by blocks or pages, never HF's call over whole K/V)
            scale = layer.self_attn.scaling
            window = self.layout.windows[i]
            rows = None if mask is None else mask[:, :, s:e]  # (its rows are h's)
            out = write_and_attend(cache, i, q, k, v, first, last, scale, rows, window)
            out = out.transpose(1, 2)
        self._finish(layer, h, s, e, out)

    def _prefill_whole_attention(self, cache, plan, i, layer, h, cos, sin, mask, interface) -> None:  # noqa: ANN001
        """Projections by chunks into whole-prompt queries and the cache, one attention call
        over the prompt, then o_proj and the MLP by chunks."""
        tokens, chunk = h.shape[1], plan.chunk_tokens
        lay = self.layout
        q_all = torch.empty(
            h.shape[0], lay.num_heads, tokens, lay.head_dim, dtype=h.dtype, device=h.device
        )
        for s in range(0, tokens, chunk):
            e = min(tokens, s + chunk)
            q, k, v = self._qkv(layer, h, s, e, cos, sin)
            cache.write(i, s, k, v)
            q_all[:, :, s:e] = q
        k_all, v_all = cache.view(i, tokens)
        out = self._attend_hf(layer.self_attn, q_all, k_all, v_all, mask, interface)
        del q_all
        for s in range(0, tokens, chunk):
            e = min(tokens, s + chunk)
            self._finish(layer, h, s, e, out[:, s:e])


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
    layers] in src/kv_store.cpp)."""
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
    attention]). A paged layer (Note [Paged layers] in src/kv_store.cpp): its pages up to
    `first`, then the queries' own keys and values k and v ([B, kv_heads, n, D], written to the
    cache after this call; fp8: before quantization), merged the same way."""
    if cache.share > 1 and q.shape[0] == cache.batch:  # Note [Shared prompt K/V] (sequence_rows.py)
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
    if ring is not None:  # Note [Window rings] (window_rings.py): from the first query's window on
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
    (Note [Prefill attention kernel] in block_attention.py)."""
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


# Note [Residual stream on the host]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A long prompt's hidden states are the largest tensor of a prefill that keeps them on the device
# (512k tokens x 4096 x bf16: 4.3 GB, issue 13), with the whole prompt's rotary tables beside
# them. When the plan does not fit with them on the device (RevivaConfig(prefill_residual="auto"),
# or always with "host"), they live in pinned host memory from the process's pool, token-major
# ([tokens, batch, hidden]: a chunk is one contiguous copy), and prefill goes layer by layer:
# each chunk of tokens is copied in, runs the layer (projections, its K/V into the cache,
# attention of its queries to the keys so far, MLP), and is copied back. On CUDA the copies run
# on two copy streams of their own, into two device buffers used in turn: chunk k+1 is read in
# while chunk k computes, chunk k written back while chunk k+1 computes; a layer's first read
# waits for the previous layer's last write-back (at 512k a layer computes for seconds against
# 2 x 78 ms of copies, which ran on the compute stream until fd28304). The model's own forward
# still drives the layers: the embedding wrapper writes the embeddings chunk by chunk to the host
# and returns a placeholder of the prompt's shape that holds no memory (a broadcast zero), the
# rotary wrapper returns broadcast placeholders for cos and sin (each chunk's are computed when
# it runs), every layer returns the placeholder, and the final norm computes only the last
# token's row, broadcast to the prompt's shape: generate asks the head for the last position's
# logits alone (logits_to_keep=1). So nothing of the prompt's size is on the device but its K/V;
# options that need every position (output_hidden_states, logits_to_keep != 1) or a padding mask
# are refused by name in this mode.


# Note [Decode graphs]
# ~~~~~~~~~~~~~~~~~~~~
# A decode step is tens of small kernels per layer, each issued by Python: on the H200's host
# 1.05-1.15 ms per layer (benchmarks/diag_host.py; plain HF 0.94-1.34), about as long as a
# streamed layer's K/V takes over PCIe at 64k. The host, not the copies, then set the pace, and
# any noise on it showed as slower decode. So the compute before attention (input norm,
# projections, q/k norms, RoPE) and after it (o_proj, residual, MLP) is captured as two CUDA
# graphs per layer and replayed (0.20-0.26 ms per layer on the same host); what changes from
# step to step stays outside them: the K/V write into the store and the attention over a length
# that grows (eager, on torch's stream, between the two replays). The graphs read and write
# static buffers shared by all layers (the hidden state, cos/sin, the attention output), and
# their temporaries come from one graph memory pool; replays run one after another on one
# stream, so the pool's reuse across graphs is safe. The kernels are the eager path's, in the
# same order (the projections' GEMMs are cuBLAS's in both).
#
# When: before decode, when at least 8 decode steps are to come (capture_ahead). From prefill's
# middle layer on (once the helper thread's pinning is done), as each layer's prefill is about
# to be issued the host captures layers while the device still works through what is queued (an
# event recorded then; the host runs about one layer, ~120 ms at 64k, ahead of the device), so
# that the captures hide under prefill's compute; at the end of prefill (the final norm) it
# captures every layer still without graphs. A layer left out (an
# out-of-memory there) runs its decode steps eagerly and is captured at the end of a step: all
# waiting layers when at least CAPTURE_ALL_STEPS steps are to come, else while the step still
# runs on the device, at least one per step and for at most CAPTURE_MS_MAX (capture_pending).
# A layer is warmed up on
# a side stream (kernels loaded, cuBLAS initialised for the stream) before its capture only if
# no layer of the same parameter shapes was since the static buffers were made; captures run
# in "thread_local" mode so that the core's threads may keep polling their events. History,
# call 1 of 64k on a 24 GB card (H200): a fixed 10 ms per step (f9e5872) left it at 19.0-19.5
# tok/s against 21.6-21.7 later (163-194 eager layer steps); capturing only while the step ran
# on the device (99852c0-0620178) gave 21.0 tok/s on a warm machine (147 eager layer steps) but
# 18.1 on a freshly started one, whose host had no slack in decode: about one capture a step,
# 464 eager layer steps at ~0.33 ms over a replay each. Capturing every layer at the end of
# prefill (5c3b5e3) gave call 1 21.4 tok/s (1.062x the roofline) with no eager step, and took
# 202 ms there against ~116 ms of prefill left on the device (diag_phases: ~90 ms past the last
# layer). Capturing there only while prefill still ran on the device (0a8d6d4) captured one
# layer (the process's first capture loads the decode-shaped kernels) and left 31 to the end of
# decode step 1: call 1 20.2 tok/s, 1.125x. The first call's prefill has the room (1.08x plain
# HF's there, limit 1.15x), its decode does not (limit 1.1x). Capturing right after each layer's
# prefill, from layer 0 and whatever the device's state (1659665, 612b104), cost the first
# call's prefill 1.1-2.0 s. Capturing all at the end of prefill (c29e16d, a fresh machine) gave
# call 1 21.4 tok/s (1.064x) and prefill 1.058x plain HF's call 1, but 1.174x Reviva's own call 2
# (plain HF: 1.146x): 159 ms after the last layer against 7 in call 2, the captures' 234 ms less
# what the device still had queued. Hence the captures while prefill's later layers are issued.
# Graphs last as long as the manager; they are dropped when a layer's parameters move (data
# pointers change) or the batch changes, and a capture that fails turns graphs off for the
# manager, logged and in the stats (an out-of-memory while capturing leaves that layer eager for
# the call). A layer is captured only when each part the path calls is a plain module whose
# forward is its kernels (uncapturable(): nn.Linear itself or transformers' own norms, MLPs and
# activations; no forward hooks on them, no global module hooks, no accelerate hook, not
# training): a replay skips any Python, so an adapter whose state changes between calls (a LoRA
# merged, disabled or switched) or a hook would silently not take effect. Under autocast the
# eager path runs (the graphs were captured without it).

# Note [fp8 attention in the decode graphs]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# With fp8 K/V a layer's decode step is one graph: its compute before attention, the fused fp8
# attention call (Note [fp8 decode attention] in src/fp8_attention.cpp: the new token's rows
# written, the rows read in place) and its compute after. What changes from step to step is
# read by the kernels when they run: the step's length from a device scalar the host fills once
# a step (shared by every layer), the rows' addresses from two device words per layer, filled
# when the layer's buffer moved (a new call's cache, a streamed layer's staging slot). The
# splits are fixed at capture by the layer's capacity and each replay cuts its keys among
# them. Around each replay the host still reserves the new row and reports it written (the
# store's bookkeeping, and a streamed layer's copy to its host row). Measured on the H200 (64k, 8B
# shape, every layer resident on a 24 GB card): 87.1-88.7 tok/s in one graph per layer (c27175f)
# against 87.4-90.5 with the attention eager between two replays as bf16's is (33e5ea4): the step
# is bound by the device (busy ~10.8 ms of ~11.3, diag_decode_profile.py), not by the host, so
# the graph saves host time but not step time; the attention kernel's rate is what is left.
CAPTURE_MS_MAX = 200.0
# With this many decode steps to come, capture_pending captures every waiting layer at once: a
# capture costs the host ~3-6 ms, an eager layer step ~0.33 ms over a replay (H200, 64k on a
# 24 GB card: 464 eager layer steps cost call 1 ~150 ms, 0620178), so it pays for itself in
# ~10-18 steps.
CAPTURE_ALL_STEPS = 16


# Note [One capture stream]: torch gives each (cuBLAS handle, stream) its own workspace from the
# caching allocator, taken at the stream's first matmul and held from then on (torch's
# CublasHandlePool), and torch.cuda.Stream() hands out streams from a pool per device. With a
# side stream per manager, each new manager's captures could take one more workspace that stays
# allocated, so a later call's plan (its baseline: torch's allocated bytes) would have less room
# than the first's. One capture stream per device and thread serves every manager instead.
# Measured on the H200 with it (c53e840, benchmarks/diag_leftover.py): four calls, the fourth on a
# new manager, leave 0.1 MB more allocated once their outputs are dropped; the per-manager stream
# it replaces was not measured.
_capture_streams = threading.local()


@contextlib.contextmanager
def _collection_paused() -> Any:
    """No Python garbage collection inside a graph capture. A collection runs the finalizers of
    whatever unreachable cycles hold, anything the process made before (a WeightStore, an
    OffloadManager, a pinned table), and those synchronize or free device memory: calls that
    invalidate a capture on this thread even in thread_local mode, whose capture_end then
    raises and leaves torch's CUDA generator in its capture state, so that every later random
    op of the process raised "Offset increment outside graph capture encountered unexpectedly"
    (the H200's GPU suite at 303b431: 18 tests after the first failed capture; the same tests
    alone passed). torch.cuda.graph collects before capturing for the same reason."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream decode graphs are warmed up and captured on (Note [One capture
    stream]): one per device and thread (two threads capturing at once need two streams)."""
    streams = getattr(_capture_streams, "by_device", None)
    if streams is None:
        streams = _capture_streams.by_device = {}
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = streams.get(index)
    if stream is None:
        stream = streams[index] = torch.cuda.Stream(device=index)
    return stream


def take_matmul_workspaces(device: torch.device, dtype: torch.dtype) -> None:
    """Runs one small matmul on the current stream and on the capture stream (Note [One
    capture stream]): torch takes each one's cuBLAS workspace at its first matmul and holds it
    from then on, so taking them when a manager is made puts them in the device's baseline
    before the first call plans (else the first call's decode takes them inside its working set
    and every later call plans with that much less room)."""
    x = torch.zeros(16, 16, dtype=dtype, device=device)
    compute = torch.cuda.current_stream(device)
    F.linear(x, x)
    stream = capture_stream(device)
    stream.wait_stream(compute)
    with torch.cuda.stream(stream):
        F.linear(x, x)
    compute.wait_stream(stream)
    x.record_stream(stream)


class DecodeGraphs:
    """CUDA graphs of the per-layer decode compute around attention (Note [Decode graphs])."""

    def __init__(self, path: LlamaLayerPath) -> None:
        self.path = path
        self.layers: dict[int, tuple[Any, Any, tuple[torch.Tensor, ...], tuple[int, ...]]] = {}
        self.failed: str | None = None  # why graphs were turned off, if they were
        self.capture_ms = 0.0
        self.replays = 0
        self.captured = 0  # layers captured in this call
        self.captured_ahead = 0  # of which before decode (capture_ahead)
        self.captured_in_layers = 0  # of which while prefill's layers were issued
        self.eager_steps = 0  # layer steps of this call run eagerly, before their capture
        self._pending: dict[int, tuple[nn.Module, torch.Tensor, torch.Tensor]] = {}
        # Called with a layer's index on the capture stream before its warm-up and capture: it
        # orders that stream after whatever the layer's parameters wait for (a resident layer's
        # weights still being filled: RevivaManager._weights_ready).
        self.before_capture: Callable[[int], None] | None = None
        # Layers left eager in this call, and why (uncapturable(), or a failed capture).
        self.uncaptured: dict[int, str] = {}
        self._static: dict[str, torch.Tensor] = {}
        self._pool: Any = None
        self._cos: torch.Tensor | None = None
        # Parameter shapes (and dtypes) of layers warmed up since the static buffers were made.
        self._warm: set[tuple[tuple[Any, ...], ...]] = set()
        # Note [fp8 attention in the decode graphs]: the call's cache (set by the manager), the
        # layers whose one graph holds their attention, each layer's rows' addresses on the
        # device and on the host (as last written), and the step length last written.
        self.cache: RevivaCache | None = None
        self.fused: set[int] = set()
        self._rows_dev: dict[int, torch.Tensor] = {}
        self._rows_at: dict[int, tuple[int, int]] = {}
        self._length_at: int | None = None

    def begin_call(self, layers: list[nn.Module]) -> None:
        """Drops the graphs of layers whose parameters moved since their capture."""
        self.replays = 0
        self.capture_ms = 0.0
        self.captured = 0
        self.captured_ahead = 0
        self.captured_in_layers = 0
        self.eager_steps = 0
        self._pending.clear()
        self.uncaptured.clear()
        for i in list(self.layers):
            if self.layers[i][3] != _param_ptrs(layers[i]) or uncapturable(layers[i]) is not None:
                del self.layers[i]
                self.fused.discard(i)

    def ready(self, i: int, h: torch.Tensor) -> bool:
        """Layer i has graphs for decode steps of h's batch and dtype ([batch, 1, hidden])."""
        if self.failed is not None or i not in self.layers or h.shape[1] != 1:
            return False
        if torch.is_autocast_enabled(h.device.type):  # the capture ran without autocast
            return False
        st = self._static.get("h")
        if st is None or st.shape[0] != h.shape[0] or st.dtype != h.dtype:
            return False
        if i in self.fused and (self.cache is None or not self.cache.fp8_graphable(i)):
            del self.layers[i]  # (this call's cache attends it otherwise: captured again)
            self.fused.discard(i)
            return False
        return True

    def step(
        self,
        cache: RevivaCache,
        i: int,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        past: int,
    ) -> torch.Tensor:
        front, back, (q, k, v), _ = self.layers[i]
        st = self._static
        if h.data_ptr() != st["h"].data_ptr():
            st["h"].copy_(h)
        if cos is not self._cos:  # a new step's position
            st["cos"].copy_(cos)
            st["sin"].copy_(sin)
            self._cos = cos
        if back is None:  # Note [fp8 attention in the decode graphs]: one graph, the whole layer
            if self._length_at != past + 1:
                st["length"].fill_(past + 1)
                self._length_at = past + 1
            at = cache.store.rows_address(i)
            if self._rows_at.get(i) != at:
                self._rows_dev[i][0].fill_(at[0])
                self._rows_dev[i][1].fill_(at[1])
                self._rows_at[i] = at
            cache.reserve(i, past + 1)
            front.replay()
            cache.store.wrote(i, past, 1)
            self.replays += 1
            return st["h"]
        front.replay()
        attn = self.path.layout.layers[i].self_attn
        window = self.path.layout.windows[i]
        if cache.attends_fp8_in_place(i, q, None):  # straight into the static buffer
            att = st["att"].transpose(1, 2)
            cache.attend_fp8_decode(i, past, q, k, v, attn.scaling, window, out=att)
        else:
            out = write_and_attend(cache, i, q, k, v, past, past + 1, attn.scaling, None, window)
            st["att"].copy_(out.transpose(1, 2))
        back.replay()
        self.replays += 1
        return st["h"]

    def defer(self, i: int, layer: nn.Module, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Layer i ran a decode step eagerly: it waits for capture at the end of a step, unless
        something in it must run in Python at every step (uncapturable())."""
        self.eager_steps += 1
        if self.failed is not None or i in self.uncaptured:
            return
        why = uncapturable(layer)
        if why is not None:
            self.uncaptured[i] = why
            log.info("reviva: decode layer %d stays eager (%s)", i, why)
            return
        self._pending[i] = (layer, cos, sin)

    def capture_pending(self, h: torch.Tensor, steps_left: int) -> None:
        """At the end of a decode step (h: its hidden state, [batch, 1, hidden]; steps_left:
        decode steps still to come): captures the waiting layers, lowest first, all of them when
        at least CAPTURE_ALL_STEPS steps are to come, else while the device still works through
        the step (at least one per step, at most CAPTURE_MS_MAX of host time)."""
        if not self._pending or h.shape[1] != 1 or torch.is_autocast_enabled(h.device.type):
            return
        t = time.perf_counter()
        step_done = torch.cuda.Event()
        step_done.record(torch.cuda.current_stream(h.device))
        for i in sorted(self._pending):
            layer, cos, sin = self._pending.pop(i)
            self.capture(i, layer, h, cos, sin)
            if steps_left >= CAPTURE_ALL_STEPS:
                continue
            if step_done.query() or (time.perf_counter() - t) * 1e3 >= CAPTURE_MS_MAX:
                break

    def capture_ahead(
        self,
        layers: list[nn.Module],
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        busy: torch.cuda.Event | None = None,
    ) -> None:
        """Before decode: captures the layers that have no graphs yet, lowest first, for decode
        steps shaped like h ([batch, 1, hidden]) and cos/sin ([., 1, rotary dim]). With busy (an
        event just recorded on the compute stream, while prefill's later layers are issued),
        only while the device has not reached it and for at most CAPTURE_MS_MAX; without (the
        end of prefill), all of them. After an out-of-memory here the rest are left to decode's
        captures (capture_pending). A layer that cannot be captured (uncapturable()) is left to
        decode, which keeps it eager."""
        if torch.is_autocast_enabled(h.device.type):  # decode runs eagerly then (ready())
            return
        t = time.perf_counter()
        for i, layer in enumerate(layers):
            if self.failed is not None:
                return
            if i in self.uncaptured or (i in self.layers and self.ready(i, h)):
                continue  # (graphs of another batch or dtype are replaced: capture())
            why = uncapturable(layer)
            if why is not None:
                self.uncaptured[i] = why
                log.info("reviva: decode layer %d stays eager (%s)", i, why)
                continue
            if busy is not None and (
                busy.query() or (time.perf_counter() - t) * 1e3 >= CAPTURE_MS_MAX
            ):
                return
            self.capture(i, layer, h, cos, sin)
            if self.uncaptured.get(i, "").startswith("out of memory"):
                del self.uncaptured[i]  # (decode tries again, when prefill's memory is free)
                return
            self.captured_ahead += i in self.layers
            self.captured_in_layers += busy is not None and i in self.layers

    def capture(
        self,
        i: int,
        layer: nn.Module,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> None:
        """Captures layer i's two graphs for decode steps of h's batch and dtype (cos/sin: a
        step's position embeddings, for their shapes). On failure turns graphs off for the
        manager."""
        if self.failed is not None:
            return
        path = self.path
        t = time.perf_counter()
        try:
            st = self._static
            batch, hidden = h.shape[0], h.shape[2]
            fresh = st.get("h") is None or st["h"].shape[0] != batch or st["h"].dtype != h.dtype
            if fresh:  # (another batch: new static buffers, new graphs)
                self.layers.clear()
                lay = path.layout
                kw = dict(dtype=h.dtype, device=h.device)
                cos_shape = (batch, 1, cos.shape[-1])
                new = {
                    "length": torch.ones(1, dtype=torch.int64, device=h.device),
                    "h": torch.zeros(batch, 1, hidden, **kw),
                    "cos": torch.zeros(cos_shape, dtype=cos.dtype, device=h.device),
                    "sin": torch.zeros(cos_shape, dtype=sin.dtype, device=h.device),
                    "att": torch.zeros(batch, 1, lay.num_heads, lay.head_dim, **kw),
                }
                pool = torch.cuda.graph_pool_handle()
                st.clear()  # all or nothing: a step never sees one batch's h with another's att
                st.update(new)
                self._pool = pool
                self._cos = None
                self._warm.clear()
                self.fused.clear()
                self._length_at = None
            stream = capture_stream(h.device)
            compute = torch.cuda.current_stream(h.device)
            stream.wait_stream(compute)
            shapes = _param_shapes(layer)
            with torch.cuda.stream(stream):
                if self.before_capture is not None:
                    self.before_capture(i)
                if shapes not in self._warm:
                    # Warm-up on this stream (kernels loaded, cuBLAS's workspace for the
                    # stream), on a copy of the hidden state: the static one may hold a step in
                    # progress. Layers of the same shapes run the same kernels.
                    path._qkv(layer, st["h"], 0, 1, st["cos"], st["sin"])
                    path._finish(layer, st["h"].clone(), 0, 1, st["att"])
                    self._warm.add(shapes)
                if self.cache is not None and self.cache.fp8_graphable(i):
                    graphs = self._capture_fused(i, layer)
                else:
                    graphs = self._capture_two(layer)
            compute.wait_stream(stream)
            self.layers[i] = (*graphs, _param_ptrs(layer))
            self.fused.discard(i)
            if graphs[1] is None:
                self.fused.add(i)
            self.captured += 1
        except torch.OutOfMemoryError as e:  # this layer stays eager in this call
            self.uncaptured[i] = f"out of memory while capturing: {e}"[:200]
            log.info("reviva: decode layer %d stays eager (%s)", i, self.uncaptured[i])
        except Exception as e:  # noqa: BLE001 (any other capture failure: decode goes on eagerly)
            self.failed = f"{type(e).__name__}: {e}"
            self.layers.clear()
            self.fused.clear()
            self._pending.clear()
            log.warning("reviva: CUDA graphs for decode turned off (%s)", self.failed)
        finally:
            self.capture_ms += (time.perf_counter() - t) * 1e3

    def _capture_two(self, layer: nn.Module) -> tuple[Any, Any, tuple[torch.Tensor, ...]]:
        """The layer's compute before attention and after it as two graphs (Note [Decode
        graphs]), and the queries, keys and values the first leaves in the graphs' pool."""
        st, path = self._static, self.path
        front = torch.cuda.CUDAGraph()
        with _collection_paused():
            front.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                qkv = path._qkv(layer, st["h"], 0, 1, st["cos"], st["sin"])
            finally:
                front.capture_end()
        back = torch.cuda.CUDAGraph()
        with _collection_paused():
            back.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                path._finish(layer, st["h"], 0, 1, st["att"])
            finally:
                back.capture_end()
        return front, back, qkv

    def _capture_fused(self, i: int, layer: nn.Module) -> tuple[Any, None, tuple[Any, ...]]:
        """Note [fp8 attention in the decode graphs]: layer i's step as one graph with its fp8
        attention inside (None in place of the second graph)."""
        st, path, cache = self._static, self.path, self.cache
        assert cache is not None
        rows = self._rows_dev.get(i)
        if rows is None:
            rows = self._rows_dev[i] = torch.zeros(2, dtype=torch.int64, device=st["h"].device)
        self._rows_at.pop(i, None)  # (written at the first replay)
        attn = path.layout.layers[i].self_attn
        window = path.layout.windows[i] or 0
        graph = torch.cuda.CUDAGraph()
        with _collection_paused():
            graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                q, k, v = path._qkv(layer, st["h"], 0, 1, st["cos"], st["sin"])
                out = st["att"].transpose(1, 2)
                cache.store.attend_fp8_decode_graphed(
                    i, q, k, v, attn.scaling, window, st["length"], rows, out
                )
                path._finish(layer, st["h"], 0, 1, st["att"])
            finally:
                graph.capture_end()
        return graph, None, (q, k, v)


# The parts of a decoder layer that the own decode path calls (LlamaLayerPath._qkv, _finish).
_PARTS = (
    "input_layernorm",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.qkv_proj",
    "self_attn.q_norm",
    "self_attn.k_norm",
    "self_attn.o_proj",
    "post_attention_layernorm",
    "mlp",
)


def uncapturable(layer: nn.Module) -> str | None:
    """Why a decoder layer's decode compute must not be replayed from a graph, or None. A graph
    replays the kernels of its capture and nothing else, so every part the path calls must be
    a plain module whose forward is its kernels: torch's nn.Linear (exactly; not an adapter or a
    quantized subclass whose state may change between calls) or a module of transformers' own
    model code (norms, MLPs, activations), with no forward hooks (and no global module hooks),
    no accelerate hook (it moves weights per call), and not in training mode."""
    from torch.nn.modules import module as torch_module

    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        return "global module forward hooks are registered"
    for part in _PARTS:
        try:
            top = layer.get_submodule(part)
        except AttributeError:  # (q_norm, k_norm: only some families)
            continue
        for sub, m in top.named_modules():
            name = f"{part}.{sub}" if sub else part
            if m._forward_hooks or m._forward_pre_hooks:
                return f"forward hooks on {name}"
            if hasattr(m, "_hf_hook"):
                return f"accelerate hook on {name}"
            if m.training:
                return f"{name} is in training mode"
            kind = type(m)
            plain = kind is nn.Linear or kind.__module__.startswith(
                ("transformers.models.", "transformers.activations", "torch.nn.modules.activation")
            )
            if not plain:
                return f"{name} is a {kind.__module__}.{kind.__qualname__}, not a plain module"
    return None


def _param_ptrs(layer: nn.Module) -> tuple[int, ...]:
    return tuple(p.data_ptr() for p in layer.parameters())


def _param_shapes(layer: nn.Module) -> tuple[tuple[Any, ...], ...]:
    return tuple((tuple(p.shape), p.dtype) for p in layer.parameters())
