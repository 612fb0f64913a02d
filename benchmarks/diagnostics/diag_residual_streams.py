"""Prefill with the prompt's hidden states on the host: their chunk copies on two copy streams
(LlamaLayerPath._prefill_chunks_streamed, Note [Residual stream on the host]) against the same
copies on the compute stream (the path until fd28304, kept here as the reference): an A/B in one
process (a diagnostic).

    python benchmarks/diagnostics/diag_residual_streams.py [--context 131072] [--rounds 2]
        [--out DIR]

Card mode (24 GB, torch's default allocator), Llama-3-8B shape, bf16, RevivaConfig(
vram_budget="24GB", prefill_residual="host"), 2 new tokens; a warm-up call, then the variants
alternate (streams, compute, streams, compute, ...). Writes residual-streams-<date>-<sha>.json
to --out (default benchmarks/results): every call's prefill_s, the means, and the checks
same_tokens and streams_not_slower.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

import reviva

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from card import prepare_device  # noqa: E402
from common import environment, write_result  # noqa: E402
from generate_model import build_model  # noqa: E402


def on_compute_stream(path: Any) -> Any:
    """The chunk loop with its copies on the compute stream (the reference)."""

    def run(cache, i, layer, residual, positions, rotary, chunk) -> None:  # noqa: ANN001
        tokens, device = residual.shape[0], path.layout.device
        for s in range(0, tokens, chunk):
            e = min(tokens, s + chunk)
            src = residual[s:e]
            h = src.to(device, non_blocking=True).transpose(0, 1).contiguous()
            cos, sin = rotary(h, positions[:, s:e])
            path._rows(cache, i, layer, h, 0, e - s, s, cos, sin, None, None)
            src.copy_(h.transpose(0, 1), non_blocking=True)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    _prepared, _ballast, _probe, _card = prepare_device(24 * 10**9, True)
    model = build_model(32)
    config = reviva.RevivaConfig(vram_budget="24GB", prefill_residual="host")
    manager = reviva.RevivaManager(model, config)
    streamed = manager.layers._prefill_chunks_streamed
    reference = on_compute_stream(manager.layers)
    gen = torch.Generator(device="cuda").manual_seed(args.context)
    ids = torch.randint(1, model.config.vocab_size, (1, args.context), device="cuda", generator=gen)
    calls: list[dict[str, Any]] = []
    tokens: dict[str, torch.Tensor] = {}
    order = ["streams"] + ["streams", "compute"] * args.rounds  # (the first: warm-up)
    for n, variant in enumerate(order):
        manager.layers._prefill_chunks_streamed = streamed if variant == "streams" else reference
        out = manager.generate(ids, max_new_tokens=2, do_sample=False)
        st = manager.get_memory_stats()
        assert st["prefill_residual"] == "host", st["prefill_residual"]
        tokens.setdefault(variant, out[0, -2:].cpu())
        row = {"call": n + 1, "variant": variant, "warm_up": n == 0, "prefill_s": st["prefill_s"]}
        calls.append(row)
        print(json.dumps(row), flush=True)
    same = torch.equal(tokens["streams"], tokens["compute"])
    mean = {
        v: sum(c["prefill_s"] for c in calls if c["variant"] == v and not c["warm_up"])
        / args.rounds
        for v in ("streams", "compute")
    }
    ratio = mean["streams"] / mean["compute"]
    result = {
        "environment": environment(),
        "settings": {"context": args.context, "rounds": args.rounds, "card": "24GB"},
        "calls": calls,
        "mean_prefill_s": mean,
        "streams_vs_compute": ratio,
        "checks": {"same_tokens": same, "streams_not_slower": ratio <= 1.0},
    }
    print(json.dumps({k: v for k, v in result.items() if k != "calls"}), flush=True)
    out = Path(args.out) if args.out else None
    print(f"wrote {write_result('residual-streams', result, out)}")


if __name__ == "__main__":
    main()
