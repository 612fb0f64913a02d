"""The Llama-layout decoder layer, computed by Reviva where HF's forward cannot run as is.

Prefill: one decoder layer over the whole prompt, by token chunks (projections, attention of a
chunk's queries against the keys so far, MLP), writing the layer's K/V into a RevivaCache and
updating the hidden states in place, so that the working set does not grow with the prompt.
Decode with Reviva's own attention call: the new token's queries against the cache's
token-major K/V, grouped heads read in place. A cache stores and this module computes
(STYLE.md): the cache never calls into here, the manager wires the two together.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from reviva.adapters import DecoderLayout
from reviva.kv_cache import RevivaCache
from reviva.planner import Plan


class LlamaLayerPath:
    """Prefill and own-decode of one layout's decoder layers (see the module docstring)."""

    def __init__(self, layout: DecoderLayout) -> None:
        self.layout = layout

    def prefill(
        self,
        cache: RevivaCache,
        plan: Plan,
        i: int,
        layer: nn.Module,
        h: torch.Tensor,
        kwargs: dict[str, Any],
    ) -> torch.Tensor:
        """One decoder layer over the whole prompt, by token chunks, in place on `h`."""
        if torch.is_grad_enabled():
            raise RuntimeError("RevivaManager prefill runs under torch.no_grad() (generate does)")
        attn = layer.self_attn
        mask = kwargs.get("attention_mask")
        if "position_embeddings" not in kwargs:
            raise ValueError(
                "RevivaManager: the decoder layer was called without position_embeddings "
                "(the Llama layout passes them from model.model.rotary_emb)"
            )
        cos, sin = kwargs["position_embeddings"]
        whole = plan.chunk_tokens >= h.shape[1]
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, None)
        if (whole or plan.whole_attention) and interface is None:
            raise ValueError(
                f"RevivaManager: attention implementation {attn.config._attn_implementation!r} "
                "is not registered with transformers"
            )
        cache.acquire(i)
        try:
            # All of the prompt's K/V is written in this call: map it at once, not by chunks.
            cache.store.reserve(i, h.shape[1])
            if whole or not plan.whole_attention:
                self._prefill_fused(cache, plan, i, layer, h, cos, sin, mask, interface)
            else:
                self._prefill_whole_attention(cache, plan, i, layer, h, cos, sin, mask, interface)
        finally:
            cache.release(i)
        return h

    def decode(
        self, cache: RevivaCache, i: int, layer: nn.Module, h: torch.Tensor, kwargs: dict[str, Any]
    ) -> torch.Tensor:
        """A decode step of one layer with Reviva's own attention call, in place on `h`: the new
        tokens' queries against the cache's token-major K/V, grouped heads read in place (no
        concatenation, no expansion). For CUDA in half precision without a padding mask."""
        past = cache.get_seq_length(i)
        cos, sin = kwargs["position_embeddings"]
        cache.acquire(i)
        try:
            self._rows(cache, i, layer, h, 0, h.shape[1], past, cos, sin, None, None)
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
        """Queries, keys (both with RoPE) and values of tokens [s, e), [B, heads, n, D]."""
        attn = layer.self_attn
        x = layer.input_layernorm(h[:, s:e])
        shape = (h.shape[0], e - s, -1, self.layout.head_dim)
        q = attn.q_proj(x).view(shape)
        k = attn.k_proj(x).view(shape)
        if hasattr(attn, "q_norm"):
            q = attn.q_norm(q)
        if hasattr(attn, "k_norm"):
            k = attn.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = attn.v_proj(x).view(shape).transpose(1, 2)
        q, k = self.layout.apply_rotary_pos_emb(q, k, cos[:, s:e], sin[:, s:e])
        return q, k, v

    @staticmethod
    def _finish(layer: nn.Module, h: torch.Tensor, s: int, e: int, out: torch.Tensor) -> None:
        """o_proj of the attention output [B, n, heads, D], residual, MLP: h[:, s:e] in place."""
        o = layer.self_attn.o_proj(out.reshape(h.shape[0], e - s, -1))
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

    def _prefill_fused(self, cache, plan, i, layer, h, cos, sin, mask, interface) -> None:  # noqa: ANN001
        """Chunk by chunk: a chunk's queries attend to the keys of all tokens up to its end, which
        this and earlier chunks have written, so one pass suffices and a chunk's input rows are
        dead once its output is written."""
        tokens, chunk = h.shape[1], plan.chunk_tokens
        for s in range(0, tokens, chunk):
            e = min(tokens, s + chunk)
            whole = s == 0 and e == tokens
            self._rows(cache, i, layer, h, s, e, s, cos, sin, mask, interface if whole else None)

    def _rows(self, cache, i, layer, h, s, e, first, cos, sin, mask, interface) -> None:  # noqa: ANN001
        """Rows [s, e) of h are tokens [first, first + e - s): their projections, their K/V into
        the cache, their attention to every token up to the last of them, o_proj and the MLP, in
        place. With `interface`, attention is HF's own call (the whole prompt at once: the same
        numbers as HF); else Reviva's bottom-right causal call on the cache's layout."""
        q, k, v = self._qkv(layer, h, s, e, cos, sin)
        last = first + e - s
        cache.write(i, first, k, v)
        k_all, v_all = cache.view(i, last)
        if interface is not None:
            out = self._attend_hf(layer.self_attn, q, k_all, v_all, mask, interface)
        else:
            out = chunk_attention(q, k_all, v_all, mask, first, last, layer.self_attn.scaling)
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


def chunk_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    start: int,
    end: int,
    scale: float,
) -> torch.Tensor:
    """Attention of the queries of tokens [start, end) to the keys of tokens [0, end):
    causal aligned at the bottom right (query j sees keys <= start + j). [B, H, n, D] out."""
    if mask is not None:  # HF's 4D mask (padding): its rows of this chunk
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask[:, :, start:end, :end], scale=scale, enable_gqa=True
        )
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256:
        # Flash attention's causal mask is bottom-right aligned when queries and keys differ in
        # length, and it reads grouped K/V heads without expanding them.
        return torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, True, False, scale=scale
        )[0]
    n = end - start
    causal = torch.ones(n, end, dtype=torch.bool, device=q.device).tril(diagonal=start)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal, scale=scale, enable_gqa=True)
