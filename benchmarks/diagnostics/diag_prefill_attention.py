"""Chunked prefill attention of one layer at a long context, by chunk size and kernel (GPU only).

At 256k tokens of the 8B shape on a 24 GB card, prefill takes ~62 s where the same code without
a card takes ~44 s; the card's plan runs 3584-token chunks, the no-card plan 22272. This times
what one layer's chunked prefill attention costs (queries of each chunk against every earlier key
and its own, bottom-right causal), summed over the prompt, for several chunk sizes and kernels:

- `flash`: aten's flash attention with the bottom-right causal mask, K/V read in place from
  Reviva's token-major layout ([S, 1, kv_heads, D] viewed as [1, kv_heads, S, D]) - what
  `chunk_attention` calls today;
- `flash_contiguous`: the same on head-major contiguous K/V (HF's layout);
- `flash_split`: the earlier keys (no mask) and the chunk's own keys (causal, square) in two
  calls merged by log-sum-exp (`block_attention`);
- `cudnn_split`: the same two calls through cuDNN's attention (if this torch has it for these
  shapes; K/V heads expanded when cuDNN refuses grouped heads);
- `whole`: one causal call over the whole prompt (the no-card ideal, same FLOPs).

    python benchmarks/diagnostics/diag_prefill_attention.py [--context 262144]
        [--chunks 3584,8192,22272]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import print_table, write_result  # noqa: E402

from reviva.cache.block_attention import merge  # noqa: E402

HEADS, KV_HEADS, DIM = 32, 8, 128


def flash(q, k, v, causal: bool, scale: float):  # noqa: ANN001, ANN201
    res = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, causal, False, scale=scale
    )
    return res[0], res[1]


def cudnn(q, k, v, causal: bool, scale: float):  # noqa: ANN001, ANN201
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scale
    )
    lse = res[1]
    return res[0], lse.squeeze(-1) if lse.dim() == 4 else lse


def expand(k: torch.Tensor) -> torch.Tensor:
    return k.repeat_interleave(HEADS // KV_HEADS, dim=1)


def chunked(kind: str, q, k, v, chunk: int, scale: float) -> None:  # noqa: ANN001
    total = q.shape[2]
    for start in range(0, total, chunk):
        end = min(total, start + chunk)
        qc = q[:, :, start:end]
        if kind in ("flash", "flash_contiguous"):
            flash(qc, k[:, :, :end], v[:, :, :end], True, scale)
            continue
        fn = flash if kind == "flash_split" else cudnn
        kk, vv = k[:, :, :end], v[:, :, :end]
        if kind == "cudnn_split_expanded":
            kk, vv = expand(kk), expand(vv)
        o, lse = fn(qc, kk[:, :, start:end], vv[:, :, start:end], True, scale)
        if start:
            o2, l2 = fn(qc, kk[:, :, :start], vv[:, :, :start], False, scale)
            merge(o, lse, o2, l2)


def time_ms(fn, reps: int) -> tuple[float, float]:  # noqa: ANN001
    """(first call's ms, wall clock: cuDNN builds a graph per new shape there; the mean of
    `reps` later calls' ms, device clock)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    cold = (time.perf_counter() - t0) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return cold, start.elapsed_time(end) / reps


def last_chunk(kind: str, q, k, v, chunk: int, scale: float) -> torch.Tensor:  # noqa: ANN001
    """The last chunk's attention output by `kind` (for the error against flash)."""
    total = q.shape[2]
    start = (total - 1) // chunk * chunk
    qc = q[:, :, start:]
    if kind in ("flash", "flash_contiguous"):
        return flash(qc, k, v, True, scale)[0].float()
    fn = flash if kind == "flash_split" else cudnn
    kk, vv = (expand(k), expand(v)) if kind == "cudnn_split_expanded" else (k, v)
    o, lse = fn(qc, kk[:, :, start:], vv[:, :, start:], True, scale)
    o2, l2 = fn(qc, kk[:, :, :start], vv[:, :, :start], False, scale)
    return merge(o, lse, o2, l2)[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=262144)
    ap.add_argument("--chunks", default="3584,8192,22272")
    ap.add_argument(
        "--kinds", default="flash,flash_contiguous,flash_split,cudnn_split,cudnn_split_expanded"
    )
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("diag_prefill_attention: needs a GPU", file=sys.stderr)
        return 2
    s = args.context
    g = torch.Generator(device="cuda").manual_seed(0)
    dt = torch.bfloat16
    q = torch.randn(1, HEADS, s, DIM, device="cuda", dtype=dt, generator=g)
    kt = torch.randn(s, 1, KV_HEADS, DIM, device="cuda", dtype=dt, generator=g)
    vt = torch.randn(s, 1, KV_HEADS, DIM, device="cuda", dtype=dt, generator=g)
    k_tm, v_tm = kt.permute(1, 2, 0, 3), vt.permute(1, 2, 0, 3)  # token-major, as Reviva's
    k_hm, v_hm = k_tm.contiguous(), v_tm.contiguous()
    scale = DIM**-0.5
    flops = 4 * HEADS * DIM * s * s / 2  # causal: half the score matrix, QK and PV
    rows: list[dict] = []
    cold, whole = time_ms(lambda: flash(q, k_hm, v_hm, True, scale), args.reps)
    rows.append({"kind": "whole", "chunk": s, "ms": whole, "cold_ms": cold})
    rows[0]["tflops"] = flops / whole / 1e9
    print(f"whole: {whole:.1f} ms", flush=True)
    for kind in args.kinds.split(","):
        for chunk in (int(c) for c in args.chunks.split(",")):
            k, v = (k_hm, v_hm) if kind == "flash_contiguous" else (k_tm, v_tm)
            try:
                cold, ms = time_ms(lambda: chunked(kind, q, k, v, chunk, scale), args.reps)  # noqa: B023
                ref = last_chunk("flash", q, k_tm, v_tm, chunk, scale)
                err = (last_chunk(kind, q, k, v, chunk, scale) - ref).abs().max().item()
                refused = None
            except (RuntimeError, NotImplementedError) as e:  # a kernel that refuses the shapes
                ms = cold = err = None
                refused = str(e).splitlines()[0][:200]
            row = {
                "kind": kind,
                "chunk": chunk,
                "ms": ms,
                "cold_ms": cold,
                "tflops": flops / ms / 1e9 if ms else None,
                "vs_whole": ms / whole if ms else None,
                "max_abs_diff_vs_flash_last_chunk": err,
                "refused": refused,
            }
            rows.append(row)
            print(row, flush=True)
            torch.cuda.empty_cache()
    cols = [
        "kind",
        "chunk",
        "ms",
        "cold_ms",
        "tflops",
        "vs_whole",
        "max_abs_diff_vs_flash_last_chunk",
    ]
    print_table(cols, [[r.get(c) for c in cols] for r in rows])
    write_result(
        "prefill-attention",
        {
            "command": " ".join(sys.argv),
            "context": s,
            "heads": HEADS,
            "kv_heads": KV_HEADS,
            "head_dim": DIM,
            "rows": rows,
        },
        out_dir=Path(args.out) if args.out else None,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
