"""Long-context generation under a device budget: plain HF (DynamicCache), HF's offloaded cache
(DynamicCache(offloading=True)) and Reviva, on a Llama-3-8B-shaped model (hidden 4096, 32 layers,
32 heads, 8 K/V heads, MLP 14336, vocab 128256, bf16, random weights, SDPA).

    python benchmarks/bench_generate.py [--contexts 16k,64k,128k,256k] [--budgets none,24GB]

Each budget runs in its own process (a fresh allocator), where the budget is enforced for every
contender with torch.cuda.set_per_process_memory_fraction, so exceeding it is a real
out-of-memory. All processes use PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (less
fragmentation under a cap, for every contender alike). Per run: prefill seconds (time to the
first new token), decode tokens/s (after the first new token), peak allocated GB, OOM. Reviva's
decode is compared with its roofline max(compute, non-resident K/V bytes / 55 GB/s), where compute
is Reviva's own decode step with all K/V resident (the no-budget run of the same context).
Writes benchmarks/results/generate-<date>-<sha>.json and prints a table.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, print_table, write_result  # noqa: E402

PCIE_GBPS = 55.0  # pinned H2D, DESIGN.md's performance model (and bench_transfer's measurement)
ANCHORS = {  # DESIGN.md, measured on the same H200 kind
    "hf_64k_decode_tok_s": 8.99,
    "hf_64k_peak_gb": 32.5,
    "hf_64k_prefill_s": 3.73,
    "hf_offload_64k_decode_tok_s": 1.31,
    "hf_offload_64k_peak_gb": 24.2,
}
SHAPE = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    rope_theta=500000.0,
    max_position_embeddings=300_000,
)


def parse_tokens(s: str) -> int:
    s = s.strip().lower()
    return int(s[:-1]) * 1024 if s.endswith("k") else int(s)


# --- worker: one budget, every context and contender ---------------------------------------------


def build_model(layers: int) -> Any:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(**{**SHAPE, "num_hidden_layers": layers}, attn_implementation="sdpa")
    cfg.pad_token_id, cfg.eos_token_id = 0, None
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    return model.eval()


def run_one(model: Any, contender: str, ctx: int, new_tokens: int, budget: str | None) -> dict:
    import torch
    from transformers import DynamicCache

    import reviva
    from reviva.timing import GenerationTimer

    ids = torch.randint(
        1,
        SHAPE["vocab_size"],
        (1, ctx),
        device="cuda",
        generator=torch.Generator(device="cuda").manual_seed(ctx),
    )
    kwargs = dict(max_new_tokens=new_tokens, do_sample=False)
    timer = GenerationTimer("cuda")
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    row: dict[str, Any] = {
        "contender": contender,
        "context": ctx,
        "budget": budget or "none",
        "new_tokens_asked": new_tokens,
    }
    stats = None
    try:
        if contender == "hf":
            timer.begin()
            model.generate(ids, streamer=timer, **kwargs)
        elif contender == "hf_offload":
            cache = DynamicCache(config=model.config, offloading=True)
            timer.begin()
            model.generate(ids, past_key_values=cache, streamer=timer, **kwargs)
            del cache
        elif contender == "reviva":
            cfg = reviva.RevivaConfig(vram_budget=budget) if budget else reviva.RevivaConfig()
            manager = reviva.RevivaManager(model, cfg)
            # Setup, as for a manager reused across calls: pin the host copies (reported apart).
            t = time.perf_counter()
            manager.prepare(1, ctx, new_tokens)
            row["prepare_s"] = time.perf_counter() - t
            timer.begin()
            manager.generate(ids, streamer=timer, **kwargs)
            stats = manager.get_memory_stats()
            del manager
        else:
            raise ValueError(f"unknown contender {contender!r}")
        row["oom"] = False
    except (torch.OutOfMemoryError, reviva.RevivaOutOfMemoryError, MemoryError) as e:
        row["oom"] = True
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    except Exception as e:  # a failure is a result too: recorded, not hidden
        row["oom"] = False
        row["error"] = f"{type(e).__name__}: {e}"[:2000]
        row["traceback"] = traceback.format_exc()[-3000:]
    torch.cuda.synchronize()
    row["prefill_s"] = timer.prefill_s
    row["decode_tok_s"] = timer.decode_tok_s
    row["new_tokens"] = timer.new_tokens
    row["peak_allocated_gb"] = torch.cuda.max_memory_allocated() / 1e9
    row["peak_reserved_gb"] = torch.cuda.max_memory_reserved() / 1e9
    if stats is not None:
        row["reviva"] = stats
    del ids
    gc.collect()
    torch.cuda.empty_cache()
    return row


def worker(args: argparse.Namespace) -> int:
    import torch

    budget = None if args.budget == "none" else args.budget
    t0 = time.perf_counter()
    model = build_model(args.layers)
    weights = torch.cuda.memory_allocated()
    print(f"# model built in {time.perf_counter() - t0:.1f} s, {weights / 1e9:.2f} GB", flush=True)
    if budget:
        import reviva

        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(reviva.parse_bytes(budget) / total)
    # Warm-up (kernels, cuBLAS/cuDNN handles) so that the first measured run is not charged.
    for contender in args.contenders.split(","):
        run_one(model, contender, 1024, 4, budget)
    for ctx in [parse_tokens(c) for c in args.contexts.split(",")]:
        for contender in args.contenders.split(","):
            n = args.new_tokens
            if contender == "hf_offload":  # ~1 token/s at 64k: fewer tokens, same rate
                n = args.slow_new_tokens if ctx < 128 * 1024 else max(2, args.slow_new_tokens // 2)
            t = time.perf_counter()
            row = run_one(model, contender, ctx, n, budget)
            row["wall_s"] = time.perf_counter() - t
            row["weights_gb"] = weights / 1e9
            print("RESULT " + json.dumps(row), flush=True)
    return 0


# --- driver: one worker per budget, then the table and the acceptance figures --------------------


def analyse(rows: list[dict]) -> dict[str, Any]:
    """Rooflines and the issue's acceptance figures, from rows of the same run."""
    by = {(r["contender"], r["context"], r["budget"]): r for r in rows}
    out: dict[str, Any] = {"rooflines": [], "checks": {}}
    for r in rows:
        st = r.get("reviva")
        if r["budget"] == "none" or not st or not r.get("decode_tok_s"):
            continue
        if st["streamed_layers"] == 0:  # everything resident in decode: no transfer roofline
            continue
        free = by.get(("reviva", r["context"], "none"))
        compute_s = 1 / free["decode_tok_s"] if free and free.get("decode_tok_s") else None
        mean_len = r["context"] + r["new_tokens"] / 2
        per_layer = 2 * SHAPE["num_key_value_heads"] * 128 * 2 * mean_len
        nonres = st["streamed_layers"] * per_layer
        transfer_s = nonres / (PCIE_GBPS * 1e9)
        roof_s = max(compute_s or 0.0, transfer_s)
        step_s = 1 / r["decode_tok_s"]
        out["rooflines"].append(
            {
                "context": r["context"],
                "budget": r["budget"],
                "streamed_layers": st["streamed_layers"],
                "resident_layers": st["resident_layers"],
                "nonresident_kv_gb_per_token": nonres / 1e9,
                "measured_h2d_gb_per_token": st["bytes_to_device"]
                / max(st["decode_steps"] + 1, 1)
                / 1e9,
                "compute_s_all_resident": compute_s,
                "transfer_s": transfer_s,
                "roofline_s": roof_s,
                "measured_s": step_s,
                "ratio_to_roofline": step_s / roof_s,
            }
        )
    hf64 = by.get(("hf", 65536, "none"))
    rv64 = by.get(("reviva", 65536, "24GB"))
    if rv64 and hf64:
        roof = next((x for x in out["rooflines"] if x["context"] == 65536), None)
        out["checks"]["64k_24GB"] = {
            "decode_tok_s": rv64.get("decode_tok_s"),
            "decode_ge_12": (rv64.get("decode_tok_s") or 0) >= 12,
            "vs_hf_no_budget_decode": (rv64.get("decode_tok_s") or 0)
            / (hf64.get("decode_tok_s") or float("inf")),
            "ratio_to_roofline": roof and roof["ratio_to_roofline"],
            "within_25pct_of_roofline": bool(roof and roof["ratio_to_roofline"] <= 1.25),
            "prefill_s": rv64.get("prefill_s"),
            "hf_prefill_s_no_budget": hf64.get("prefill_s"),
            "prefill_ratio": (rv64.get("prefill_s") or float("inf")) / (hf64.get("prefill_s") or 1),
            "prefill_le_1_1x": (rv64.get("prefill_s") or float("inf"))
            <= 1.1 * (hf64.get("prefill_s") or 0),
            "peak_allocated_gb": rv64.get("peak_allocated_gb"),
            "peak_le_24GB": (rv64.get("peak_allocated_gb") or 99) <= 24.0,
        }
    for ctx in (131072, 262144):
        rv = by.get(("reviva", ctx, "24GB"))
        if rv:
            roof = next((x for x in out["rooflines"] if x["context"] == ctx), None)
            out["checks"][f"{ctx // 1024}k_24GB"] = {
                "completed": not rv.get("oom") and "error" not in rv,
                "peak_allocated_gb": rv.get("peak_allocated_gb"),
                "decode_tok_s": rv.get("decode_tok_s"),
                "ratio_to_roofline": roof and roof["ratio_to_roofline"],
                "within_20pct_of_roofline": bool(roof and roof["ratio_to_roofline"] <= 1.2),
            }
    hf16, rv16 = by.get(("hf", 16384, "none")), by.get(("reviva", 16384, "none"))
    if hf16 and rv16 and hf16.get("prefill_s") and rv16.get("prefill_s"):
        out["checks"]["16k_none"] = {
            "prefill_ratio": rv16["prefill_s"] / hf16["prefill_s"],
            "decode_ratio": (hf16.get("decode_tok_s") or 0) / (rv16.get("decode_tok_s") or 1e-9),
            "within_5pct": rv16["prefill_s"] <= 1.05 * hf16["prefill_s"]
            and (rv16.get("decode_tok_s") or 0) >= (hf16.get("decode_tok_s") or 0) / 1.05,
        }
    return out


