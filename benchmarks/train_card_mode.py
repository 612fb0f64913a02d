"""bench_train's card mode: the worker (`--worker`: one contender in a fresh process, under a
ballast of (device total - card) when it runs on the card) and the driver (the runs, an H200
estimate of each, one worker per run, the JSON rewritten as rows arrive)."""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from card import (
    ALLOC_CONF_VARS,
    WorkerRun,
    child_environment,
    emit,
    error_fields,
    prepare_device,
    rss_bytes,
    safe,
    say,
)
from common import environment, result_path, write_json
from plots import plot_beside
from train_analysis import finish, print_rows
from train_contenders import ANCHORS, DRY_SHAPE, SHAPE, build_model, contender_spec
from train_steps import run_contender

import reviva

# Rough H200 seconds for the printed estimates.
EST_START_S, EST_BUILD_S = 12.0, 6.0
EST_STEP_S = {"plain": 0.16, "save_on_cpu": 1.07, "reviva": 0.3, "growth": 0.3}
DONE_GRACE_S = 60.0


def worker(args: argparse.Namespace) -> int:
    card = None if args.card == "none" else args.card
    cuda = not args.dry_run and torch.cuda.is_available()
    head: dict[str, Any] = {
        "contender": args.contender,
        "mode": "card" if card else "no_card",
        "card": card,
        "pid": os.getpid(),
        "allocator_env": {k: os.environ.get(k) for k in ALLOC_CONF_VARS},
        "device": "cuda" if cuda else "cpu (dry run)",
    }
    say(f"# worker pid {os.getpid()}: {args.contender}, {head['mode']}")
    if not cuda and not args.dry_run:
        emit("ROW", {**head, "completed": False, "error": "no CUDA device (use --dry-run)"})
        return 2
    prepared, ballast, probe, probe_total = prepare_device(
        reviva.parse_bytes(card) if card else None, cuda
    )
    head["device_setup"] = prepared
    if "error" in prepared:
        emit("ROW", {**head, "completed": False, "error": prepared["error"]["error"]})
        return 3
    emit("ENV", environment())
    try:
        t = time.perf_counter()
        model = build_model(args.dry_run)
        head["build_s"] = time.perf_counter() - t
        head["params"] = sum(p.numel() for p in model.parameters())
        vocab = model.config.vocab_size
        device = "cuda" if cuda else "cpu"
        gen = torch.Generator(device=device).manual_seed(0)
        ids = torch.randint(0, vocab, (1, args.seq), device=device, generator=gen)
        say(f"# model built in {head['build_s']:.1f} s; {args.steps} steps + warm-up")
    except Exception as e:
        emit("ROW", {**head, **error_fields(e), "completed": False})
        gc.collect()
        if ballast is not None:
            ballast.free()
        emit("DONE", {"rss_bytes": rss_bytes(), "setup_failed": True})
        return 0
    row = run_contender(args.contender, model, ids, args, cuda, probe, probe_total)
    emit("ROW", {**head, **row})
    del model, ids
    gc.collect()
    if cuda:
        safe(torch.cuda.synchronize)
        safe(torch.cuda.empty_cache)
    if ballast is not None:
        ballast.free()
    emit("DONE", {"rss_bytes": rss_bytes()})
    return 0


def estimate_s(name: str, args: argparse.Namespace) -> float:
    kind = contender_spec(name)["kind"]
    if kind == "growth":
        work = args.growth_steps * EST_STEP_S["growth"]
    else:
        work = (args.steps + 2) * EST_STEP_S[kind] + (3.0 if kind == "plain" else 0.0)
    return EST_START_S + EST_BUILD_S + work


