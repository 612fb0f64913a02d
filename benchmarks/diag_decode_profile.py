"""Where a decode step's time goes (a diagnostic, GPU only): the 8B shape on the whole card, a
prompt of --tokens, RevivaManager with bf16 and with fp8 K/V (default settings otherwise). A
warm call, then calls of 1 and of --new + 1 tokens under torch.profiler, their difference per
decode step: the wall time, the device's busy time (the sum of its kernels' durations, which do
not overlap on one stream), the device's idle time between kernels (gaps under IDLE_SPLIT_US:
launch latencies inside the graphs; longer ones: the device waiting for the host) and the
largest kernels. A step whose busy time is near its wall time is bound by the device; far
below, by the host or by its kernels' count. Runs: bf16 K/V, fp8 K/V (the row operations in the
decode graphs, Note [Decode row ops]), fp8 K/V with HF's modules (REVIVA_DECODE_ROW_OPS=off);
each also decodes --new tokens unprofiled (decode_tok_s_unprofiled).

    python benchmarks/diag_decode_profile.py [--tokens 65536] [--new 16] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_generate import build_model  # noqa: E402
from common import environment  # noqa: E402

IDLE_SPLIT_US = 20.0  # a device idle gap shorter than this: between two kernels of a graph


def _idle(spans: list[tuple[float, float]]) -> tuple[float, int, float]:
    """The device's idle time between kernels (us): in gaps under IDLE_SPLIT_US, their count,
    and in longer gaps."""
    short = long = 0.0
    count = 0
    end = None
    for start, stop in sorted(spans):
        if end is not None and start > end:
            gap = start - end
            if gap < IDLE_SPLIT_US:
                short += gap
                count += 1
            else:
                long += gap
        end = stop if end is None else max(end, stop)
    return short, count, long


def _kernels(
    manager: Any, ids: torch.Tensor, new_tokens: int
) -> tuple[float, dict[str, Any], tuple[float, int, float]]:
    """One profiled call: its wall time, each CUDA kernel's durations by name, and the device's
    idle time (_idle). The project's own ranges (reviva.*) are not kernels."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        manager.generate(ids, max_new_tokens=new_tokens, do_sample=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    kernels: dict[str, list[float]] = {}
    spans: list[tuple[float, float]] = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith("reviva."):
            kernels.setdefault(e.name, []).append(e.device_time_total / 1e6)
            spans.append((e.time_range.start, e.time_range.end))
    return wall, kernels, _idle(spans)


def profile(manager: Any, ids: torch.Tensor, new: int) -> dict[str, Any]:
    manager.generate(ids, max_new_tokens=4, do_sample=False)  # warm (graphs captured)
    torch.cuda.synchronize()
    # The decode steps' kernels: a call of new + 1 tokens less a call of 1 token (the prefill and
    # the first token), kernel by kernel.
    wall_1, first, idle_1 = _kernels(manager, ids, 1)
    wall, kernels, idle = _kernels(manager, ids, new + 1)
    step_s = (wall - wall_1) / new
    per_step: dict[str, tuple[int, float]] = {}
    for name, times in kernels.items():
        before = first.get(name, [])
        calls, total = len(times) - len(before), sum(times) - sum(before)
        if calls > 0:
            per_step[name] = (calls, total)
    busy = sum(t for _, t in per_step.values()) / new
    top = sorted(per_step.items(), key=lambda kv: -kv[1][1])[:16]
    graphs = manager._graphs
    row_ops = len(graphs.row_ops) if graphs is not None else 0
    fused = len(graphs.fused) if graphs is not None else 0
    replays = manager.get_memory_stats().get("decode_graph_replays")
    manager.generate(ids, max_new_tokens=new + 1, do_sample=False)  # unprofiled
    st = manager.get_memory_stats()
    return {
        "prefill_s": wall_1,
        "decode_step_s_wall": step_s,
        "decode_step_s_device_busy": busy,
        "decode_step_s_idle_between_kernels": (idle[0] - idle_1[0]) / new / 1e6,
        "idle_gaps_between_kernels_per_step": (idle[1] - idle_1[1]) / new,
        "decode_step_s_idle_waiting": (idle[2] - idle_1[2]) / new / 1e6,
        "kernel_launches_per_step": sum(c for c, _ in per_step.values()) / new,
        "top_kernels_per_step": [
            {"name": k[:90], "calls": c / new, "us": 1e6 * t / new, "mean_us": 1e6 * t / c}
            for k, (c, t) in top
        ],
        "decode_tok_s_unprofiled": st.get("decode_tok_s"),
        "fused_graph_layers": fused,
        "row_op_layers": row_ops,
        "graph_replays": replays,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    import reviva

    model = build_model(32)
    ids = torch.randint(1, 32000, (1, args.tokens), device="cuda")
    out: dict[str, Any] = {"environment": environment(True), "runs": {}}
    for run, kv, row_ops in (
        ("auto", "auto", "on"),
        ("fp8", "fp8", "on"),
        ("fp8_hf", "fp8", "off"),
    ):
        os.environ["REVIVA_DECODE_ROW_OPS"] = row_ops  # (read when the graphs are captured)
        manager = reviva.RevivaManager(model, reviva.RevivaConfig(kv_dtype=kv))
        out["runs"][run] = r = profile(manager, ids, args.new)
        # the device's time in the decode steps: the call's busy time less the prefill's
        print(run, json.dumps({k: v for k, v in r.items() if k != "top_kernels_per_step"}))
        for k in r["top_kernels_per_step"]:
            us, n, mean = k["us"], k["calls"], k["mean_us"]
            print(f"   {us:9.1f} us/step {n:6.1f} x {mean:8.1f} us  {k['name']}")
        del manager
        torch.cuda.empty_cache()
    os.environ.pop("REVIVA_DECODE_ROW_OPS")
    path = Path(args.out) / "decode-profile.json"
    path.write_text(json.dumps(out, indent=1))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
