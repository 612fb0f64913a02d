"""bench_train's in-process mode (the earlier measurement; not how a user runs it): every
contender in this one process, with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True and no
card."""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys

import torch
from card import prepare_device, say
from common import environment, result_path, write_json
from plots import plot_beside
from train_analysis import finish, print_rows
from train_contenders import ANCHORS, DRY_SHAPE, SHAPE, build_model
from train_steps import run_contender


def inprocess(args: argparse.Namespace) -> int:
    if os.environ.get("PYTORCH_CUDA_ALLOC_CONF") is None and not args.dry_run:
        # Expandable segments for every contender, as this mode always measured; set before
        # torch's allocator starts, which only a fresh process guarantees.
        env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    cuda = not args.dry_run and torch.cuda.is_available()
    if not cuda and not args.dry_run:
        raise SystemExit("no CUDA device: use --dry-run")
    env = environment()
    _, _, probe, probe_total = prepare_device(None, cuda)
    model = build_model(args.dry_run)
    device = "cuda" if cuda else "cpu"
    ids = torch.randint(0, model.config.vocab_size, (1, args.seq), device=device)
    rows = []
    for name in [c for c in args.contenders.split(",") if c]:
        say(f"# {name}")
        row = run_contender(name, model, ids, args, cuda, probe, probe_total)
        row["mode"] = "inprocess"
        rows.append(row)
        if not row.get("completed"):
            say(f"  FAILED {row.get('error')}")
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
    analysis = finish(rows, rows, None)
    print_rows(rows)
    print(json.dumps(analysis["checks"], indent=1))
    path = result_path(args.name or "train", env, args.out_dir)
    write_json(
        path,
        {
            "environment": env,
            "complete": True,
            "model": DRY_SHAPE if args.dry_run else SHAPE,
            "seq": args.seq,
            "settings": {"mode": "inprocess", "dry_run": args.dry_run},
            "anchors": ANCHORS,
            "allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
            "runs": rows,
            **analysis,
        },
    )
    say(f"wrote {path}")
    plot_beside(path)
    return 0
