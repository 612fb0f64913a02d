"""Attention over K/V held in token blocks, merged by log-sum-exp (issue 13's first piece).

Note [Block-merged attention]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A query chunk's attention over a layer's keys and values need not see them all at once: the
keys split into blocks, each block's attention gives an output O_b and, per query row, the log of
its softmax denominator L_b = logsumexp_k(q.k * scale). The whole attention is then

    L = logsumexp_b(L_b),    O = sum_b exp(L_b - L) * O_b

(exact in real arithmetic; in floating point the blocks' outputs carry their own rounding, so a
bf16 result is within bf16 rounding of the one-call attention, not bit-identical). So a layer's
K/V can be streamed to the device block by block (or read in place where it already is) and one
layer's K/V never has to be on the device at once: the staging memory is a few blocks, not a
layer.

Causality: the queries are tokens [query_start, query_start + n). A block of keys wholly at or
before query_start is seen in full by every query; the block that holds the queries' own keys
must end exactly at the last query (query_start + n), and is causal aligned at the bottom right
(query j sees the keys up to query_start + j); blocks of later keys are not given. A query row
that sees no key of a block (the bottom-right block shorter than the chunk) takes nothing from
it (its L_b is -inf).

Per block, one fused call where there is one: on CUDA in half precision with head_dim <= 256,
aten's flash attention, which returns L_b, aligns causal masks at the bottom right and reads
grouped K/V heads in place (as `chunk_attention` in generate/layer_attention.py); or cuDNN's
attention (Note [Prefill attention kernel]). Elsewhere (the CPU, fp32) a reference path: scores in
fp32 for the rows of a query slice at a time, grouped heads read in place by folding the query heads
of a group into rows.

Note [Prefill attention kernel]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Chunked prefill at long contexts is attention-bound (at 256k of the 8B shape, 32 layers of
~1.7 s of attention out of a ~62 s prefill). On the H200 (torch 2.11, diag_prefill_attention.py,
prefill-attention-2026-12-02-50eb01c.json) one layer's chunked attention at 256k takes 1.70 s
through aten's flash attention (FA2, 332 TFLOP/s) and 0.96 s through cuDNN's (586 TFLOP/s),
grouped K/V heads read in place from the cache's token-major layout either way. cuDNN's causal
mask is not aligned at the bottom right when queries and keys differ in length, so a chunk's
attention is two calls merged by log-sum-exp: the earlier keys without a mask, and the chunk's
own keys, a square causal block. On the card (8646e57, generate-card24-2026-12-02-8646e57.json)
256k prefill took 45.1 s instead of 62.6 and 512k 145.1 s instead of 234.7.

cuDNN builds an execution plan for each new (queries, keys) shape, the first time a process
meets it: a chunked prefill meets one per chunk (the earlier keys grow by a chunk each time) and
the later layers and calls reuse them. In that run the first layer took 5.4 s (256k) and 5.7 s
(512k) more than the others; in diag_prefill_attention.py the first pass over 256k in 3584-token
chunks took 2.7 s more than the next. So "auto" takes cuDNN only for prompts of at least
CUDNN_MIN_PROMPT tokens, where attention dominates the prefill and the gain outweighs the plans.

RevivaConfig(attention_kernel=...) chooses: "auto" takes cuDNN where torch's cuDNN attention is
enabled on a CUDA device of compute capability 9.0 or later (where it was measured) and the
prompt is long enough, else flash; "flash" and "cudnn" force one ("cudnn" raises where it is not
available). Query chunks shorter than CUDNN_MIN_QUERIES (decode, short tails) keep flash.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from reviva.config import ATTENTION_KERNELS

# Query rows per slice of the reference path: scores of [batch, kv_heads, group * rows, block]
# fp32 values at a time.
_REFERENCE_ROWS = 1024


# Query rows below which cuDNN is not used (decode's one token, a short last chunk): its gain
# was measured on prefill chunks of thousands of queries.
CUDNN_MIN_QUERIES = 128
# Prompts below which "auto" keeps flash (the plans' one-time cost against the gain).
CUDNN_MIN_PROMPT = 131072
# ... when the plan attends by chunks anyway (fp8 K/V where whole attention would cost decode a
# layer: Note [fp8 whole attention] in cache/fp8_reads.py). At 64k of the 8B shape in
# 3584-token chunks flash's attention is ~3.5 s a call and cuDNN's ~2.0 s, against ~18 plans of
# ~37 ms in a process's first call; the two break even near 32k in a first call.
CUDNN_MIN_CHUNKED_PROMPT = 49152


def cudnn_available(device: torch.device) -> bool:
    """Whether torch's cuDNN attention can run on `device` (CUDA, cuDNN present and enabled)."""
    return (
        device.type == "cuda"
        and torch.backends.cudnn.is_available()
        and torch.backends.cuda.cudnn_sdp_enabled()
    )


