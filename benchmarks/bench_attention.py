"""Where decode and prefill time goes, for choosing Reviva's attention calls (GPU only).

1. Decode attention, one query token against S keys (Llama-3-8B heads: 32 query, 8 K/V, dim 128,
   bf16): HF's contiguous [1, 8, S, 128] K/V against Reviva's token-major view of [S, 1, 8, 128]
   buffers, through each SDPA backend (forced), the default choice, HF's repeat_kv path, and the
   flash op called directly; times and the largest difference from the default on HF's layout.
2. Bottom-right causal flash attention with grouped K/V heads (what chunked prefill calls),
   against an explicit-mask reference.
3. Prefill of an 8-layer model of the same shape at 64k tokens: plain HF against Reviva with
   whole-prompt and smaller chunks.

    python benchmarks/bench_attention.py [--tokens 65536] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_result  # noqa: E402


def timed(fn, reps: int = 20) -> tuple[float, torch.Tensor]:
    out = fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        out = fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps, out


def decode_attention(tokens: int) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, 8, tokens, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, 8, tokens, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    kt = k.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)  # token-major storage
    vt = v.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)
    scale = 128**-0.5
    ref = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
    rows = []
    for layout, kk, vv in (("hf_contiguous", k, v), ("reviva_token_major", kt, vt)):
        cases = {
            "default": None,
            "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION,
            "math": SDPBackend.MATH,
        }
        for name, backend in cases.items():

            def call(kk=kk, vv=vv, backend=backend):
                if backend is None:
                    return F.scaled_dot_product_attention(q, kk, vv, scale=scale, enable_gqa=True)
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, kk, vv, scale=scale, enable_gqa=True)

            try:
                ms, out = timed(call)
                diff = (out.float() - ref.float()).abs().max().item()
                rows.append({"layout": layout, "call": f"sdpa_{name}", "ms": ms, "max_diff": diff})
            except RuntimeError as e:
                rows.append({"layout": layout, "call": f"sdpa_{name}", "error": str(e)[:200]})

        def direct(kk=kk, vv=vv):
            return torch.ops.aten._scaled_dot_product_flash_attention(
                q, kk, vv, 0.0, False, False, scale=scale
            )[0]

        try:
            ms, out = timed(direct)
            rows.append(
                {
                    "layout": layout,
                    "call": "aten_flash_direct",
                    "ms": ms,
                    "max_diff": (out.float() - ref.float()).abs().max().item(),
                }
            )
        except RuntimeError as e:
            rows.append({"layout": layout, "call": "aten_flash_direct", "error": str(e)[:200]})

        def hf_repeat(kk=kk, vv=vv):
            kr = kk[:, :, None].expand(1, 8, 4, tokens, 128).reshape(1, 32, tokens, 128)
            vr = vv[:, :, None].expand(1, 8, 4, tokens, 128).reshape(1, 32, tokens, 128)
            return F.scaled_dot_product_attention(q, kr, vr, scale=scale)

        ms, out = timed(hf_repeat, reps=5)
        rows.append(
            {
                "layout": layout,
                "call": "repeat_kv_then_sdpa",
                "ms": ms,
                "max_diff": (out.float() - ref.float()).abs().max().item(),
            }
        )
    return rows


def lower_right_check() -> dict:
    g = torch.Generator(device="cuda").manual_seed(1)
    n, total, start = 1024, 4096, 3072
    q = torch.randn(1, 32, n, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, 8, total, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, 8, total, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    out = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, True, False, scale=128**-0.5
    )[0]
    mask = torch.ones(n, total, dtype=torch.bool, device="cuda").tril(diagonal=start)
    kr, vr = k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1)
    ref = F.scaled_dot_product_attention(
        q.float(), kr.float(), vr.float(), attn_mask=mask, scale=128**-0.5
    )
    err = ((out.float() - ref).norm() / ref.norm()).item()
    return {"relative_error": err, "ok": err < 1e-2}


def prefill(tokens: int) -> list[dict]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from generate_model import build_model

    import reviva
    from reviva.cli.timing import GenerationTimer

    model = build_model(8)
    ids = torch.randint(1, 128256, (1, tokens), device="cuda")
    rows = []
    timer = GenerationTimer("cuda")
    for label, chunk in (
        ("hf", None),
        ("reviva_whole", tokens),
        ("reviva_21k", 21504),
        ("reviva_8k", 8192),
        ("reviva_4k", 4096),
        ("hf", None),
    ):
        torch.cuda.reset_peak_memory_stats()
        timer.begin()
        if label == "hf":
            model.generate(ids, max_new_tokens=2, do_sample=False, streamer=timer)
        else:
            m = reviva.RevivaManager(model, reviva.RevivaConfig(chunk_tokens=chunk))
            m.generate(ids, max_new_tokens=2, do_sample=False, streamer=timer)
        rows.append(
            {
                "run": label,
                "chunk": chunk,
                "prefill_s": timer.prefill_s,
                "peak_gb": torch.cuda.max_memory_allocated() / 1e9,
            }
        )
    return rows


def profile_decode(tokens: int) -> dict:
    """torch.profiler over 4 decode steps of an 8-layer model, plain HF and Reviva: the kernels
    that take the time, and wall time per step."""
    from generate_model import build_model
    from torch.profiler import ProfilerActivity, profile

    import reviva
    from reviva.cli.timing import GenerationTimer

    model = build_model(8)
    ids = torch.randint(1, 128256, (1, tokens), device="cuda")
    result = {}
    for label in ("hf", "reviva"):
        timer = GenerationTimer("cuda")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            timer.begin()
            if label == "hf":
                model.generate(ids, max_new_tokens=6, do_sample=False, streamer=timer)
            else:
                reviva.RevivaManager(model).generate(
                    ids, max_new_tokens=6, do_sample=False, streamer=timer
                )
        table = prof.key_averages().table(
            sort_by="cuda_time_total", row_limit=18, max_name_column_width=60
        )
        print(f"--- {label}: decode {timer.decode_tok_s:.2f} tok/s")
        print(table)
        result[label] = {"decode_tok_s": timer.decode_tok_s, "table": table}
    return result


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--out", default=None)
    parser.add_argument("--profile", action="store_true", help="profile decode steps only")
    args = parser.parse_args()
    if args.profile:
        prof = profile_decode(args.tokens)
        write_result("attention-profile", {"profile": prof}, Path(args.out) if args.out else None)
        return 0
    dec = decode_attention(args.tokens)
    print_table(
        ["layout", "call", "ms", "max diff / error"],
        [
            [
                r["layout"],
                r["call"],
                f"{r['ms']:.3f}" if "ms" in r else "-",
                f"{r['max_diff']:.2e}" if "max_diff" in r else r.get("error", "")[:80],
            ]
            for r in dec
        ],
    )
    lr = lower_right_check()
    print(f"bottom-right causal flash with grouped K/V: relative error {lr['relative_error']:.2e}")
    pre = prefill(args.tokens)
    print_table(
        ["run", "chunk", "prefill s", "peak GB"],
        [
            [r["run"], r["chunk"] or "-", f"{r['prefill_s']:.3f}", f"{r['peak_gb']:.2f}"]
            for r in pre
        ],
    )
    path = write_result(
        "attention",
        {"decode_attention": dec, "lower_right": lr, "prefill_8_layers": pre},
        Path(args.out) if args.out else None,
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
