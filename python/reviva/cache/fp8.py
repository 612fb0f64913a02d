"""fp8 K/V: RevivaConfig(kv_dtype="fp8") (issue 13). Opt-in and lossy.

Note [fp8 K/V rows]
~~~~~~~~~~~~~~~~~~~
Each head's key (and value) vector of a token is stored as head_dim e4m3 values and its fp32
scale, amax x fp32(1/448) (448 is e4m3's largest finite value; a product, not a quotient: torch
divides a CUDA tensor by a scalar as a product by its reciprocal and a CPU tensor exactly, and
the rows must be the same bits wherever they are quantized: here, on either device, and by the
core's fused decode call, Note [fp8 decode attention]), in one row of head_dim + 4 bytes. The
KVStore holds these rows as bytes (a uint8 store whose "head_dim" is head_dim + 4), so its
residency, write-through host copies and streaming are unchanged and move half the bytes of
bf16 (head_dim 128: 132 bytes against 256). Scales per token and head: the cache grows a token
at a time and a token's scale never changes once written, and outliers of one head or token do
not cost the others their precision.

Round trip (quantize then dequantize), e4m3 rounding to nearest: each value x of a vector with
scale s comes back within 2^-4 |x| (3 mantissa bits) or, for values below e4m3's smallest
normal (2^-6 s), within 2^-10 s; the result in bf16 adds bf16's own rounding (2^-9 relative).
`round_trip_bound` states it; tests hold the implementation to it.

Reading: attention never sees a whole layer dequantized. The rows are dequantized a block of
tokens at a time and each block attended with its log-sum-exp, merged across blocks (Note
[Block-merged attention] in cache/block_attention.py): the extra device memory is a block, not a
layer.
"""

from __future__ import annotations

from typing import Any

import torch

E4M3_MAX = 448.0
_INV_MAX = torch.tensor(1.0 / E4M3_MAX, dtype=torch.float32)  # fp32(1/448), the scale's factor
SCALE_BYTES = 4  # an fp32 scale per token and head


def row_bytes(head_dim: int) -> int:
    """Bytes of one head's vector of one token as an fp8 row."""
    return head_dim + SCALE_BYTES


def quantize(x: torch.Tensor) -> torch.Tensor:
    """x [..., head_dim] (any float dtype) -> uint8 rows [..., head_dim + 4]: e4m3 values and
    their fp32 scale (Note [fp8 K/V rows])."""
    if x.shape[-1] % SCALE_BYTES != 0:
        raise ValueError(f"fp8 K/V: head_dim must be a multiple of 4, got {x.shape[-1]}")
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax * _INV_MAX, torch.ones_like(amax))
    q = (xf / scale).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    rows = torch.empty(*x.shape[:-1], x.shape[-1] + SCALE_BYTES, dtype=torch.uint8, device=x.device)
    rows[..., : x.shape[-1]] = q.view(torch.uint8)
    rows[..., x.shape[-1] :] = scale.view(torch.uint8)
    return rows


def dequantize(rows: torch.Tensor, dtype: torch.dtype, runtime: Any = None) -> torch.Tensor:
    """uint8 rows [..., head_dim + 4] (views of the store: strided is fine) -> [..., head_dim]
    in `dtype`. With the core's `runtime` of the rows' device, 16-bit output and a view the
    kernel takes (up to 3 leading dimensions, strides and address multiples of 4 bytes: every
    view of the store), one kernel writes the output (Backend::dequantize_fp8_rows_async; on the
    host backend its C++ loop); else torch's ops, with fp32 temporaries. Both give the same
    values to the bit."""
    head_dim = rows.shape[-1] - SCALE_BYTES
    if runtime is not None and _kernel_takes(rows, dtype):
        out = torch.empty(*rows.shape[:-1], head_dim, dtype=dtype, device=rows.device)
        runtime.dequantize_fp8_rows(rows, out)
        return out
    q = rows[..., :head_dim]
    s = rows[..., head_dim:]
    if q.stride(-1) != 1:
        q, s = q.contiguous(), s.contiguous()
    values = q.view(torch.float8_e4m3fn).float()
    scale = _as_fp32(s)
    return (values * scale).to(dtype)


def _kernel_takes(rows: torch.Tensor, dtype: torch.dtype) -> bool:
    return (
        dtype in (torch.bfloat16, torch.float16)
        and rows.dtype == torch.uint8
        and 1 <= rows.dim() <= 4
        and rows.stride(-1) == 1
        and rows.data_ptr() % 4 == 0
        and all(st % 4 == 0 for st in rows.stride()[:-1])
    )


def _as_fp32(s: torch.Tensor) -> torch.Tensor:
    """[..., 4] uint8 -> [..., 1] fp32 (a view when the bytes are aligned, else a copy)."""
    try:
        return s.view(torch.float32)
    except RuntimeError:
        return s.contiguous().view(torch.float32)


def round_trip_bound(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The largest |x - dequantize(quantize(x))| the format allows, elementwise (see the Note):
    2^-4 |x| + 2^-10 s, plus the output dtype's rounding."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax * _INV_MAX, torch.ones_like(amax))
    out_eps = torch.finfo(dtype).eps if dtype.is_floating_point else 0.0
    return xf.abs() * (2**-4) * (1 + out_eps) + scale * 2**-10 + xf.abs() * out_eps


def relative_error(x: torch.Tensor, rows: torch.Tensor | None = None) -> float:
    """||x - round trip|| / ||x|| (Frobenius), for the stats; `rows`: x already quantized."""
    back = dequantize(quantize(x) if rows is None else rows, torch.float32)
    norm = x.float().norm()
    return float((back - x.float()).norm() / norm) if norm > 0 else 0.0