def resolve_kernel(choice: str, device: torch.device) -> str:
    """RevivaConfig.attention_kernel for `device`: "flash" or "cudnn" (Note [Prefill attention
    kernel]; call_kernel then decides per call). "reference" off CUDA, where neither runs."""
    if choice not in ATTENTION_KERNELS:
        raise ValueError(f"attention_kernel must be one of {ATTENTION_KERNELS}, got {choice!r}")
    if device.type != "cuda":
        return "reference"
    if choice == "cudnn" and not cudnn_available(device):
        raise ValueError(
            "attention_kernel='cudnn': torch's cuDNN attention is not available on "
            f"{device} (cudnn present: {torch.backends.cudnn.is_available()}, cuDNN SDPA "
            f"enabled: {torch.backends.cuda.cudnn_sdp_enabled()})"
        )
    if choice == "auto":
        major = torch.cuda.get_device_capability(device)[0]
        return "cudnn" if cudnn_available(device) and major >= 9 else "flash"
    return choice


def call_kernel(device_kernel: str, choice: str, prompt_tokens: int, chunked: bool = False) -> str:
    """The kernel of one call: `device_kernel` (resolve_kernel's answer for the device), except
    that "auto" keeps flash for prompts shorter than CUDNN_MIN_PROMPT, or CUDNN_MIN_CHUNKED_PROMPT
    when the plan attends by chunks (`chunked`)."""
    least = CUDNN_MIN_CHUNKED_PROMPT if chunked else CUDNN_MIN_PROMPT
    if choice == "auto" and device_kernel == "cudnn" and prompt_tokens < least:
        return "flash"
    return device_kernel


def block_attention(
    q: torch.Tensor,
    blocks: Iterable[tuple[torch.Tensor, torch.Tensor, int]],
    query_start: int,
    scale: float,
    kernel: str = "flash",
) -> torch.Tensor:
    """Attention of queries q ([batch, heads, n, head_dim], tokens [query_start, query_start +
    n)) to the keys and values of `blocks`: (k, v, key_start) with k and v [batch, kv_heads,
    tokens, head_dim] (any strides: views of a cache), covering keys [key_start, key_start +
    tokens). Causal (Note [Block-merged attention]): a block either ends at or before
    query_start + 1 - ... (wholly seen: it ends at or before query_start + 1) or ends exactly at
    query_start + n (bottom-right causal). `kernel`: "flash" or "cudnn" on CUDA (Note [Prefill
    attention kernel]). Returns [batch, heads, n, head_dim] in q's dtype."""
    if q.dim() != 4:
        raise ValueError(
            f"block_attention: q must be [batch, heads, tokens, head_dim], got {tuple(q.shape)}"
        )
    n = q.shape[2]
    end = query_start + n
    out: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    # A few queries (decode): every block's output kept and merged once at the end, a handful of
    # kernels instead of a dozen per block; a prefill chunk's outputs are too large to keep, and
    # merge as they come.
    parts: list[tuple[torch.Tensor, torch.Tensor]] | None = (
        [] if n <= MERGE_AT_END_QUERIES else None
    )
    for k, v, key_start in blocks:
        _check_block(q, k, v, key_start, query_start, end)
        tokens = k.shape[2]
        if tokens == 0:
            continue
        causal = key_start + tokens > query_start + 1
        for o_b, l_b in _block_parts(q, k, v, causal, scale, kernel):
            if parts is not None:
                parts.append((o_b, l_b))
            else:
                out, lse = merge(out, lse, o_b, l_b)
    if parts:
        out = merge_all(parts)
    if out is None:
        raise ValueError("block_attention: no keys (every query must see at least one block)")
    return out.to(q.dtype)


