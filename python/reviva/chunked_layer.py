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
  s + i sees keys 0..s + i; Note [Query chunks in two kernel calls]), the output projection, the
  residual, norm2, the MLP and the second residual: the chunk's rows of y.
The backward (the forward's graph never existed) computes K and V again, then walks the chunks
from the last: it recomputes the chunk's y with autograd (the chunk's input and K[:, :, :e],
V[:, :, :e] as leaves), back-propagates the output gradient's chunk, and adds the K/V leaves'
gradients into dK and dV; the chunk's rows of dK and dV are then final (later query chunks were
done, earlier ones never see those keys), so the chunk's k/v path is recomputed and
back-propagated at once, into the same input leaf. The full-length tensors of a layer's backward
are thus its input (the checkpoint), K, V, dK, dV, the output gradient and the input gradient,
plus the next checkpoint coming back: ~6 rows (CHUNKED_MODEL in train_plan.py), every other tensor
a chunk's.
dK and dV accumulate in fp32 (fp64 for fp64 models): each query chunk's SDPA backward returns
its partial sums rounded to the model's dtype, and a bf16 accumulator would round once more per
chunk (hundreds at 256k), where HF's one SDPA backward sums over every query in fp32 inside the
kernel and rounds once. They cost 2 x T x kv heads x D x 4 bytes (one row for Llama-3-8B's GQA),
and each chunk's slice is cast to the model's dtype when its k/v path back-propagates, as HF's
would be.
The MLP of a chunk runs once in the backward, with autograd, as in the untiled recompute (Note
[Outputs nobody reads] in finetune_forwards.py), and the attention's forward once in the layer's
forward and once in its backward: the work of a step is the untiled one's, plus the k/v
projections once more. Trained parameters (LoRA's, norms') get their gradients through the
modules' own autograd, accumulated in .grad over the chunks as a plain backward accumulates them.
A dropout in the projections (LoRA's) draws per chunk; each chunk's generator states (its k/v
path, its query path) are kept in the forward and replayed in the backward (as
token_chunks.TokenChunked does).

Note [Query chunks in two kernel calls]
A chunk's queries [s, e) see every key before s and their own keys causally. SDPA takes that
mask (causal_lower_right(e - s, e)) only by calling the flash kernel's private op itself (torch
2.11's CausalBias), whatever kernel SDPA would choose for the whole sequence. So the chunk runs
as two calls of the kernel SDPA chooses (torch._fused_sdp_choice, so that sdpa_kernel and the
backend switches apply), through its private ops, which return the rows' log-sum-exp:
- its queries over its own keys, causal (a square: the upper-left mask is the lower-right one),
  K and V repeated to every query head (c rows, small);
- its queries over the keys before s without a mask, each K/V head's group of query heads
  stacked as one head's rows ([B, kv heads, groups x c, D]): plain attention of kv heads, whose
  backward returns dK and dV per K/V head (a GQA call's would expand them to every query head:
  two rows of the hidden size per key token for Llama-3-8B's 32 heads over 8).
The outputs merge by their log-sum-exps in fp32 (o = sum of o_i x exp(lse_i - lse), lse =
logaddexp), and the backward calls each kernel's backward with the merged output and
log-sum-exp (as ring attention does): each call's softmax is then the whole row's, and the
gradients of q add up (in fp32, then rounded once), those of K and V fall on disjoint keys. A
kernel without such ops (efficient, math) runs one call under the lower-right mask, one K/V head
at a time (_attend), for the same reason. Rounding: each call's output is rounded to the model's
dtype before the merge, and the merge rounds once more.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.attention import SDPBackend
from torch.nn.attention.bias import causal_lower_right

from reviva.hf_versions import layer_cache
from reviva.token_chunks import chunk_spans, draws_random, rng_restored, rng_state

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


def _takes_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether SDPA under causal_lower_right reads K and V of fewer heads than q (enable_gqa):
    its flash path does, and the materialized mask's path passes enable_gqa on; its efficient
    path (CUDA without flash) would not (torch 2.11's CausalBias._dispatch drops the flag)."""
    if q.device.type != "cuda":
        return True
    from torch.backends.cuda import SDPAParams, can_use_flash_attention

    return bool(can_use_flash_attention(SDPAParams(q, k, v, None, 0.0, False, True)))


def _attend_group(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, groups: int
) -> torch.Tensor:
    """Causal attention of the last q.shape[-2] of k.shape[-2] positions (lower right), q's
    heads `groups` times k's."""
    rows, keys = q.shape[-2], k.shape[-2]
    gqa = groups > 1
    if rows == keys:  # (the first chunk: the upper-left causal mask is the lower-right one)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    if gqa and not _takes_gqa(q, k, v):
        from transformers.models.llama.modeling_llama import repeat_kv

        k, v, gqa = repeat_kv(k, groups), repeat_kv(v, groups), False
    mask = causal_lower_right(rows, keys)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, groups: int
) -> torch.Tensor:
    """_attend_group one K/V head at a time (Note [Layers by chunks of query tokens]):
    q [B, heads, c, D], k and v [B, kv heads, e, D] -> [B, heads, c, D]."""
    if k.shape[1] == 1:
        return _attend_group(q, k, v, scale, groups)
    return torch.cat(
        [
            _attend_group(
                q[:, h * groups : (h + 1) * groups], k[:, h : h + 1], v[:, h : h + 1], scale, groups
            )
            for h in range(k.shape[1])
        ],
        dim=1,
    )


class _Kernel(NamedTuple):
    """An SDPA kernel by its private ops: `forward(q, k, v, causal, scale)` -> (output, the rows'
    log-sum-exp, what its backward needs back), `backward(dO, q, k, v, output, lse, that, causal,
    scale)` -> (dq, dk, dv), which reads the output and log-sum-exp it is given (Note [Query
    chunks in two kernel calls])."""

    name: str
    forward: Callable[..., tuple[torch.Tensor, torch.Tensor, tuple]]
    backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def _cpu_forward(q, k, v, causal: bool, scale: float):  # type: ignore[no-untyped-def]
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, scale=scale
    )
    return out, lse, ()


def _cpu_backward(do, q, k, v, out, lse, _, causal: bool, scale: float):  # type: ignore[no-untyped-def]
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        do, q, k, v, out, lse, 0.0, causal, scale=scale
    )


def _flash_forward(q, k, v, causal: bool, scale: float):  # type: ignore[no-untyped-def]
    r = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return r[0], r[1], tuple(r[2:8])  # cum_seq_q, cum_seq_k, max_q, max_k, rng_state, unused


def _flash_backward(do, q, k, v, out, lse, kept, causal: bool, scale: float):  # type: ignore[no-untyped-def]
    cum_q, cum_k, max_q, max_k, rng, unused = kept
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        do, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, rng, unused, scale=scale
    )


