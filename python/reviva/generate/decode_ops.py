"""A decoder layer's decode step on Reviva's row operations (Note [Decode row ops] in
src/row_ops.cpp): the layer's RMSNorms (the residual add folded into the second), its RoPE and its
gated MLP's activation as one kernel each where HF's modules run ~35 small kernels, around the same
projections. Used in the one-graph decode step of a layer whose attention reads fp8 K/V in place
(Note [fp8 attention in the decode graphs] in generate/decode_graphs.py), where the small kernels'
launches and tails took a quarter of a 64k step; elsewhere HF's modules run, for HF's exact numbers.

A layer takes these operations only where it computes what they compute: Llama-style RMSNorms
(`variance_epsilon`, a weight of the hidden state's dtype, no Gemma-style `1 + weight`), RoPE over
the whole head (HF's rotate_half), a gated MLP with SiLU; and where `RowOpsStep.agrees` finds the
step's outputs equal to HF's modules' within rounding on the layer's own weights (checked once
per layer shape, before capture)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from reviva.resources import device_resources

# A layer's step on the row operations against HF's modules on the same input: the largest
# difference allowed, relative to the largest magnitude of HF's output. RMSNorm's sum of squares
# in another order moves a few values by one unit of bf16 (2^-8); a different formula (Gemma's
# 1 + weight, partial or interleaved RoPE, another activation) moves them by far more.
AGREEMENT = 2e-2


def unsupported(layer: nn.Module, layout: Any, dtype: torch.dtype, cos: torch.Tensor) -> str | None:
    """Why layer's decode step cannot run on the row operations (None: it can, subject to
    RowOpsStep.agrees), naming the part; cos: a step's position embedding."""
    if dtype not in (torch.bfloat16, torch.float16):
        return f"hidden state of {dtype} (the row operations take bf16 and fp16)"
    if cos.dtype != dtype or cos.shape[-1] != layout.head_dim:
        return f"position embeddings of {cos.dtype} {tuple(cos.shape)} (RoPE over part of a head)"
    if layout.fused_qkv:
        return "one q/k/v projection"
    if hasattr(layer, "pre_feedforward_layernorm"):
        return "Gemma-style norms around each sublayer"
    for name in ("input_layernorm", "post_attention_layernorm"):
        norm = getattr(layer, name, None)
        weight = getattr(norm, "weight", None)
        if not isinstance(getattr(norm, "variance_epsilon", None), float) or weight is None:
            return f"{name} is not an RMSNorm with variance_epsilon ({type(norm).__name__})"
        if weight.dtype != dtype or weight.dim() != 1:
            return f"{name}'s weight is {weight.dtype} {tuple(weight.shape)}, not {dtype} [hidden]"
    mlp = getattr(layer, "mlp", None)
    if not all(isinstance(getattr(mlp, p, None), nn.Linear) for p in ("gate_proj", "up_proj")):
        return f"the MLP is not a gated MLP ({type(mlp).__name__})"
    if not isinstance(getattr(mlp, "down_proj", None), nn.Linear):
        return f"the MLP has no down_proj ({type(mlp).__name__})"
    act = getattr(mlp, "act_fn", None)
    if not isinstance(act, nn.SiLU) and type(act).__name__ != "SiLUActivation":
        return f"the MLP's activation is {type(act).__name__}, not SiLU"
    return None


class RowOpsStep:
    """A layer's decode compute before attention (qkv) and after it (finish) on the row
    operations, as LlamaLayerPath._qkv and _finish compute it with HF's modules."""

    def __init__(self, layout: Any, device: torch.device) -> None:
        self.layout = layout
        self.runtime = device_resources(device).runtime

    def qkv(
        self, layer: nn.Module, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys (RoPE applied, except in a NoPE layer) and values of h's one token,
        [batch, heads, 1, head_dim], as LlamaLayerPath._qkv returns them."""
        attn, lay = layer.self_attn, self.layout
        norm = layer.input_layernorm
        x = torch.empty_like(h)
        self.runtime.rms_norm(h, norm.weight, norm.variance_epsilon, x)
        shape = (h.shape[0], 1, -1, lay.head_dim)
        q = attn.q_proj(x).view(shape)
        k = attn.k_proj(x).view(shape)
        v = attn.v_proj(x).view(shape).transpose(1, 2)
        if hasattr(attn, "q_norm"):
            q = attn.q_norm(q)
        if hasattr(attn, "k_norm"):
            k = attn.k_norm(k)
        if getattr(attn, "use_rope", True):
            self.runtime.rotary(q[:, 0], k[:, 0], cos[:, 0], sin[:, 0])
        return q.transpose(1, 2), k.transpose(1, 2), v

    def finish(self, layer: nn.Module, h: torch.Tensor, out: torch.Tensor) -> None:
        """o_proj of the attention output [batch, 1, heads, head_dim], the residual add and the
        MLP: h ([batch, 1, hidden]) in place."""
        o = layer.self_attn.o_proj(out.reshape(h.shape[0], 1, -1))
        norm, mlp = layer.post_attention_layernorm, layer.mlp
        x = torch.empty_like(o)
        self.runtime.rms_norm(o, norm.weight, norm.variance_epsilon, x, residual=h)
        gate = mlp.gate_proj(x)
        self.runtime.silu_mul(gate, mlp.up_proj(x), gate)
        h.add_(mlp.down_proj(gate))

    def agrees(
        self,
        path: Any,
        layer: nn.Module,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        att: torch.Tensor,
    ) -> str | None:
        """Runs the step both ways on copies of h (att standing in for attention's output):
        None when every output agrees within AGREEMENT, else what differed and by how much."""
        theirs = path._qkv(layer, h, 0, 1, cos, sin)
        ours = self.qkv(layer, h, cos, sin)
        h_theirs, h_ours = h.clone(), h.clone()
        path._finish(layer, h_theirs, 0, 1, att)
        self.finish(layer, h_ours, att)
        pairs = zip(("q", "k", "v", "h"), (*ours, h_ours), (*theirs, h_theirs), strict=True)
        for name, a, b in pairs:
            if a.shape != b.shape:
                return f"{name} of shape {tuple(a.shape)}, HF's {tuple(b.shape)}"
            scale = b.float().abs().max().item()
            diff = (a.float() - b.float()).abs().max().item()
            if not diff <= AGREEMENT * max(scale, 1e-6):
                return f"{name} differs from HF's modules' by {diff:.3g} (largest {scale:.3g})"
        return None