def merge(args: argparse.Namespace) -> int:
    parts = [json.loads(Path(p).read_text()) for p in args.analyse]
    rows = [r for part in parts for r in part["runs"]]
    analysis = analyse(rows)
    print(json.dumps(analysis, indent=1))
    payload = {
        **parts[0],
        "environment": {
            **parts[0]["environment"],
            "merged_from": [
                {
                    "file": Path(p).name,
                    "git_sha": part["environment"]["git_sha"],
                    "command": part["environment"]["command"],
                }
                for p, part in zip(args.analyse, parts, strict=True)
            ],
        },
        "runs": rows,
        **analysis,
    }
    payload.pop("worker_log_tails", None)
    path = write_result(args.name, payload, Path(args.out) if args.out else None)
    print(f"wrote {path}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--contexts", default="16k,64k,128k,256k")
    parser.add_argument("--budgets", default="none,24GB")
    parser.add_argument("--contenders", default="hf,hf_offload,reviva")
    parser.add_argument(
        "--none-contenders",
        default=None,
        help="contenders for budget none (default: --contenders); e.g. reviva alone, for the "
        "compute term of the 128k/256k rooflines",
    )
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument(
        "--slow-new-tokens",
        type=int,
        default=8,
        help="new tokens for HF's offloaded cache (half of it from 128k)",
    )
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    parser.add_argument("--name", default="generate")
    parser.add_argument(
        "--analyse",
        nargs="+",
        metavar="JSON",
        default=None,
        help="merge the runs of earlier result files (e.g. one per budget, from "
        "separate device calls), recompute rooflines and checks, write the merge",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--budget", default="none", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.analyse:
        return merge(args)

    env = environment()
    rows: list[dict] = []
    logs: dict[str, str] = {}
    child_env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    for budget in args.budgets.split(","):
        cmd = [
            sys.executable,
            __file__,
            "--worker",
            "--budget",
            budget,
            "--contexts",
            args.contexts,
            "--contenders",
            args.none_contenders if budget == "none" and args.none_contenders else args.contenders,
            "--new-tokens",
            str(args.new_tokens),
            "--slow-new-tokens",
            str(args.slow_new_tokens),
            "--layers",
            str(args.layers),
        ]
        print(f"# budget {budget}: {' '.join(cmd[1:])}", flush=True)
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env
        )
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("RESULT "):
                row = json.loads(line[7:])
                rows.append(row)
                print(
                    f"  {row['contender']:>10} {row['context'] // 1024:>4}k {budget:>5}: "
                    f"prefill {row.get('prefill_s')} decode {row.get('decode_tok_s')} "
                    f"peak {row['peak_allocated_gb']:.2f} GB oom {row.get('oom')} "
                    f"{row.get('error', '')[:120]}",
                    flush=True,
                )
            else:
                print("  | " + line.rstrip(), flush=True)
        proc.wait()
        logs[budget] = "".join(lines[-200:])
        if proc.returncode != 0:
            print(f"# worker for budget {budget} exited with {proc.returncode}", flush=True)

    analysis = analyse(rows)
    table = []
    for r in rows:

        def f(x: Any, fmt: str) -> str:
            return "-" if x is None else format(x, fmt)

        table.append(
            [
                r["contender"],
                f"{r['context'] // 1024}k",
                r["budget"],
                "OOM" if r.get("oom") else ("ERROR" if "error" in r else "ok"),
                f(r.get("prefill_s"), ".2f"),
                f(r.get("decode_tok_s"), ".2f"),
                f(r.get("peak_allocated_gb"), ".2f"),
                f(r.get("reviva", {}).get("resident_layers"), "d"),
                f(r.get("reviva", {}).get("overlap_ratio"), ".3f"),
            ]
        )
    print_table(
        [
            "contender",
            "context",
            "budget",
            "result",
            "prefill s",
            "decode tok/s",
            "peak GB",
            "resident",
            "overlap",
        ],
        table,
    )
    for x in analysis["rooflines"]:
        print(
            f"roofline {x['context'] // 1024}k {x['budget']}: measured {x['measured_s'] * 1e3:.1f}"
            f" ms/token, roofline {x['roofline_s'] * 1e3:.1f} ms (compute "
            f"{(x['compute_s_all_resident'] or 0) * 1e3:.1f}, transfer {x['transfer_s'] * 1e3:.1f})"
            f" -> {x['ratio_to_roofline']:.3f}x"
        )
    print(json.dumps(analysis["checks"], indent=1))
    payload = {
        "environment": env,
        "model": {
            **SHAPE,
            "num_hidden_layers": args.layers,
            "dtype": "bfloat16",
            "attn_implementation": "sdpa",
            "weights": "random init",
        },
        "settings": {
            "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
            "budget_enforcement": "torch.cuda.set_per_process_memory_fraction",
            "pcie_gbps_for_roofline": PCIE_GBPS,
            "new_tokens": args.new_tokens,
            "slow_new_tokens": args.slow_new_tokens,
        },
        "anchors": ANCHORS,
        "runs": rows,
        **analysis,
        "worker_log_tails": logs,
    }
    path = write_result(args.name, payload, Path(args.out) if args.out else None)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