# Queries up to which block_attention keeps every block's output and merges them at once.
MERGE_AT_END_QUERIES = 64


def merge_all(parts: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """The merge of every block's (output, lse) at once: L = logsumexp_b(L_b), O = sum_b
    exp(L_b - L) O_b in fp32 (Note [Block-merged attention]); rows that saw no key of a block
    take nothing from it, rows that saw none at all are 0."""
    lse = torch.stack([l_b for _, l_b in parts]).float()  # [blocks, batch, heads, n]
    outs = torch.stack([o_b for o_b, _ in parts]).float()  # [blocks, batch, heads, n, dim]
    total = torch.logsumexp(lse, dim=0)
    weights = torch.exp(lse - total).nan_to_num(0.0).unsqueeze(-1)
    outs = torch.where(torch.isfinite(lse).unsqueeze(-1), outs, 0.0)
    return (outs * weights).sum(dim=0)


def _check_block(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_start: int,
    query_start: int,
    end: int,
) -> None:
    if k.dim() != 4 or k.shape != v.shape:
        raise ValueError(
            f"block_attention: k and v must be [batch, kv_heads, tokens, head_dim] of one shape, "
            f"got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3] or q.shape[1] % k.shape[1] != 0:
        raise ValueError(
            f"block_attention: a block of shape {tuple(k.shape)} does not fit queries of shape "
            f"{tuple(q.shape)} (same batch and head_dim; kv_heads dividing heads)"
        )
    stop = key_start + k.shape[2]
    if key_start < 0 or (stop > query_start + 1 and stop != end):
        raise ValueError(
            f"block_attention: the block of keys [{key_start}, {stop}) must end at or before "
            f"{query_start + 1} (seen whole by queries [{query_start}, {end})) or exactly at {end} "
            "(bottom-right causal)"
        )


def _block_parts(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, kernel: str
) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
    """(output, lse) pairs whose merge is one block's attention: one call, or with cuDNN and a
    bottom-right causal block longer than the queries, its earlier keys (no mask) and the
    square causal rest (Note [Prefill attention kernel])."""
    n, tokens = q.shape[2], k.shape[2]
    if kernel == "cudnn" and use_cudnn(q) and causal and tokens > n:
        head = tokens - n
        yield attention_with_lse(q, k[:, :, :head], v[:, :, :head], False, scale, kernel)
        yield attention_with_lse(q, k[:, :, head:], v[:, :, head:], True, scale, kernel)
        return
    # (a causal block shorter than the queries: flash's bottom-right mask, cuDNN has none)
    if causal and tokens < n:
        kernel = "flash"
    yield attention_with_lse(q, k, v, causal, scale, kernel)


def use_cudnn(q: torch.Tensor) -> bool:
    """Whether a query chunk q takes cuDNN when the kernel chosen is "cudnn": CUDA, half
    precision, head_dim a multiple of 8 up to 128, at least CUDNN_MIN_QUERIES queries."""
    return (
        q.is_cuda
        and q.dtype in (torch.float16, torch.bfloat16)
        and q.shape[-1] <= 128
        and q.shape[-1] % 8 == 0
        and q.shape[2] >= CUDNN_MIN_QUERIES
    )


def attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
    kernel: str = "flash",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block: (output [batch, heads, n, head_dim], lse [batch, heads, n] fp32). With
    `causal`, aligned at the bottom right (query j sees keys up to tokens - n + j); with
    kernel "cudnn" (used when use_cudnn(q)) a causal block must be square."""
    if kernel == "cudnn" and use_cudnn(q):
        if causal and k.shape[2] != q.shape[2]:
            raise ValueError(
                f"attention_with_lse: cuDNN's causal mask needs as many keys as queries, got "
                f"{k.shape[2]} keys for {q.shape[2]} queries (split the block: _block_parts)"
            )
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=scale
        )
        lse = res[1]
        return res[0], lse.squeeze(-1) if lse.dim() == 4 else lse
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256:
        res = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale
        )
        return res[0], res[1]
    return _reference(q, k, v, causal, scale)


def _reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    batch, heads, n, dim = q.shape
    kv_heads, tokens = k.shape[1], k.shape[2]
    group = heads // kv_heads
    # The heads of a group share their K/V head: folded into rows, they read it in place.
    qg = q.reshape(batch, kv_heads, group, n, dim)
    kf, vf = k.float(), v.float()
    outs, lses = [], []
    for s in range(0, n, _REFERENCE_ROWS):
        e = min(n, s + _REFERENCE_ROWS)
        rows = qg[:, :, :, s:e].float().reshape(batch, kv_heads, group * (e - s), dim)
        scores = torch.matmul(rows, kf.transpose(-1, -2)) * scale
        if causal:  # query s + j (of the chunk) sees keys up to tokens - n + s + j
            pos = torch.arange(s, e, device=q.device).unsqueeze(1) + (tokens - n)
            seen = torch.arange(tokens, device=q.device).unsqueeze(0) <= pos
            scores = scores.masked_fill(~seen.repeat(group, 1), float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        weights = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
        o = torch.matmul(weights, vf)
        outs.append(o.reshape(batch, kv_heads, group, e - s, dim))
        lses.append(lse.reshape(batch, kv_heads, group, e - s))
    out = torch.cat(outs, dim=3).reshape(batch, heads, n, dim)
    return out, torch.cat(lses, dim=3).reshape(batch, heads, n)


def merge(
    out: torch.Tensor | None,
    lse: torch.Tensor | None,
    o_b: torch.Tensor,
    l_b: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Folds one block's (output, lse) into the running (output fp32, lse fp32)."""
    l_b = l_b.float()
    seen = torch.isfinite(l_b).unsqueeze(-1)  # rows that saw no key of the block take nothing
    o_b = torch.where(seen, o_b.float(), 0.0)
    if out is None or lse is None:
        return o_b, l_b
    total = torch.logaddexp(lse, l_b)
    # Rows that saw nothing yet in either: total is -inf; their weights are 0 (nan_to_num).
    w_old = torch.exp(lse - total).nan_to_num(0.0).unsqueeze(-1)
    w_new = torch.exp(l_b - total).nan_to_num(0.0).unsqueeze(-1)
    return out * w_old + o_b * w_new, total


def split_blocks(
    k: torch.Tensor, v: torch.Tensor, query_start: int, n: int, block_tokens: int
) -> Sequence[tuple[torch.Tensor, torch.Tensor, int]]:
    """The keys [0, query_start + n) of k and v ([batch, kv_heads, tokens, head_dim]) as blocks of
    at most `block_tokens` for block_attention: views, the last block ending at the last query,
    the earlier ones ending at or before query_start + 1."""
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be > 0, got {block_tokens}")
    end = query_start + n
    if k.shape[2] < end:
        raise ValueError(f"split_blocks: {k.shape[2]} keys, queries up to {end}")
    # The last block: at least the queries' own keys (so that its earlier part holds keys seen
    # whole), at most block_tokens unless the chunk is longer.
    last_start = max(0, end - max(block_tokens, n))
    blocks = []
    s = 0
    while s < last_start:
        e = min(last_start, s + block_tokens)
        blocks.append((k[:, :, s:e], v[:, :, s:e], s))
        s = e
    blocks.append((k[:, :, last_start:end], v[:, :, last_start:end], last_start))
    return blocks
