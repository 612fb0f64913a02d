"""A Llama-layout decoder layer by chunks of query tokens in a streamed fine-tuning step
(reviva.finetune: where whole layers do not fit, or attention_chunk_tokens=N; Note [Layers by
chunks of query tokens]).

- `refusal`: why a call of the decoder layer must run as HF runs it (None: the chunks compute
  what it computes). Only the Llama layout (Llama, Mistral, Qwen2, Qwen3 decoder layers: an
  input norm, the attention, a post-attention norm, the MLP, two residual additions) with a plain
  causal mask, no cache, no attention dropout and no sliding window shorter than the sequence is
  taken; everything else keeps HF's forward (and the untiled recompute), unchanged.
- `LayerChunks`: one call of such a layer in a step: `forward` (without a graph) and `backward`
  (recomputing each chunk with autograd and back-propagating through it at once).

Note [Layers by chunks of query tokens]
HF's decoder layer over T tokens, recomputed with autograd in its backward (_LayerStep), holds
at its peak ~12-14 rows of the hidden size per token (measured, train_plan.MODEL): the norms'
outputs, q, k and v with RoPE, the attention output and its log-sum-exp, the output
projection's input, the residual, their gradients, and the GQA attention backward's K and V
gradients expanded to every query head. At 256k tokens of Llama-3-8B one row is 2.15 GB. Here
the layer y = h + mlp(norm2(h)), h = x + o_proj(attention(q(norm1(x)), K, V)) runs by chunks of
queries [s, e):
- K and V of every token first (norm1, the k/v projections, the per-head k_norm, RoPE) by
  chunks, into full [B, kv heads, T, D] buffers;
- then for each chunk its q path, its causal attention over K[:, :, :e] and V[:, :, :e] (query
  s + i sees keys 0..s + i; Note [Query chunks in two kernel calls] in train/chunk_attention.py),
  the output projection, the residual, norm2, the MLP and the second residual: the chunk's rows of
  y.
The backward (the forward's graph never existed) computes K and V again, then walks the chunks
from the last: it recomputes the chunk's y with autograd (the chunk's input and K[:, :, :e],
V[:, :, :e] as leaves), back-propagates the output gradient's chunk, and adds the K/V leaves'
gradients into dK and dV; the chunk's rows of dK and dV are then final (later query chunks were
done, earlier ones never see those keys), so the chunk's k/v path is recomputed and
back-propagated at once, into the same input leaf. The full-length tensors of a layer's backward
are thus its input (the checkpoint), K, V, dK, dV, the output gradient and the input gradient,
plus the next checkpoint coming back: ~6 rows (CHUNKED_MODEL in train/plan.py), every other tensor
a chunk's.
dK and dV accumulate in fp32 (fp64 for fp64 models): each query chunk's SDPA backward returns
its partial sums rounded to the model's dtype, and a bf16 accumulator would round once more per
chunk (hundreds at 256k), where HF's one SDPA backward sums over every query in fp32 inside the
kernel and rounds once. They cost 2 x T x kv heads x D x 4 bytes (one row for Llama-3-8B's GQA),
and each chunk's slice is cast to the model's dtype when its k/v path back-propagates, as HF's
would be.
The MLP of a chunk runs once in the backward, with autograd, as in the untiled recompute (Note
[Outputs nobody reads] in train/forwards.py), and the attention's forward once in the layer's
forward and once in its backward: the work of a step is the untiled one's, plus the k/v
projections once more. Trained parameters (LoRA's, norms') get their gradients through the
modules' own autograd, accumulated in .grad over the chunks as a plain backward accumulates them.
A dropout in the projections (LoRA's) draws per chunk; each chunk's generator states (its k/v
path, its query path) are kept in the forward and replayed in the backward (as
token_chunks.TokenChunked does).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from reviva.hf_versions import layer_cache
from reviva.train.chunk_attention import chunk_attention
from reviva.train.token_chunks import chunk_spans, draws_random, rng_restored, rng_state

# The decoder layers whose forward is the Llama layout (input_layernorm, self_attn, a residual,
# post_attention_layernorm, mlp, a residual) that LayerChunks computes, as of transformers 5.17,
# and those four children.
_LLAMA_LAYERS = frozenset(
    {"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer"}
)
_LAYER_CHILDREN = frozenset({"input_layernorm", "self_attn", "post_attention_layernorm", "mlp"})
# The attention modules whose forward is the Llama layout that LayerChunks recomputes
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


def _query_chunk(
    layer: nn.Module,
    x: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:
    """A chunk's rows of the layer's output, [B, c, hidden]: the chunk's input x [B, c, hidden]
    normed, its queries against keys/values [B, kv heads, e, D] (the chunk's being their last c),
    the output projection, the residual, norm2, the MLP and the residual, as HF's layer computes
    them."""
    attn = layer.self_attn
    q = _rope(_heads(attn.q_proj(layer.input_layernorm(x)), attn, "q_norm"), cos, sin)
    o = chunk_attention(q, keys, values, attn.scaling, attn.num_key_value_groups)
    b, c = x.shape[:2]
    h = x + attn.o_proj(o.transpose(1, 2).reshape(b, c, -1))
    return h + layer.mlp(layer.post_attention_layernorm(h))


def _chunk_keys_values(
    layer: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk's K (with RoPE) and V from the chunk's layer input x, [B, kv heads, c, D]."""
    return _keys_values(layer.self_attn, layer.input_layernorm(x), cos, sin)


_State = tuple[torch.Tensor, torch.Tensor | None] | None


class LayerChunks:
    """One call of a Llama-layout decoder layer in a training step by chunks of query tokens
    (Note [Layers by chunks of query tokens]): `forward` without a graph, keeping each chunk's
    generator states where something draws random numbers; `backward` from the layer's input
    and output gradient, replaying them. The layer's norms and MLP must run their own forwards
    (not token_chunks' chunking) while either runs: Finetune's _tiling."""

    def __init__(
        self, layer: nn.Module, cos: torch.Tensor, sin: torch.Tensor, tokens: int, chunk: int
    ) -> None:
        self.layer, self.cos, self.sin = layer, cos, sin
        self.spans = chunk_spans(tokens, chunk)
        self.random = layer.training and draws_random(layer)
        self.kv_states: list[_State] = [None] * len(self.spans)
        self.q_states: list[_State] = [None] * len(self.spans)

    def _keys_values(self, x: torch.Tensor, record: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of every token, [B, kv heads, T, D], without a graph; `record`: keep each
        chunk's generator states (the forward), else replay them (the backward)."""
        b, t = x.shape[:2]
        keys = values = None
        with torch.no_grad():
            for j, (s, e) in enumerate(self.spans):
                if record and self.random:
                    self.kv_states[j] = rng_state(x.device)
                with rng_restored(None if record else self.kv_states[j], x.device):
                    k, v = _chunk_keys_values(
                        self.layer, x[:, s:e], self.cos[:, s:e], self.sin[:, s:e]
                    )
                if keys is None or values is None:
                    keys = k.new_empty((b, k.shape[1], t, k.shape[-1]))
                    values = v.new_empty((b, v.shape[1], t, v.shape[-1]))
                keys[:, :, s:e] = k
                values[:, :, s:e] = v
        assert keys is not None and values is not None
        return keys, values

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's output for x [B, T, hidden], without a graph."""
        keys, values = self._keys_values(x, record=True)
        out = torch.empty_like(x)
        with torch.no_grad():
            for j, (s, e) in enumerate(self.spans):
                if self.random:
                    self.q_states[j] = rng_state(x.device)
                out[:, s:e] = _query_chunk(
                    self.layer,
                    x[:, s:e],
                    keys[:, :, :e],
                    values[:, :, :e],
                    self.cos[:, s:e],
                    self.sin[:, s:e],
                )
        return out

    def backward(self, x: torch.Tensor, dy: torch.Tensor, need_x: bool) -> torch.Tensor | None:
        """The layer input's gradient (None where `need_x` is False); the trained parameters'
        gradients accumulate in their .grad. x: the layer's input, as the forward had it."""
        layer, device = self.layer, x.device
        attn = layer.self_attn
        kv_trained = need_x or any(
            p.requires_grad
            for m in (
                attn.k_proj,
                attn.v_proj,
                getattr(attn, "k_norm", None),
                layer.input_layernorm,
            )
            if isinstance(m, nn.Module)
            for p in m.parameters()
        )
        keys, values = self._keys_values(x, record=False)
        wide = torch.promote_types(keys.dtype, torch.float32)  # (the Note's fp32 accumulation)
        d_keys = torch.zeros(keys.shape, dtype=wide, device=device) if kv_trained else None
        d_values = torch.zeros(values.shape, dtype=wide, device=device) if kv_trained else None
        dx = torch.empty_like(x) if need_x else None
        for j in reversed(range(len(self.spans))):
            s, e = self.spans[j]
            c, si = self.cos[:, s:e], self.sin[:, s:e]
            with torch.enable_grad():
                piece = x[:, s:e].detach().requires_grad_(need_x)
                k_leaf = keys[:, :, :e].detach().requires_grad_(kv_trained)
                v_leaf = values[:, :, :e].detach().requires_grad_(kv_trained)
                with rng_restored(self.q_states[j], device):
                    y = _query_chunk(layer, piece, k_leaf, v_leaf, c, si)
                if y.requires_grad:
                    torch.autograd.backward(y, dy[:, s:e])
                del y
                if d_keys is not None and d_values is not None:
                    if k_leaf.grad is not None:
                        d_keys[:, :, :e] += k_leaf.grad
                    if v_leaf.grad is not None:
                        d_values[:, :, :e] += v_leaf.grad
                    del k_leaf, v_leaf
                    # (the chunk's rows of dK, dV are final: its k/v path back-propagates now)
                    with rng_restored(self.kv_states[j], device):
                        k, v = _chunk_keys_values(layer, piece, c, si)
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
        return dx


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


def refusal(layer: nn.Module, hidden: Any, args: tuple, kwargs: dict[str, Any]) -> str | None:
    """Why this call of the decoder layer (its forward's arguments after the hidden states)
    must run as HF runs it; None where chunks compute what it computes (Note [Layers by chunks of
    query tokens]): a Llama-layout layer of those four children and nothing else, its arguments
    by name, and an attention call that _attention_refusal takes."""
    name = type(layer).__name__
    if name not in _LLAMA_LAYERS:
        return f"{name} is not one of the decoder layers chunked ({sorted(_LLAMA_LAYERS)})"
    children = set(layer._modules)
    if children != _LAYER_CHILDREN:
        return f"{name} with children {sorted(children)}, not {sorted(_LAYER_CHILDREN)}"
    if args:
        return "arguments after the hidden states passed by position"
    rest = dict(kwargs)
    position_embeddings = rest.pop("position_embeddings", None)
    mask = rest.pop("attention_mask", None)
    cache = layer_cache(rest)  # (`cache` from transformers 5.25, `past_key_values` before)
    rest.pop("cache", None)
    rest.pop("past_key_values", None)
    return _attention_refusal(layer.self_attn, hidden, position_embeddings, mask, cache, rest)


def _attention_refusal(
    attn: nn.Module,
    hidden: Any,
    position_embeddings: Any,
    attention_mask: Any,
    past_key_values: Any,
    kwargs: dict[str, Any],
) -> str | None:
    """Why this call of the attention module must run as HF runs it; None where chunks compute
    what it computes: the Llama layout, no cache, RoPE's cos and sin
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
