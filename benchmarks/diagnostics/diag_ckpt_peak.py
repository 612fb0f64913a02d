"""What is alive at the peak of a training step under HF gradient checkpointing, with and without
activation offload (a diagnostic for test_gpu_gradient_checkpointing_identical).

    python benchmarks/diagnostics/diag_ckpt_peak.py [--out DIR]

The test's setup (a tiny Llama, bf16, eager attention, non-reentrant checkpointing, batch 4 x
2048, autocast, ActivationOffload(min_bytes=64 KiB)). torch's allocator history is recorded for
each step; replaying its alloc and free events gives the peak and the blocks alive there, grouped
by size and the innermost Python frames that allocated them. Prints both groupings and their
difference; writes ckpt_peak.json to --out.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import sys
from pathlib import Path
from typing import Any

import torch

import reviva

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "python"))
from test_training import tiny_llama  # noqa: E402


def model_of(seed: int) -> torch.nn.Module:
    """The test's model: tiny_llama of tests/python/test_training.py, bf16, eager attention,
    non-reentrant checkpointing, in training mode."""
    model = tiny_llama(seed=seed, device="cuda", attention="eager").to(torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def where(frames: list[dict[str, Any]]) -> str:
    py = [f for f in frames if f.get("filename", "").endswith(".py")]
    return " < ".join(f"{Path(f['filename']).name}:{f['line']}:{f['name']}" for f in py[:4])


def step(model: torch.nn.Module, ids: torch.Tensor, off: Any) -> dict[str, Any]:
    model.zero_grad(set_to_none=True)
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=200000)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        if off is None:
            model(input_ids=ids, labels=ids).loss.backward()
        else:
            with reviva.offload_activations(model, offload=off):
                model(input_ids=ids, labels=ids).loss.backward()
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    stats = torch.cuda.memory_stats()
    live: dict[int, dict[str, Any]] = {}
    cur = best = 0
    at_peak: list[dict[str, Any]] = []
    for ev in snap["device_traces"][0]:
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
            cur += ev["size"]
            if cur > best:
                best, at_peak = cur, list(live.values())
        elif ev["action"] == "free_requested" and ev["addr"] in live:
            cur -= live.pop(ev["addr"])["size"]
    groups = collections.Counter((e["size"], where(e.get("frames", []))) for e in at_peak)
    for g in model.parameters():
        g.grad = None
    return {
        "requested_peak": stats["requested_bytes.all.peak"],
        "allocated_peak": stats["allocated_bytes.all.peak"],
        "trace_peak_within_step": best,
        "live_at_peak": {f"{size} B @ {w}": n for (size, w), n in groups.most_common()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    model = model_of(34)
    ids = torch.randint(0, 211, (4, 2048), device="cuda")
    ref = step(model, ids, None)
    off = reviva.ActivationOffload(model, min_bytes=1 << 16)
    got = step(model, ids, off)
    a, b = collections.Counter(ref["live_at_peak"]), collections.Counter(got["live_at_peak"])
    out = {
        "ref": ref,
        "offload": got,
        "only_with_offload": dict(b - a),
        "only_without": dict(a - b),
        "offload_stats": {
            k: v for k, v in getattr(off.stats, "__dict__", {}).items() if not isinstance(v, dict)
        },
    }
    for k in ("requested_peak", "allocated_peak", "trace_peak_within_step"):
        print(k, ref[k], got[k], got[k] - ref[k])
    print("only with offload:", json.dumps(out["only_with_offload"], indent=1))
    print("only without:", json.dumps(out["only_without"], indent=1))
    Path(args.out, "ckpt_peak.json").write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
