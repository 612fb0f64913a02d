"""Mixture-of-experts weights streamed with only the routed experts moving (issue 15's
`experts_decode` check; Note [Routed experts] in python/reviva/weights/routed_experts.py).

    python benchmarks/bench_experts.py [--out DIR] [--model mixtral-8x7b|qwen3-30b-a3b]
                                       [--layers 8] [--card-gb G] [--prompt 4096]
                                       [--new-tokens 32] [--calls 2] [--first routed|all]
                                       [--dry-run]

--model is a preset of `python -m reviva plan`: mixtral-8x7b (the default: hidden 4096, MLP
14336, 8 experts with 2 routed per token, 32/8 heads, vocab 32000; 8 layers are 23.4 GB of bf16
weights, 2.9 GB a layer of which a token's two experts are 0.7 GB; a 12 GB card) or qwen3-30b-a3b
(hidden 2048, 128 experts of MLP 768 with 8 routed per token, 32/4 heads of 128, vocab 151936; 8
layers are 11.2 GB, 1.25 GB a layer of which a token's eight experts are 75 MB: many small
copies; a 6 GB card), cut to --layers decoder layers, on a --card-gb card (card mode: a ballast
outside torch's allocator, its allocator at the defaults), built on the meta device and filled
layer by layer into pinned host memory (random values, SDPA). One
RevivaManager(model, RevivaConfig(vram_budget=card)) per fresh worker process makes --calls calls
of a --prompt-token prompt in a row: one worker routed (the default), one with
REVIVA_ROUTED_EXPERTS=0 (each streamed layer's experts one block: every expert moves each step).
Per call: prefill s, decode tok/s (the steps after the first), the decode phase's weight bytes a
step, the card's peak, the plan's resident and streamed layers.

Check `experts_decode`: every call of both workers completes; the routed worker's decode moves,
per step and streamed layer, no more than the layer's first block and its k routed experts'
bytes (the all-experts worker's: the whole layer); each routed call decodes at least twice as
fast as the all-experts call of the same number. Writes experts-<date>-<sha>.json (Mixtral) or
experts-<model>-<date>-<sha>.json. --dry-run: a tiny model of the family on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import environment, run_worker, write_result  # noqa: E402

from reviva.cli.models import PRESETS  # noqa: E402

PCIE_H2D_BPS = 55e9  # DESIGN.md, "Performance model"
MODELS = {
    name: {k: v for k, v in PRESETS[name].items() if k != "architectures"}
    for name in ("mixtral-8x7b", "qwen3-30b-a3b")
}
CARD_GB = {"mixtral-8x7b": 12.0, "qwen3-30b-a3b": 6.0}  # about half the 8 layers' weights
TINY = dict(
    hidden_size=64,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=211,
    num_experts_per_tok=2,
)
DRY = {
    "mixtral-8x7b": dict(TINY, model_type="mixtral", num_local_experts=8, sliding_window=None),
    "qwen3-30b-a3b": dict(
        TINY, model_type="qwen3_moe", head_dim=16, num_experts=8, moe_intermediate_size=48
    ),
}


def shape(args: argparse.Namespace) -> dict[str, Any]:
    if args.dry_run:
        return dict(DRY[args.model])
    return {**MODELS[args.model], "num_hidden_layers": args.layers}


def config(args: argparse.Namespace) -> Any:
    from transformers import AutoConfig

    fields = shape(args)
    cfg = AutoConfig.for_model(fields.pop("model_type"), **fields)
    cfg.max_position_embeddings = args.prompt + args.new_tokens + 64
    cfg.pad_token_id, cfg.eos_token_id = 0, None
    return cfg


def worker(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from bench_beams import timed
    from bench_weights import fill_random, random_model
    from card import CardSampler, prepare_device

    from reviva import RevivaConfig, RevivaManager

    card = None if args.dry_run else int(args.card_gb * 10**9)
    info, ballast, probe, card_bytes = prepare_device(card, cuda=not args.dry_run)
    if "error" in info:
        return {"device": info, "error": info["error"]}
    sync = (lambda: None) if args.dry_run else torch.cuda.synchronize
    cfg = config(args)
    if args.dry_run:
        model = random_model(cfg, "cpu")
        manager = RevivaManager(model, RevivaConfig(stream_weights=True))
        import test_weights  # (tests/python: the smallest budget, every layer streamed)

        test_weights.budget_where(manager, args.prompt, args.new_tokens, lambda p: True)
    else:
        t = time.perf_counter()
        model = random_model(cfg, "layers_on_meta")
        config_ = RevivaConfig(vram_budget=f"{args.card_gb}GB", device="cuda")
        manager = RevivaManager(model, config_, fill_layer=fill_random)
        info["load_s"] = time.perf_counter() - t
    w = manager.weights
    first = w.store.layer_bytes(w.parts[0][0])
    layer = w.layer_bytes[0]
    k = cfg.num_experts_per_tok
    experts = getattr(cfg, "num_local_experts", None) or cfg.num_experts
    routed_step = first + k * (layer - first) // experts  # a layer's step at most
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(1, cfg.vocab_size, (1, args.prompt), generator=g)
    ids = ids.to("cpu" if args.dry_run else "cuda")
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
            ws = w.stats()
            decode_steps = st["decode_steps"]
            streamed = [i for i in range(w.num_layers) if not w.resident(i)]
            row["stats"] = {
                "weight_resident_layers": st["weight_resident_layers"],
                "weight_streamed_layers_at_end": len(streamed),
                "routed_expert_layers": ws["routed_expert_layers"],
                "decode_steps": decode_steps,
                "decode_weight_bytes_per_step": (
                    st["decode"]["bytes_to_device"] / decode_steps if decode_steps else None
                ),
                "weight_bytes_to_device": st["weight_bytes_to_device"],
                "weight_slot_bytes": st["weight_slot_bytes"],
                "kv_streamed_layers": st["streamed_layers"],
            }
            row["layer_bytes"] = layer
            row["routed_step_bytes_per_layer"] = routed_step
            row["streamed_weight_layers"] = len(streamed)
            row["streamed_weight_layers_in_prefill"] = st["prefill"]["weight_streamed_layers"]
            per_step = len(streamed) * (routed_step if ws["routed_expert_layers"] else layer)
            row["roofline_tok_s"] = PCIE_H2D_BPS / per_step if per_step else None
        except Exception as e:  # noqa: BLE001 (recorded)
            row = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        row["call"] = call + 1
        calls.append(row)
        print(f"call {call + 1}: {json.dumps(row, default=str)[:900]}", flush=True)
    if ballast is not None:
        ballast.free()
    return {"device": info, "calls": calls}


def analyse(parts: dict[str, Any], calls: int) -> dict[str, Any]:
    routed, every = parts["routed"].get("calls", []), parts["all"].get("calls", [])
    complete = (
        len(routed) == calls
        and len(every) == calls
        and not any("error" in c for c in routed + every)
    )
    bytes_ok, faster = False, []
    if complete:
        # the decode phase's bytes include the K/V of layers streamed in decode (none at these
        # settings: the card holds the K/V of a 4k prompt) and decode's first prefetches (10%
        # over 31 steps); a step's weights at most the first blocks and k experts of the layers
        # streamed in the call (promotions only lower it)
        bytes_ok = all(
            c["stats"]["routed_expert_layers"] > 0
            and c["stats"]["decode_weight_bytes_per_step"]
            <= c["streamed_weight_layers_in_prefill"] * c["routed_step_bytes_per_layer"] * 1.1
            for c in routed
        )
        faster = [
            (r["decode_tok_s"] or 0) >= 2 * (a["decode_tok_s"] or float("inf"))
            for r, a in zip(routed, every, strict=True)
        ]

    def row(c: dict[str, Any]) -> dict[str, Any]:
        if "error" in c:
            return {"error": c["error"]}
        keep = ("prefill_s", "decode_tok_s", "median_step_s", "new_tokens", "roofline_tok_s")
        return {
            **{k: c.get(k) for k in keep},
            "card_peak_gb": (c.get("card_peak_bytes") or 0) / 1e9,
            "streamed_weight_layers": c["streamed_weight_layers"],
            "streamed_weight_layers_in_prefill": c["streamed_weight_layers_in_prefill"],
            **c["stats"],
        }

    return {
        "experts_decode": {
            "pass": bool(complete and bytes_ok and all(faster)),
            "routed": [row(c) for c in routed],
            "all_experts": [row(c) for c in every],
            "decode_ratio": [
                (r.get("decode_tok_s") or 0) / a["decode_tok_s"]
                for r, a in zip(routed, every, strict=False)
                if a.get("decode_tok_s") and "error" not in r
            ],
            "errors": {
                name: parts[name].get("error")
                or [c["error"] for c in parts[name].get("calls", []) if "error" in c]
                for name in ("routed", "all")
            },
            "limit": "every call completes on the card; a routed decode step moves no more than "
            "each streamed layer's first block and its k routed experts; each routed call "
            "decodes at least 2x as fast as the same call moving every expert "
            "(REVIVA_ROUTED_EXPERTS=0)",
        }
    }


def driver(args: argparse.Namespace) -> int:
    parts: dict[str, Any] = {}
    t0 = time.perf_counter()
    order = ("routed", "all") if args.first == "routed" else ("all", "routed")
    for part in order:
        cmd = [sys.executable, __file__, "--worker", part, f"--prompt={args.prompt}"]
        cmd += [f"--new-tokens={args.new_tokens}", f"--calls={args.calls}"]
        cmd += [f"--model={args.model}", f"--layers={args.layers}", f"--card-gb={args.card_gb}"]
        cmd += ["--dry-run"] if args.dry_run else []
        extra = {"REVIVA_ROUTED_EXPERTS": "1" if part == "routed" else "0"}
        extra["PYTHONPATH"] = os.pathsep.join(
            [str(HERE.parent / "tests" / "python"), os.environ.get("PYTHONPATH", "")]
        )
        left = max(args.max_wall_s - (time.perf_counter() - t0), 10)
        parts[part] = run_worker(cmd, extra, left)
    checks = analyse(parts, args.calls)
    result = {
        "environment": environment(cuda=False),
        "settings": vars(args) | {"shape": shape(args), "order": order},
        "checks": checks,
        "parts": parts,
    }
    for k, v in checks.items():
        print(f"{k}: {'PASS' if v['pass'] else 'FAIL'} {json.dumps(v, default=str)[:1800]}")
    name = "experts" if args.model == "mixtral-8x7b" else f"experts-{args.model}"
    path = write_result(f"{name}-cpu" if args.dry_run else name, result, args.out)
    print(f"# wrote {path}")
    return 0 if all(v["pass"] for v in checks.values()) else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=tuple(MODELS), default="mixtral-8x7b")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--card-gb", type=float, default=None, help="default: 12 Mixtral, 6 Qwen3")
    p.add_argument("--prompt", type=int, default=4096)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--calls", type=int, default=2)
    p.add_argument(
        "--first",
        choices=("routed", "all"),
        default="all",
        help="which worker runs first (a cold machine's first process pays for its start)",
    )
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--max-wall-s", type=float, default=560)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.card_gb is None:
        args.card_gb = CARD_GB[args.model]
    if args.dry_run and args.prompt == 4096:
        args.prompt, args.new_tokens = 40, 8
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