def driver(args: argparse.Namespace, script: Path) -> int:
    """Card mode: every contender in a worker process of its own, `script` (bench_train.py)
    re-run with --worker; the JSON rewritten as rows arrive."""
    card = args.card
    reviva.parse_bytes(card)
    on_card = [c for c in args.contenders.split(",") if c]
    no_card = [c for c in args.no_card_contenders.split(",") if c]
    runs = [("no_card", c) for c in no_card] + [("card", c) for c in on_card]
    for _, name in runs:
        contender_spec(name)  # every name checked before any run
    env = environment(cuda=False)
    child_env, removed = child_environment()
    settings = {
        "mode": "card",
        "card": card,
        "seq": args.seq,
        "steps": args.steps,
        "growth_steps": args.growth_steps,
        "contenders": on_card,
        "no_card_contenders": no_card,
        "sample_ms": args.sample_ms,
        "allocator": "torch defaults: " + ", ".join(ALLOC_CONF_VARS) + " removed from every "
        "worker's environment; no set_per_process_memory_fraction",
        "removed_from_worker_env": removed,
        "ballast": "cudaMalloc of (device total - card) outside torch's allocator, after "
        "torch.cuda.init() and before the model, in every card worker",
        "dry_run": args.dry_run,
        "max_wall_s": args.max_wall_s,
    }
    estimates = []
    say(f"# card mode, card {card}: {len(runs)} workers")
    for mode, name in runs:
        est = estimate_s(name, args)
        estimates.append({"mode": mode, "contender": name, "estimate_s": est})
        say(f"#   {mode:>7} {name:>18}: ~{est:.0f} s (H200 estimate)")
    say(f"# estimated total ~{sum(e['estimate_s'] for e in estimates):.0f} s")
    if args.estimate_only:
        return 0
    rows: list[dict[str, Any]] = []
    workers: list[dict[str, Any]] = []
    path = result_path(args.name or "train-card", env, args.out_dir)

    def save(final: bool = False) -> dict[str, Any]:
        analysis = finish(rows, [r for r in rows if r.get("mode") == "card"], card)
        write_json(
            path,
            {
                "environment": env,
                "complete": final,
                "model": DRY_SHAPE if args.dry_run else SHAPE,
                "settings": settings,
                "anchors": ANCHORS,
                "estimates": estimates,
                "workers": workers,
                "runs": rows,
                **analysis,
            },
        )
        return analysis

    save()
    say(f"# writing {path} as results arrive")
    t_start = time.perf_counter()
    for i, ((mode, name), est) in enumerate(zip(runs, estimates, strict=True)):
        record: dict[str, Any] = {"mode": mode, "contender": name, "estimate_s": est["estimate_s"]}
        workers.append(record)
        elapsed = time.perf_counter() - t_start
        if args.max_wall_s and elapsed + est["estimate_s"] > args.max_wall_s:
            record["status"] = (
                f"skipped: estimated {est['estimate_s']:.0f} s, {args.max_wall_s - elapsed:.0f} s "
                f"left of --max-wall-s {args.max_wall_s:.0f}"
            )
            rows.append(
                {"mode": mode, "contender": name, "completed": False, "error": record["status"]}
            )
            say(f"# [{i + 1}] {record['status']}")
            save()
            continue
        cmd = [
            sys.executable,
            str(script),
            "--worker",
            "--contender",
            name,
            "--card",
            card if mode == "card" else "none",
            "--steps",
            str(args.steps),
            "--seq",
            str(args.seq),
            "--growth-steps",
            str(args.growth_steps),
            "--sample-ms",
            str(args.sample_ms),
        ] + (["--dry-run"] if args.dry_run else [])
        record["command"] = " ".join(cmd[1:])
        say(f"# [{i + 1}/{len(runs)}] {record['command']}")
        t0 = time.perf_counter()
        got: list[dict] = []

        def on_line(tag: str, obj: Any, record: dict[str, Any] = record, got: list = got) -> None:
            if tag == "TEXT":
                say("  | " + obj)
            elif tag == "ENV":
                for k in ("gpu", "gpu_memory_bytes", "gpu_count", "torch_cuda", "reviva_core"):
                    if k in obj and env.get(k) is None:
                        env[k] = obj[k]
            elif tag == "ROW":
                got.append(obj)
                rows.append(obj)
                say(
                    f"  = {obj.get('mode')} {obj['contender']}: "
                    + (
                        f"step {obj.get('step_s')} s, peak {obj.get('peak_gb')} GB, card peak "
                        f"{obj.get('card_peak_used_gb')} GB"
                        if obj.get("completed")
                        else f"FAILED {obj.get('error')}"
                    )
                )
                save()
            elif tag == "DONE":
                record["done"] = obj

        deadline = t_start + args.max_wall_s if args.max_wall_s else None
        worker_run = WorkerRun(cmd, child_env, ("ENV", "ROW", "DONE"), DONE_GRACE_S)
        record["status"] = worker_run.follow(deadline, on_line)
        record["returncode"] = worker_run.returncode
        record["wall_s"] = time.perf_counter() - t0
        record["log_tail"] = worker_run.tail[-60:]
        if not got:
            rows.append(
                {
                    "mode": mode,
                    "contender": name,
                    "completed": False,
                    "error": f"no result: {record['status']}",
                }
            )
        say(f"# [{i + 1}] {record['status']} after {record['wall_s']:.0f} s")
        save()
    analysis = save(final=True)
    print_rows(rows)
    print(json.dumps(analysis["checks"], indent=1))
    say(f"wrote {path}")
    plot_beside(path)
    return 0
