"""bench_generate's fraction mode (the earlier measurement, kept for comparison; not how a user
runs it): one process per budget with every contender in it, the budget enforced with
torch.cuda.set_per_process_memory_fraction and expandable segments, a warm-up of every contender
and Reviva's prepare() before its timed run; its checks are 64k_24GB, 128k_24GB, 256k_24GB and
16k_none."""

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

from card import CallTimer
from common import cell, environment, print_table, write_result
from generate_contenders import parse_tokens
from generate_model import ANCHORS, PCIE_GBPS, SHAPE, build_model
from plots import plot_beside


def run_one(model: Any, contender: str, ctx: int, new_tokens: int, budget: str | None) -> dict:
    import torch
    from transformers import DynamicCache

    import reviva

    ids = torch.randint(
        1,
        SHAPE["vocab_size"],
        (1, ctx),
        device="cuda",
        generator=torch.Generator(device="cuda").manual_seed(ctx),
    )
    kwargs = dict(max_new_tokens=new_tokens, do_sample=False)
    timer = CallTimer(lambda: torch.cuda.current_stream().synchronize())
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
            stats = manager.get_memory_stats().to_dict()
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


def fraction_worker(args: argparse.Namespace) -> int:
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


def analyse_fraction(rows: list[dict]) -> dict[str, Any]:
    """Rooflines and the issue's acceptance figures, from rows of the same run."""
    by = {(r["contender"], r["context"], r["budget"]): r for r in rows}
    out: dict[str, Any] = {"rooflines": [], "checks": {}}
    for r in rows:
        st = r.get("reviva")
        if r["budget"] == "none" or not st or not r.get("decode_tok_s"):
            continue
        if st.get("streamed_layers", 0) == 0:  # everything resident: no transfer roofline
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
                "resident_layers": st.get("resident_layers"),
                "nonresident_kv_gb_per_token": nonres / 1e9,
                "measured_h2d_gb_per_token": st.get("bytes_to_device", 0)
                / max(st.get("decode_steps", 0) + 1, 1)
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


def merge_fraction(args: argparse.Namespace, parts: list[dict[str, Any]]) -> int:
    rows = [r for part in parts for r in part["runs"]]
    analysis = analyse_fraction(rows)
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
    path = write_result(args.name or "generate", payload, args.out_dir)
    print(f"wrote {path}")
    plot_beside(path)
    return 0


def fraction_driver(args: argparse.Namespace, script: str) -> int:
    """Fraction mode: one worker process per budget, `script` (bench_generate.py) re-run
    with --mode fraction --worker."""
    env = environment()
    rows: list[dict] = []
    logs: dict[str, str] = {}
    child_env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    for budget in args.budgets.split(","):
        cmd = [
            sys.executable,
            script,
            "--mode",
            "fraction",
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
        assert proc.stdout is not None
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

    analysis = analyse_fraction(rows)
    table = []
    for r in rows:
        table.append(
            [
                r["contender"],
                f"{r['context'] // 1024}k",
                r["budget"],
                "OOM" if r.get("oom") else ("ERROR" if "error" in r else "ok"),
                cell(r.get("prefill_s"), ".2f"),
                cell(r.get("decode_tok_s"), ".2f"),
                cell(r.get("peak_allocated_gb"), ".2f"),
                cell(r.get("reviva", {}).get("resident_layers"), "d"),
                cell(r.get("reviva", {}).get("overlap_ratio"), ".3f"),
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
            "mode": "fraction",
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
    path = write_result(args.name or "generate", payload, args.out_dir)
    print(f"wrote {path}")
    plot_beside(path)
    return 0
