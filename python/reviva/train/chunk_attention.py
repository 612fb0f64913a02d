"""A query chunk's causal attention over the keys up to its end, in a layer run by chunks of
query tokens (train/chunked_layer.py): `chunk_attention`.

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

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.nn import functional as F
from torch.nn.attention import SDPBackend
from torch.nn.attention.bias import causal_lower_right


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


def chunk_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, groups: int
) -> torch.Tensor:
    """A chunk's causal attention, q [B, H, c, D] the last c of k's and v's e positions
    [B, kv heads, e, D]: in two kernel calls where SDPA's kernel returns its log-sum-exp, else
    one K/V head a call under the lower-right mask (_attend)."""
    kernel = _kernel(q, k, v, scale)
    if kernel is None:
        return _attend(q, k, v, scale, groups)
    return _SplitAttention.apply(q, k, v, scale, groups, kernel)