def _cudnn_forward(q, k, v, causal: bool, scale: float):  # type: ignore[no-untyped-def]
    r = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scale
    )
    return r[0], r[1], tuple(r[2:8])  # cum_seq_q, cum_seq_k, max_q, max_k, seed, offset


def _cudnn_backward(do, q, k, v, out, lse, kept, causal: bool, scale: float):  # type: ignore[no-untyped-def]
    cum_q, cum_k, max_q, max_k, seed, offset = kept
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        do,
        q,
        k,
        v,
        out,
        lse,
        seed,
        offset,
        None,
        cum_q,
        cum_k,
        max_q,
        max_k,
        0.0,
        causal,
        scale=scale,
    )


_CPU_FLASH = _Kernel("flash (CPU)", _cpu_forward, _cpu_backward)
_KERNELS = {
    int(SDPBackend.FLASH_ATTENTION): _Kernel("flash", _flash_forward, _flash_backward),
    int(SDPBackend.CUDNN_ATTENTION): _Kernel("cuDNN", _cudnn_forward, _cudnn_backward),
}


def _kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> _Kernel | None:
    """The kernel SDPA would choose for a chunk's queries against keys without a mask, where it
    is one whose log-sum-exp the split attention merges (None: _attend's one call)."""
    kv = k.shape[1]
    choice = torch._fused_sdp_choice(q[:, :kv], k, v, is_causal=False, scale=scale)
    if q.device.type == "cpu":
        return _CPU_FLASH if choice == int(SDPBackend.FLASH_ATTENTION) else None
    return _KERNELS.get(choice)


