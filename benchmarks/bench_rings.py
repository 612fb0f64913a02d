"""Sliding-window layers kept as rings of their window on a card (issue 15's `rings_64k` check).

    python benchmarks/bench_rings.py [--out DIR] [--prompt 65536] [--new-tokens 32] [--calls 2]
                                     [--first rings|norings] [--dry-run]

The Mistral-7B-v0.1 shape (hidden 4096, 32 layers, 32 heads, 8 K/V heads, MLP 14336, vocab
32000, every layer a 4096-token sliding window; random bf16 weights, SDPA) on a 24 GB card (card
mode: a ballast outside torch's allocator, its allocator at the defaults), one
RevivaManager(model, RevivaConfig(vram_budget="24GB")) per fresh worker process making --calls
calls of a --prompt-token prompt in a row: one worker with rings (the default, Note [Window rings]
in python/reviva/cache/window_rings.py), one with REVIVA_WINDOW_RINGS=0 (every token kept: the
planner sizes each layer by the call, and streamed sliding layers fetch their window's tail). Per
call: prefill s (to the first new token), decode tok/s (the steps after the first), the card's peak
(mem_get_info polled), the plan's layers and the store's bytes.

Check `rings_64k`: every call of both workers completes; with rings every layer is a ring; the
pinned host bytes of the K/V are fewer with rings; each rings call decodes at least as fast as
the no-rings call of the same number. Writes rings-<date>-<sha>.json. --dry-run: a tiny model
on the CPU (window 16, 300-token prompt).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import environment, run_worker, write_result  # noqa: E402

from reviva.cli.models import PRESETS  # noqa: E402

# the CLI's preset (python -m reviva plan --model mistral-7b), as MistralConfig's fields
MISTRAL = {
    **{k: v for k, v in PRESETS["mistral-7b"].items() if k not in ("architectures", "model_type")},
    "max_position_embeddings": 131072,
    "rope_theta": 10000.0,
}
DRY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=211,
    max_position_embeddings=4096,
    sliding_window=16,
)
STATS = (
    "window_ring_layers",
    "window_ring_tokens",
    "resident_layers",
    "streamed_layers",
    "resident_layers_in_prefill",
    "promoted_layers",
    "host_bytes",
    "kv_cache_bytes",
    "kv_device_peak_bytes",
    "fetch_window_layers",
    "chunk_tokens",
    "own_decode_attention",
)


def build(dry_run: bool) -> Any:
    import torch
    from transformers import AutoModelForCausalLM, MistralConfig

    cfg = MistralConfig(**(DRY if dry_run else MISTRAL), attn_implementation="sdpa")
    cfg.pad_token_id, cfg.eos_token_id = 0, None
    torch.manual_seed(0)
    if dry_run:
        return AutoModelForCausalLM.from_config(cfg).eval()
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    return model.eval()


def worker(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from bench_beams import timed
    from card import CardSampler, prepare_device

    from reviva import RevivaConfig, RevivaManager

    card = None if args.dry_run else 24 * 10**9
    info, ballast, probe, card_bytes = prepare_device(card, cuda=not args.dry_run)
    if "error" in info:
        return {"device": info, "error": info["error"]}
    sync = (lambda: None) if args.dry_run else torch.cuda.synchronize
    model = build(args.dry_run)
    manager = RevivaManager(model, RevivaConfig(vram_budget=None if args.dry_run else "24GB"))
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(1, model.config.vocab_size, (1, args.prompt), generator=g)
    ids = ids.to(model.device)
    calls = []
    for call in range(args.calls):
        sampler = CardSampler(probe)
        try:
            with sampler:
                row = timed(manager.generate, ids, args.new_tokens, sync)
            steps = row.pop("step_s")
            row["decode_tok_s"] = len(steps) / sum(steps) if steps else None
            row["card_peak_bytes"] = card_bytes - sampler.min_free
            st = manager.get_memory_stats()
            row["stats"] = {k: st[k] for k in STATS}
            row["stats"]["decode_bytes_to_device"] = st["decode"]["bytes_to_device"]
        except Exception as e:  # noqa: BLE001 (recorded)
            row = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        row["call"] = call + 1
        calls.append(row)
        print(f"call {call + 1}: {json.dumps(row, default=str)[:700]}", flush=True)
    if ballast is not None:
        ballast.free()
    return {"device": info, "calls": calls}


def analyse(parts: dict[str, Any], calls: int, layers: int) -> dict[str, Any]:
    rings, plain = parts["rings"].get("calls", []), parts["norings"].get("calls", [])
    complete = (
        len(rings) == calls and len(plain) == calls and not any("error" in c for c in rings + plain)
    )
    faster, all_rings, host_fewer = [], False, False
    if complete:
        faster = [
            (r["decode_tok_s"] or 0) >= (p["decode_tok_s"] or float("inf"))
            for r, p in zip(rings, plain, strict=True)
        ]
        all_rings = all(c["stats"]["window_ring_layers"] == layers for c in rings)
        host_fewer = all(
            r["stats"]["host_bytes"] < p["stats"]["host_bytes"] or p["stats"]["host_bytes"] == 0
            for r, p in zip(rings, plain, strict=True)
        )

    def row(c: dict[str, Any]) -> dict[str, Any]:
        if "error" in c:
            return {"error": c["error"]}
        keep = ("prefill_s", "decode_tok_s", "median_step_s", "new_tokens")
        return {
            **{k: c.get(k) for k in keep},
            "card_peak_gb": (c.get("card_peak_bytes") or 0) / 1e9,
            **c["stats"],
        }

    return {
        "rings_64k": {
            "pass": bool(complete and all_rings and host_fewer and all(faster)),
            "rings": [row(c) for c in rings],
            "no_rings": [row(c) for c in plain],
            "decode_ratio": [
                (r.get("decode_tok_s") or 0) / p["decode_tok_s"]
                for r, p in zip(rings, plain, strict=False)
                if p.get("decode_tok_s") and "error" not in r
            ],
            "errors": {
                name: parts[name].get("error")
                or [c["error"] for c in parts[name].get("calls", []) if "error" in c]
                for name in ("rings", "norings")
            },
            "limit": "every call completes on a 24 GB card; with rings every sliding layer is a "
            "ring, the pinned host K/V is smaller, and each call decodes at least as fast as "
            "the same call without rings (REVIVA_WINDOW_RINGS=0)",
        }
    }


def driver(args: argparse.Namespace) -> int:
    parts: dict[str, Any] = {}
    t0 = time.perf_counter()
    order = ("rings", "norings") if args.first == "rings" else ("norings", "rings")
    for part in order:
        cmd = [sys.executable, __file__, "--worker", part, f"--prompt={args.prompt}"]
        cmd += [f"--new-tokens={args.new_tokens}", f"--calls={args.calls}"]
        cmd += ["--dry-run"] if args.dry_run else []
        extra = {"REVIVA_WINDOW_RINGS": "1" if part == "rings" else "0"}
        left = max(args.max_wall_s - (time.perf_counter() - t0), 10)
        parts[part] = run_worker(cmd, extra, left)
    checks = analyse(parts, args.calls, (DRY if args.dry_run else MISTRAL)["num_hidden_layers"])
    result = {
        "environment": environment(cuda=False),
        "settings": vars(args) | {"shape": DRY if args.dry_run else MISTRAL, "order": order},
        "checks": checks,
        "parts": parts,
    }
    for k, v in checks.items():
        print(f"{k}: {'PASS' if v['pass'] else 'FAIL'} {json.dumps(v, default=str)[:1500]}")
    path = write_result("rings-cpu" if args.dry_run else "rings", result, args.out)
    print(f"# wrote {path}")
    return 0 if all(v["pass"] for v in checks.values()) else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt", type=int, default=65536)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--calls", type=int, default=2)
    p.add_argument(
        "--first",
        choices=("rings", "norings"),
        default="rings",
        help="which worker runs first (a cold machine's first process pays for its start)",
    )
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--max-wall-s", type=float, default=560)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.dry_run and args.prompt == 65536:
        args.prompt = 300
    if args.worker:
        try:
            result = worker(args)
        except Exception as e:  # noqa: BLE001 (recorded)
            result = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-4000:]}
        print("WORKER " + json.dumps(result, default=str), flush=True)
        return 0
    return driver(args)


if __name__ == "__main__":
    raise SystemExit(main())
