"""bench_generate's card-mode driver: the runs (contender, context, on the card or not) in the
order the checks need them, an H200 estimate of each, one worker process per run, the JSON
rewritten as results arrive; a run that does not fit --max-wall-s is skipped, a worker past it
killed, and the calls a worker did not report recorded as failed."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from card import ALLOC_CONF_VARS, WorkerRun, child_environment, say
from common import cell, environment, result_path, write_json
from generate_checks import (
    CHECK_CONTEXTS,
    DRY_CHECK_CONTEXTS,
    MAX_ROOFLINE_RATIO,
    MIN_DECODE_TOK_S,
    PREFILL_LIMIT_FIRST,
    PREFILL_LIMIT_WARM,
    analyse_card,
)
from generate_contenders import card_label, contender_spec, ctx_label, parse_tokens, split_list
from generate_model import ANCHORS, DRY_SHAPE, PCIE_GBPS, SHAPE, kv_bytes_per_token_per_layer
from generate_report import call_summary, print_card_table
from generate_warmup import warm_jit_cache, warm_page_cache
from plots import plot_beside

# Rough H200 figures for the printed wall-time estimates (README/DESIGN anchors).
EST_PREFILL_S = {
    16384: 0.63,
    65536: 3.73,
    131072: 12.0,
    262144: 40.0,
    524288: 145.0,
}  # cuDNN prefill
EST_REVIVA_CARD_TOK_S = {65536: 22.4, 131072: 4.57, 262144: 1.77, 524288: 0.8}
EST_START_S = 12.0  # interpreter, torch, CUDA context, ballast
EST_BUILD_S = 20.0  # the 8B-shaped model, random init on the device
EST_PIN_S_PER_GB = 0.35  # pinning host memory on the H200 host (~0.35 ms per MB)
DONE_GRACE_S = 60.0  # a worker that said DONE and has not exited by then is killed


def _interp_loglog(table: dict[int, float], x: int, below: str = "linear") -> float:
    """Log-log interpolation of a table, extrapolated with its end slopes; below the first
    point linear in x (times), or held (rates: "hold")."""
    pts = sorted(table.items())
    if x <= pts[0][0]:
        return pts[0][1] * (x / pts[0][0] if below == "linear" else 1.0)
    for (x0, y0), (x1, y1) in zip(pts, pts[1:], strict=False):
        if x <= x1:
            f = math.log(x / x0) / math.log(x1 / x0)
            return math.exp(math.log(y0) + f * (math.log(y1) - math.log(y0)))
    (x0, y0), (x1, y1) = pts[-2], pts[-1]
    slope = math.log(y1 / y0) / math.log(x1 / x0)
    return y1 * (x / x1) ** slope


def estimate_s(run: dict[str, Any], args: argparse.Namespace) -> float:
    """Rough H200 wall time of one worker (from the anchors; the dry run is faster)."""
    ctx, spec = run["context"], run["spec"]
    card_gb = run["card_bytes"] / 1e9 if run["card_bytes"] else None
    prefill = _interp_loglog(EST_PREFILL_S, ctx)
    n = args.slow_new_tokens if spec["kind"] == "hf_offload" else args.new_tokens
    oom = card_gb is not None and (
        (spec["kind"] == "hf" and ctx > ANCHORS["card24_hf_max_tokens"] * card_gb / 24)
        or (
            spec["kind"] == "hf_offload"
            and ctx > ANCHORS["card24_hf_offload_max_tokens"] * card_gb / 24
        )
    )
    if oom:
        per_call = 0.5 * prefill
    elif spec["kind"] == "hf":
        per_call = prefill + n / (9.0 * 65536 / max(ctx, 16384))
    elif spec["kind"] == "hf_offload":
        per_call = 1.2 * prefill + n / (0.4 * 65536 / max(ctx, 16384))
    elif card_gb is not None:
        per_call = 1.05 * prefill + n / _interp_loglog(EST_REVIVA_CARD_TOK_S, ctx, "hold")
    else:
        per_call = prefill + n / (26.0 * min(1.0, (65536 / ctx) ** 0.3))
    first_extra = 0.0
    if spec["kind"] == "reviva":  # pinning the host copies inside call 1
        kv_gb = ctx * 128 * 1024 / 1e9
        first_extra = EST_PIN_S_PER_GB * kv_gb
    build = EST_BUILD_S * args.layers / 32
    warm = 5.0 if args.warmup_tokens else 0.0
    return EST_START_S + build + warm + first_extra + run["calls"] * per_call


def card_driver(args: argparse.Namespace, script: Path) -> int:
    """Card mode: every run in a worker process of its own, `script` (bench_generate.py)
    re-run with --card-worker; the JSON rewritten as its calls arrive."""
    from reviva import parse_bytes

    card = args.card
    card_bytes = parse_bytes(card)
    contexts = [parse_tokens(c) for c in split_list(args.contexts)]
    no_card_contexts = (
        [parse_tokens(c) for c in split_list(args.no_card_contexts)]
        if args.no_card_contexts is not None
        else contexts
    )
    on_card = split_list(args.contenders)
    no_card = split_list(args.no_card_contenders)
    runs: list[dict[str, Any]] = []
    for ctx in sorted(set(contexts) | set(no_card_contexts)):
        if args.warmup_tokens and args.warmup_tokens == ctx:
            raise ValueError(
                f"--warmup-tokens {args.warmup_tokens} is the measured shape: a warm-up must "
                "have another"
            )
        card_runs = [
            {
                "mode": "card",
                "card": card,
                "card_bytes": card_bytes,
                "contender": name,
                "spec": contender_spec(name, card),
                "context": ctx,
                "calls": args.calls,
            }
            for name in on_card
            if ctx in contexts
        ]
        no_card_runs = [
            {
                "mode": "no_card",
                "card": None,
                "card_bytes": None,
                "contender": name,
                "spec": contender_spec(name, None),
                "context": ctx,
                "calls": args.no_card_calls or args.calls,
            }
            for name in no_card
            if ctx in no_card_contexts
        ]
        # The checks' data first (a run killed at the device's time limit keeps it): the first
        # card contender, the no-card references, then the other card contenders.
        runs += card_runs[:1] + no_card_runs + card_runs[1:]
    shape = DRY_SHAPE if args.dry_run else SHAPE
    env = environment(cuda=False)
    child_env, removed = child_environment()
    settings = {
        "mode": "card",
        "card": card,
        "card_bytes": card_bytes,
        "card_label": card_label(card),
        "contexts": contexts,
        "contenders": on_card,
        "no_card_contenders": no_card,
        "no_card_contexts": no_card_contexts,
        "calls_per_worker": args.calls,
        "calls_per_no_card_worker": args.no_card_calls or args.calls,
        "new_tokens": args.new_tokens,
        "slow_new_tokens_hf_offload": args.slow_new_tokens,
        "warmup": (
            {"tokens": args.warmup_tokens, "new_tokens": 4} if args.warmup_tokens else "none"
        ),
        "sample_ms": args.sample_ms,
        "allocator": "torch defaults: " + ", ".join(ALLOC_CONF_VARS) + " removed from every "
        "worker's environment; no set_per_process_memory_fraction",
        "removed_from_worker_env": removed,
        "ballast": "cudaMalloc of (device total - card) outside torch's allocator, after "
        "torch.cuda.init() and before the model, in every card worker",
        "between_calls": "nothing: no prepare(), no empty_cache, no gc.collect",
        "token_clock": (
            "a streamer timing each token as generate hands it over (on the host); "
            "the compute stream synchronized at the call's start and end"
        ),
        # Reviva's environment switches the workers inherit (e.g. REVIVA_PIN_HOST_COPIES).
        "reviva_env": {k: v for k, v in os.environ.items() if k.startswith("REVIVA_")},
        "pcie_gbps_for_roofline": PCIE_GBPS,
        "kv_bytes_per_token_per_layer": kv_bytes_per_token_per_layer(
            shape, 4 if args.dry_run else 2
        ),
        "num_layers": args.layers,
        "check_contexts": DRY_CHECK_CONTEXTS if args.dry_run else CHECK_CONTEXTS,
        "thresholds": {
            "min_decode_tok_s": MIN_DECODE_TOK_S,
            "max_roofline_ratio": MAX_ROOFLINE_RATIO,
            "prefill_limit_first_call": PREFILL_LIMIT_FIRST,
            "prefill_limit_later_calls": PREFILL_LIMIT_WARM,
        },
        "max_wall_s": args.max_wall_s,
        "dry_run": args.dry_run,
    }
    model = {
        **shape,
        "num_hidden_layers": args.layers,
        "dtype": "float32 (dry run, CPU)" if args.dry_run else "bfloat16",
        "attn_implementation": "sdpa",
        "weights": "random init",
    }
    if args.dry_run or args.estimate_only or args.cold_page_cache:
        settings["page_cache"] = "not warmed (" + (
            "dry run)"
            if args.dry_run
            else "estimate only)"
            if args.estimate_only
            else "--cold-page-cache)"
        )
    else:
        settings["page_cache"] = warm_page_cache()
        say(f"# page cache: {settings['page_cache']}")
    if args.dry_run or args.estimate_only or args.cold_jit_cache:
        settings["jit_cache"] = "not warmed"
    else:
        settings["jit_cache"] = warm_jit_cache(sorted({run["context"] for run in runs}), script)
        say(f"# CUDA JIT cache: {settings['jit_cache']}")
    estimates = []
    say(f"# card mode, card {card}: {len(runs)} workers")
    for i, run in enumerate(runs):
        run["estimate_s"] = estimate_s(run, args)
        estimates.append({k: run[k] for k in ("mode", "contender", "context", "estimate_s")})
        say(
            f"#   [{i + 1}] {run['mode']:>7} {run['contender']:>14} "
            f"{ctx_label(run['context']):>5}, {run['calls']} calls: ~{run['estimate_s']:.0f} s "
            "(H200 estimate)"
        )
    say(f"# estimated total ~{sum(r['estimate_s'] for r in runs):.0f} s")
    if args.estimate_only:
        return 0

    rows: list[dict[str, Any]] = []
    workers: list[dict[str, Any]] = []
    path = result_path(args.name or f"generate-{card_label(card)}", env, args.out_dir)

    def save(final: bool = False) -> None:
        analysis = analyse_card(rows, settings)
        payload = {
            "environment": env,
            "complete": final,
            "model": model,
            "settings": settings,
            "anchors": ANCHORS,
            "estimates": estimates,
            "workers": workers,
            "runs": rows,
            **analysis,
        }
        write_json(path, payload)

    save()
    say(f"# writing {path} as results arrive")
    t_start = time.perf_counter()
    for i, run in enumerate(runs):
        elapsed = time.perf_counter() - t_start
        record: dict[str, Any] = {
            k: run[k]
            for k in ("mode", "card", "contender", "spec", "context", "calls", "estimate_s")
        }
        workers.append(record)
        if args.max_wall_s and elapsed + run["estimate_s"] > args.max_wall_s:
            record["status"] = (
                f"skipped: estimated {run['estimate_s']:.0f} s, {args.max_wall_s - elapsed:.0f} s "
                f"left of --max-wall-s {args.max_wall_s:.0f}"
            )
            say(f"# [{i + 1}] {record['status']}")
            add_missing_calls(rows, run, args, record["status"])
            save()
            continue
        cmd = [
            sys.executable,
            str(script),
            "--card-worker",
            "--contender",
            run["contender"],
            "--context",
            str(run["context"]),
            "--card",
            run["card"] or "none",
            "--calls",
            str(run["calls"]),
            "--new-tokens",
            str(args.slow_new_tokens if run["spec"]["kind"] == "hf_offload" else args.new_tokens),
            "--warmup-tokens",
            str(args.warmup_tokens),
            "--sample-ms",
            str(args.sample_ms),
            "--layers",
            str(args.layers),
        ] + (["--dry-run"] if args.dry_run else [])
        say(f"# [{i + 1}/{len(runs)}] {' '.join(cmd[1:])}")
        record["command"] = " ".join(cmd[1:])
        t0 = time.perf_counter()
        worker = WorkerRun(cmd, child_env, ("ENV", "WORKER", "CALL", "DONE"), DONE_GRACE_S)

        def on_line(tag: str, obj: Any, record: dict[str, Any] = record) -> None:
            if tag == "TEXT":
                say("  | " + obj)
            elif tag == "ENV":
                for k in ("gpu", "gpu_memory_bytes", "gpu_count", "torch_cuda", "reviva_core"):
                    if k in obj and env.get(k) is None:
                        env[k] = obj[k]
            elif tag == "WORKER":
                record["info"] = obj
                if obj.get("error"):
                    say(f"  ! worker setup: {obj['error'].get('error')}")
                save()
            elif tag == "CALL":
                rows.append(obj)
                say("  = " + call_summary(obj))
                save()
            elif tag == "DONE":
                record["done"] = obj

        deadline = t_start + args.max_wall_s if args.max_wall_s else None
        record["status"] = worker.follow(deadline, on_line)
        record["returncode"] = worker.returncode
        record["wall_s"] = time.perf_counter() - t0
        record["log_tail"] = worker.tail[-60:]
        say(f"# [{i + 1}] {record['status']} after {record['wall_s']:.0f} s")
        setup_error = (record.get("info") or {}).get("error")
        why = f"setup failed: {setup_error['error']}" if setup_error else record["status"]
        add_missing_calls(rows, run, args, why)
        save()

    analysis = analyse_card(rows, settings)
    print_card_table(rows)
    for x in analysis["rooflines"]:
        print(
            f"roofline {x['mode']} {x['contender']} {ctx_label(x['context'])} call {x['call']}: "
            f"measured {x['measured_s'] * 1e3:.1f} ms/token, roofline "
            f"{cell(x['roofline_s'] and x['roofline_s'] * 1e3, '.1f')} ms (compute "
            f"{cell(x['compute_s'] and x['compute_s'] * 1e3, '.1f')}, transfer "
            f"{x['transfer_s'] * 1e3:.1f}) -> {cell(x['ratio_to_roofline'], '.3f')}x"
        )
    print(json.dumps(analysis["checks"], indent=1))
    save(final=True)
    say(f"wrote {path}")
    plot_beside(path)
    return 0


def add_missing_calls(
    rows: list[dict[str, Any]], run: dict[str, Any], args: argparse.Namespace, why: str
) -> None:
    """The calls a worker did not report, as failed rows: a check then sees them as failures."""
    have = {
        r["call"]
        for r in rows
        if (r["mode"], r["contender"], r["context"])
        == (run["mode"], run["contender"], run["context"])
    }
    for call in range(1, run["calls"] + 1):
        if call not in have:
            rows.append(
                {
                    "mode": run["mode"],
                    "card": run["card"],
                    "contender": run["contender"],
                    "context": run["context"],
                    "call": call,
                    "completed": False,
                    "not_run": True,
                    "oom": False,
                    "error": f"not run: {why}",
                }
            )
