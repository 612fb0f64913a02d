"""The fused fp8 decode attention's rate (Note [fp8 decode attention]; GPU only).

One layer of the Llama-3-8B shape (32 query heads, 8 K/V heads, dim 128, bf16 queries) in a
resident RevivaCache holding S tokens: a decode step's call (the new token quantized into its row,
then attention over the S + 1 rows read in place) against bf16 K/V of the same length attended as
Reviva's bf16 decode does (flash attention over the store's token-major view), and against the
old fp8 path (blocks dequantized, merged by log-sum-exp). Times from CUDA events over repeated
calls; "GB/s" counts the bytes the call must read (the rows, or the bf16 K/V). The output of the
fused call is checked against fp32 attention over the dequantized rows.

    python benchmarks/bench_fp8_decode.py [--contexts 8k,64k,512k] [--out DIR]

JSON checks: `fp8_decode_kernel` (the fused call within bf16 rounding of fp32, and at 64k at
least as fast per layer as bf16's flash over twice the bytes).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import timed  # noqa: E402
from common import print_table, write_result  # noqa: E402

HEADS, KV_HEADS, DIM = 32, 8, 128


def parse_tokens(text: str) -> int:
    text = text.strip().lower()
    return int(text[:-1]) * 1024 if text.endswith("k") else int(text)


def timed_ms(fn, reps: int) -> float:  # noqa: ANN001
    return timed(fn, reps)[0]


def cache_of(tokens: int, fp8: bool, block_tokens: int = 4096):  # noqa: ANN201
    import reviva
    from reviva.cache.kv_cache import RevivaCache

    res = reviva.device_resources("cuda")
    return RevivaCache(
        res.engine, res.arena, 1, 1, KV_HEADS, DIM, torch.bfloat16, tokens + 1, [0], 0, 1,
        kv_fp8=fp8, block_tokens=block_tokens, runtime=res.runtime, device=torch.device("cuda"),
    )  # fmt: skip


def measure(tokens: int, reps: int) -> dict:
    from reviva.cache import fp8 as kv_fp8
    from reviva.generate.layer_attention import attend_cache

    g = torch.Generator(device="cuda").manual_seed(0)
    scale = DIM**-0.5
    q = torch.randn(1, HEADS, 1, DIM, device="cuda", dtype=torch.bfloat16, generator=g)
    kn = torch.randn(1, KV_HEADS, 1, DIM, device="cuda", dtype=torch.bfloat16, generator=g)
    vn = torch.randn(1, KV_HEADS, 1, DIM, device="cuda", dtype=torch.bfloat16, generator=g)
    fp8, bf16 = cache_of(tokens, True), cache_of(tokens, False)
    for c in (fp8, bf16):
        c.acquire(0)
        for s in range(0, tokens, 8192):  # (prompt K/V written in pieces: no 2x temporaries)
            n = min(8192, tokens - s)
            k = torch.randn(1, KV_HEADS, n, DIM, device="cuda", dtype=torch.bfloat16, generator=g)
            c.write(0, s, k, 0.5 * k.flip(-1))
    out = torch.empty_like(q)
    fused_ms = timed_ms(lambda: fp8.attend_fp8_decode(0, tokens, q, kn, vn, scale, out=out), reps)
    got = fp8.attend_fp8_decode(0, tokens, q, kn, vn, scale, out=out).float()
    k_rows, v_rows = fp8.rows(0, tokens + 1)
    err = None
    if tokens <= 65536:  # (the fp32 reference's temporaries stay small)
        ref = F.scaled_dot_product_attention(
            q.float(),
            kv_fp8.dequantize(k_rows, torch.float32),
            kv_fp8.dequantize(v_rows, torch.float32),
            scale=scale,
            enable_gqa=True,
        )
        err = float((got - ref).abs().max() / ref.abs().max())

    def blocks() -> None:
        attend_cache(fp8, 0, q, tokens, tokens + 1, scale, None)

    blocks_ms = timed_ms(blocks, max(reps // 5, 3))
    bf16.write(0, tokens, kn, vn)

    def flash() -> None:
        attend_cache(bf16, 0, q, tokens, tokens + 1, scale, None)

    flash_ms = timed_ms(flash, reps)
    rows_bytes = 2 * (tokens + 1) * KV_HEADS * (DIM + 4)
    bf16_bytes = 2 * (tokens + 1) * KV_HEADS * DIM * 2
    for c in (fp8, bf16):
        c.release(0)
        c.close()
    return {
        "tokens": tokens,
        "fused_ms": fused_ms,
        "fused_gb_s": rows_bytes / fused_ms / 1e6,
        "blocks_ms": blocks_ms,
        "bf16_flash_ms": flash_ms,
        "bf16_flash_gb_s": bf16_bytes / flash_ms / 1e6,
        "fused_vs_flash": fused_ms / flash_ms,
        "rows_bytes": rows_bytes,
        "max_rel_err_vs_fp32": err,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--contexts", default="8k,64k,512k")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", default=None, help="directory (default benchmarks/results)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_fp8_decode: needs a CUDA device", file=sys.stderr)
        return 2
    rows = [measure(parse_tokens(c), args.reps) for c in args.contexts.split(",")]
    cols = ["tokens", "fused_ms", "fused_gb_s", "blocks_ms", "bf16_flash_ms", "bf16_flash_gb_s",
            "fused_vs_flash", "max_rel_err_vs_fp32"]  # fmt: skip
    print_table(cols, [[r[c] for c in cols] for r in rows])
    at64 = [r for r in rows if r["tokens"] == 65536]
    checks = {
        "fp8_decode_kernel": {
            "criteria": "max |fused - fp32| <= 2^-7 of the largest output where checked; at 64k "
            "the fused call per layer no slower than bf16's flash decode",
            "pass": all(
                r["max_rel_err_vs_fp32"] is None or r["max_rel_err_vs_fp32"] <= 2**-7 for r in rows
            )  # fmt: skip
            and all(r["fused_vs_flash"] <= 1.0 for r in at64)
            and bool(at64),
        }
    }
    out = Path(args.out) if args.out else None
    print(write_result("fp8-decode", {"runs": rows, "checks": checks}, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