def _merged(
    out: torch.Tensor, lse: torch.Tensor, out2: torch.Tensor, lse2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two attentions of the same queries over disjoint keys as one: out [B, H, c, D] weighted by
    their log-sum-exps lse [B, H, c] (fp32), in fp32."""
    both = torch.logaddexp(lse, lse2)
    wide = torch.promote_types(out.dtype, torch.float32)
    merged = out.to(wide) * (lse - both).exp().unsqueeze(-1).to(wide)
    merged += out2.to(wide) * (lse2 - both).exp().unsqueeze(-1).to(wide)
    return merged.to(out.dtype), both


class _SplitAttention(torch.autograd.Function):
    """Causal attention of a chunk's queries q [B, H, c, D] (the last c of e positions) over
    k, v [B, kv heads, e, D], as two kernel calls merged (Note [Query chunks in two kernel
    calls])."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        groups: int,
        kernel: _Kernel,
    ) -> torch.Tensor:
        b, heads, c, d = q.shape
        kv, before = k.shape[1], k.shape[2] - c
        ks, vs = (t[:, :, before:].repeat_interleave(groups, dim=1) for t in (k, v))
        out, lse, kept = kernel.forward(q, ks, vs, True, scale)
        lse_shape, kept_before, lse_before_shape = lse.shape, (), lse.shape
        if before:
            qb = q.reshape(b, kv, groups * c, d)
            out_b, lse_b, kept_before = kernel.forward(
                qb, k[:, :, :before], v[:, :, :before], False, scale
            )
            lse_before_shape = lse_b.shape
            out, lse = _merged(
                out,
                lse.reshape(b, heads, c),
                out_b.reshape(b, heads, c, d),
                lse_b.reshape(b, heads, c),
            )
        out = out.contiguous()  # (its rows by K/V head are the before-call's output)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (scale, groups, kernel, kept, kept_before, lse_shape, lse_before_shape)
        return out

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        scale, groups, kernel, kept, kept_before, lse_shape, lse_before_shape = ctx.args
        b, heads, c, d = q.shape
        kv, before = k.shape[1], k.shape[2] - c
        d_out = d_out.contiguous()
        ks, vs = (t[:, :, before:].repeat_interleave(groups, dim=1) for t in (k, v))
        dq, dks, dvs = kernel.backward(
            d_out, q, ks, vs, out, lse.reshape(lse_shape).contiguous(), kept, True, scale
        )
        dk = dks.view(b, kv, groups, c, d).sum(2)
        dv = dvs.view(b, kv, groups, c, d).sum(2)
        if before:
            dq_b, dk_b, dv_b = kernel.backward(
                d_out.view(b, kv, groups * c, d),
                q.reshape(b, kv, groups * c, d),
                k[:, :, :before],
                v[:, :, :before],
                out.view(b, kv, groups * c, d),
                lse.reshape(lse_before_shape).contiguous(),
                kept_before,
                False,
                scale,
            )
            wide = torch.promote_types(dq.dtype, torch.float32)
            dq = (dq.to(wide) + dq_b.reshape(b, heads, c, d).to(wide)).to(dq.dtype)
            dk, dv = torch.cat((dk_b, dk), dim=2), torch.cat((dv_b, dv), dim=2)
        return dq, dk, dv, None, None, None


def _attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, groups: int
) -> torch.Tensor:
    """A chunk's causal attention, q [B, H, c, D] the last c of k's and v's e positions
    [B, kv heads, e, D]: in two kernel calls where SDPA's kernel returns its log-sum-exp, else
    one K/V head a call under the lower-right mask (_attend)."""
    kernel = _kernel(q, k, v, scale)
    if kernel is None:
        return _attend(q, k, v, scale, groups)
    return _SplitAttention.apply(q, k, v, scale, groups, kernel)


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
    o = _attention(q, keys, values, attn.scaling, attn.num_key_value_groups)
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
