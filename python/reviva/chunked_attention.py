"""A decoder layer's attention by chunks of query tokens in a streamed fine-tuning step
(reviva.finetune(..., attention_chunk_tokens=N); Note [Chunked attention]).

- `refusal`: why a call of the HF attention module must run as HF runs it (None: the chunks
  compute what it computes). Only the Llama attention layout (Llama, Mistral, Qwen2, Qwen3) with
  a plain causal mask, no cache, no attention dropout and no sliding window shorter than the
  sequence is taken; everything else keeps HF's forward, unchanged.
- `ChunkedAttention`: the attention module's forward (projections, RoPE, causal attention with
  GQA, the output projection) by chunks of query tokens, saving only its input, K and V; its
  backward recomputes each chunk with autograd and back-propagates through it at once.

Note [Chunked attention]
HF's attention of T tokens in a layer's recompute saves for backward its input (once per
projection), q, k and v with RoPE, the attention output and its log-sum-exp, the output
projection's input; its backward then holds their gradients too: ~10 full-length tensors of the
hidden size's order. Here the forward, without a graph, computes K and V of every token by chunks
(k/v projections, q-style per-head norm, RoPE) into full [B, kv heads, T, D] buffers, then for
each chunk of queries [s, e) its q, its attention over K[:, :, :e] and V[:, :, :e] with the
causal mask aligned to the lower right (query s + i sees keys 0..s + i: torch's
causal_lower_right(e - s, e), which SDPA's flash kernel takes without a [T, T] mask), and its
output projection into the output. It saves its input, K and V (and RoPE's cos and sin). The
backward walks the chunks from the last: it recomputes the chunk's q path with autograd (the
chunk's input and K[:, :, :e], V[:, :, :e] as leaves), back-propagates the output gradient's
chunk, and adds the leaves' gradients into dK and dV; the chunk's rows of dK and dV are then
final (later query chunks were done, earlier ones never see those keys), so the chunk's k/v path
is recomputed and back-propagated at once, into the same input leaf. The full-length tensors of
the recompute and backward are thus the input, K, V, dK, dV, the output and its gradient, and
the input's gradient.
dK and dV accumulate in fp32 (fp64 for fp64 models): each query chunk's SDPA backward returns
its partial sums rounded to the model's dtype, and a bf16 accumulator would round once more per
chunk (hundreds at 128k), where HF's one SDPA backward sums over every query in fp32 inside the
kernel and rounds once. They cost 2 x T x kv heads x D x 4 bytes (one row of the hidden size a
token for Llama-3-8B's GQA), and each chunk's slice is cast to the model's dtype when its k/v
path back-propagates, as HF's would be.
LoRA parameters (and any trained parameter of the projections or norms) get their gradients
through the modules' own autograd, accumulated in .grad over the chunks as a plain backward
accumulates them. A dropout in the projections (LoRA's) draws per chunk; each chunk's generator
state is kept and replayed in its recompute (as token_chunks.TokenChunked does).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.attention.bias import causal_lower_right

from reviva.token_chunks import autocast_state, chunk_spans, draws_random, rng_restored, rng_state

# The attention modules whose forward is the Llama layout that ChunkedAttention recomputes
# (q/k/v/o projections, optional q_norm/k_norm on the head dimension before RoPE, RoPE with
# transformers' apply_rotary_pos_emb, GQA by num_key_value_groups, attn.scaling), as of
# transformers 5.17.
_LLAMA_ATTENTION = frozenset(
    {"LlamaAttention", "MistralAttention", "Qwen2Attention", "Qwen3Attention"}
)
# Keyword arguments an attention interface reads that change what it computes.
_CHANGING = ("position_bias", "s_aux", "sinks", "cu_seq_lens_q", "cu_seq_lens_k", "softcap")


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb on one tensor [B, heads, c, D] (cos, sin: [b, c, D])."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos) + (rotated * sin)


def _heads(proj: torch.Tensor, attn: nn.Module, norm: str) -> torch.Tensor:
    """A projection's output [B, c, heads x D] as [B, heads, c, D], normed per head first where
    the module has that norm (Qwen3's q_norm, k_norm)."""
    b, c = proj.shape[:2]
    x = proj.view(b, c, -1, attn.head_dim)
    module = getattr(attn, norm, None)
    if module is not None:
        x = module(x)
    return x.transpose(1, 2)


def _keys_values(
    attn: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk's K (with RoPE) and V, [B, kv heads, c, D]."""
    k = _rope(_heads(attn.k_proj(x), attn, "k_norm"), cos, sin)
    return k, _heads(attn.v_proj(x), attn, "")


def _takes_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether SDPA under causal_lower_right reads K and V of fewer heads than q (enable_gqa):
    its flash path does, and the materialized mask's path passes enable_gqa on; its efficient
    path (CUDA without flash) would not (torch 2.11's CausalBias._dispatch drops the flag)."""
    if q.device.type != "cuda":
        return True
    from torch.backends.cuda import SDPAParams, can_use_flash_attention

    return bool(can_use_flash_attention(SDPAParams(q, k, v, None, 0.0, False, True)))


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, groups: int
) -> torch.Tensor:
    """Causal attention of the last q.shape[-2] of k.shape[-2] positions (lower right)."""
    rows, keys = q.shape[-2], k.shape[-2]
    gqa = groups > 1
    if rows == keys:  # (the first chunk: the upper-left causal mask is the lower-right one)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    if gqa and not _takes_gqa(q, k, v):
        from transformers.models.llama.modeling_llama import repeat_kv

        k, v, gqa = repeat_kv(k, groups), repeat_kv(v, groups), False
    mask = causal_lower_right(rows, keys)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


def _query_chunk(
    attn: nn.Module,
    x: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:
    """A chunk of queries' attention output after the output projection, [B, c, hidden]: the
    chunk's rows x [B, c, hidden] attend to keys/values [B, kv heads, e, D], the chunk's being
    their last c."""
    q = _rope(_heads(attn.q_proj(x), attn, "q_norm"), cos, sin)
    o = _attend(q, keys, values, attn.scaling, attn.num_key_value_groups)
    b, c = x.shape[:2]
    return attn.o_proj(o.transpose(1, 2).reshape(b, c, -1))


_State = tuple[torch.Tensor, torch.Tensor | None] | None


def _forward(
    attn: nn.Module,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    spans: list[tuple[int, int]],
    states: tuple[list[_State], list[_State]] | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(output, K, V) of the attention by chunks, without a graph (Note [Chunked attention]);
    `states`: lists that receive each chunk's generators' state (k/v chunks, query chunks)
    before it runs (a dropout in the projections), None where nothing draws."""
    b, t = x.shape[:2]
    keys = values = out = None
    for s, e in spans:
        if states is not None:
            states[0].append(rng_state(x.device))
        k, v = _keys_values(attn, x[:, s:e], cos[:, s:e], sin[:, s:e])
        if keys is None or values is None:
            keys = k.new_empty((b, k.shape[1], t, k.shape[-1]))
            values = v.new_empty((b, v.shape[1], t, v.shape[-1]))
        keys[:, :, s:e] = k
        values[:, :, s:e] = v
    assert keys is not None and values is not None
    for s, e in spans:
        if states is not None:
            states[1].append(rng_state(x.device))
        o = _query_chunk(
            attn, x[:, s:e], keys[:, :, :e], values[:, :, :e], cos[:, s:e], sin[:, s:e]
        )
        if out is None:
            out = o.new_empty((b, t, o.shape[-1]))
        out[:, s:e] = o
    assert out is not None
    return out, keys, values


class ChunkedAttention(torch.autograd.Function):
    """out = attn(x) (Llama layout, causal, RoPE of cos/sin) by chunks of `chunk` query tokens,
    saving x, K and V (Note [Chunked attention]). `anchor`: a tensor that needs a gradient, so
    that the backward runs where x needs none (the projections' LoRA parameters get theirs
    through the recompute)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        anchor: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: nn.Module,
        chunk: int,
    ) -> torch.Tensor:
        spans = chunk_spans(x.shape[1], chunk)
        random = attn.training and draws_random(attn)
        states: tuple[list[_State], list[_State]] = ([], [])
        out, keys, values = _forward(attn, x, cos, sin, spans, states if random else None)
        ctx.save_for_backward(x, keys, values, cos, sin)
        ctx.attn, ctx.spans = attn, spans
        ctx.states = states if random else ([None] * len(spans), [None] * len(spans))
        ctx.autocast = autocast_state(x.device)
        return out

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        x, keys, values, cos, sin = ctx.saved_tensors
        attn: nn.Module = ctx.attn
        device = x.device
        need_x = bool(ctx.needs_input_grad[0])
        kv_trained = need_x or any(
            p.requires_grad
            for name in ("k_proj", "v_proj", "k_norm")
            if isinstance(getattr(attn, name, None), nn.Module)
            for p in getattr(attn, name).parameters()
        )
        wide = torch.promote_types(keys.dtype, torch.float32)  # (Note [Chunked attention])
        d_keys = torch.zeros(keys.shape, dtype=wide, device=device) if kv_trained else None
        d_values = torch.zeros(values.shape, dtype=wide, device=device) if kv_trained else None
        dx = torch.empty_like(x) if need_x else None
        autocast = torch.autocast(device.type, dtype=ctx.autocast[1], enabled=ctx.autocast[0])
        kv_states, q_states = ctx.states
        for j in reversed(range(len(ctx.spans))):
            s, e = ctx.spans[j]
            with autocast, torch.enable_grad():
                piece = x[:, s:e].detach().requires_grad_(need_x)
                k_leaf = keys[:, :, :e].detach().requires_grad_(kv_trained)
                v_leaf = values[:, :, :e].detach().requires_grad_(kv_trained)
                c, si = cos[:, s:e], sin[:, s:e]
                with rng_restored(q_states[j], device):
                    out = _query_chunk(attn, piece, k_leaf, v_leaf, c, si)
                if out.requires_grad:
                    torch.autograd.backward(out, d_out[:, s:e])
                del out
                if d_keys is not None and d_values is not None:
                    if k_leaf.grad is not None:
                        d_keys[:, :, :e] += k_leaf.grad
                    if v_leaf.grad is not None:
                        d_values[:, :, :e] += v_leaf.grad
                    del k_leaf, v_leaf
                    # (the chunk's rows of dK, dV are final: its k/v path back-propagates now)
                    with rng_restored(kv_states[j], device):
                        k, v = _keys_values(attn, piece, c, si)
                    pairs = [
                        (t, g[:, :, s:e].to(t.dtype))
                        for t, g in ((k, d_keys), (v, d_values))
                        if t.requires_grad
                    ]
                    if pairs:
                        torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
                    del k, v, pairs
            if dx is not None:
                dx[:, s:e] = piece.grad if piece.grad is not None else 0
        return dx, None, None, None, None, None


def chunked_attention(
    attn: nn.Module,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    chunk: int,
    anchor: torch.Tensor,
) -> torch.Tensor:
    """The attention module's output for x [B, T, hidden] by chunks of `chunk` query tokens:
    ChunkedAttention under autograd, its forward alone without (a layer's forward in a step)."""
    if torch.is_grad_enabled():
        return ChunkedAttention.apply(x, anchor, cos, sin, attn, chunk)
    return _forward(attn, x, cos, sin, chunk_spans(x.shape[1], chunk), None)[0]


# The last mask _plain_causal read and what it found: every layer of a step gets the same mask,
# in its forward and in its recompute (read once, not twice per layer)
_last_mask: tuple[weakref.ReferenceType[torch.Tensor], int, int, bool] | None = None


def _plain_causal(mask: torch.Tensor, tokens: int) -> bool:
    """Whether a 4-D mask [B, 1, T, T] is the causal mask and nothing else: bool (True: attend,
    SDPA's) or additive (0 where attended, the dtype's minimum or -inf elsewhere, eager's).
    Read by chunks of rows: no [T, T] tensor of its own; the same mask unchanged since (its
    version counter) is not read again."""
    global _last_mask
    last = _last_mask
    if last is not None and last[0]() is mask and last[1:3] == (mask._version, tokens):
        return last[3]
    found = _read_plain_causal(mask, tokens)
    _last_mask = (weakref.ref(mask), mask._version, tokens, found)
    return found


def _read_plain_causal(mask: torch.Tensor, tokens: int) -> bool:
    if mask.dim() != 4 or mask.shape[1] != 1 or tuple(mask.shape[-2:]) != (tokens, tokens):
        return False
    keys = torch.arange(tokens, device=mask.device)
    for s, e in chunk_spans(tokens, 1024):
        seen = keys[None, :] <= torch.arange(s, e, device=mask.device)[:, None]  # [c, T]
        rows = mask[:, 0, s:e]
        if mask.dtype == torch.bool:
            ok = rows == seen
        elif mask.is_floating_point():
            ok = torch.where(seen, rows == 0, rows <= torch.finfo(mask.dtype).min)
        else:
            return False
        if not bool(ok.all()):
            return False
    return True


def _attentions_recorded() -> bool:
    """Whether HF's output capture records the attention weights now (output_attentions)."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # (cannot tell: as if it did, HF's own forward)
        return True
    collected = _active_collector.get()
    return bool(collected) and "attentions" in collected


def refusal(
    attn: nn.Module,
    hidden: Any,
    position_embeddings: Any,
    attention_mask: Any,
    past_key_values: Any,
    kwargs: dict[str, Any],
) -> str | None:
    """Why this call of the attention module must run as HF runs it; None where chunks compute
    what it computes (Note [Chunked attention]): the Llama layout, no cache, RoPE's cos and sin
    needing no gradient, no attention dropout in training, no sliding window shorter than the
    sequence, a mask that is the plain causal one (None under sdpa, which is then causal; the
    causal tensor under sdpa or eager), no interface argument that changes the attention."""
    name = type(attn).__name__
    if name not in _LLAMA_ATTENTION:
        return f"{name} is not one of the attention layouts chunked ({sorted(_LLAMA_ATTENTION)})"
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
        return "hidden states that are not one [batch, tokens, hidden] tensor"
    tokens = hidden.shape[1]
    if past_key_values is not None:
        return "a K/V cache"
    if not (isinstance(position_embeddings, tuple | list) and len(position_embeddings) == 2):
        return "no position_embeddings (cos, sin)"
    cos, sin = position_embeddings
    if not all(isinstance(t, torch.Tensor) and t.dim() == 3 for t in (cos, sin)):
        return "position_embeddings that are not [batch, tokens, head_dim] tensors"
    if cos.shape[1] != tokens or sin.shape[1] != tokens:
        return "position_embeddings of another length than the hidden states"
    if cos.requires_grad or sin.requires_grad:
        return "position_embeddings that require a gradient"
    if attn.training and (getattr(attn, "attention_dropout", 0.0) or 0.0) > 0:
        return f"attention dropout {attn.attention_dropout} in training"
    config = getattr(attn, "config", None)
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return "attention logit softcapping"
    if "sliding_window" in vars(attn):  # (Qwen2, Qwen3: per layer; Mistral: the config's)
        window = attn.sliding_window
    else:
        window = getattr(config, "sliding_window", None) if name == "MistralAttention" else None
    if window is not None and window < tokens:
        return f"a sliding window of {window} tokens"
    if not getattr(attn, "is_causal", True) or kwargs.get("is_causal", True) is not True:
        return "non-causal attention"
    changing = [k for k in _CHANGING if kwargs.get(k) is not None]
    if changing:
        return f"attention arguments {changing}"
    implementation = getattr(config, "_attn_implementation", None)
    if attention_mask is None:
        if implementation != "sdpa":  # (eager's None is no mask; flash's reads position_ids)
            return f"no mask under attn_implementation={implementation!r}"
    elif implementation not in ("sdpa", "eager"):
        return f"a mask under attn_implementation={implementation!r}"
    elif not isinstance(attention_mask, torch.Tensor) or not _plain_causal(attention_mask, tokens):
        return "a mask other than the causal one (padding, packed sequences, a window)"
    if implementation == "eager" and (kwargs.get("output_attentions") or _attentions_recorded()):
        return "attention weights returned (output_attentions)"
    return None
