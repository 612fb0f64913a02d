"""Where a decode step's time goes (a diagnostic, GPU only): the 8B shape on the whole card, a
prompt of --tokens, RevivaManager with bf16 and with fp8 K/V (default settings otherwise). A
warm call, then calls of 1 and of --new + 1 tokens under torch.profiler, their difference per
decode step: the wall time, the device's busy time (the sum of its kernels' durations, which do
not overlap on one stream), the device's idle time between kernels (gaps under IDLE_SPLIT_US:
launch latencies inside the graphs; longer ones: the device waiting for the host) and the
largest kernels. A step whose busy time is near its wall time is bound by the device; far
below, by the host or by its kernels' count. Runs: bf16 K/V, fp8 K/V (the row operations in the
decode graphs, Note [Decode row ops]), fp8 K/V with HF's modules (REVIVA_DECODE_ROW_OPS=off);
each also decodes --new tokens unprofiled (decode_tok_s_unprofiled). With --host, the host's
side too: cProfile over the same two calls, each function's own time per decode step (the host
work between the device's kernels: HF's generate loop, the layers' Python, the replays' launches).

    python benchmarks/diagnostics/diag_decode_profile.py [--tokens 65536] [--new 16]
        [--runs auto,fp8,fp8_hf] [--host] [--out DIR]
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import environment  # noqa: E402
from generate_model import build_model  # noqa: E402

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


def _host_times(manager: Any, ids: torch.Tensor, new_tokens: int) -> tuple[float, dict[str, Any]]:
    """One call under cProfile: its wall time and each function's (calls, own seconds)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    manager.generate(ids, max_new_tokens=new_tokens, do_sample=False)
    torch.cuda.synchronize()
    prof.disable()
    wall = time.perf_counter() - t
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    return wall, {
        f"{Path(f).name}:{line}({fn})": (calls, own)
        for (f, line, fn), (calls, _, own, _, _) in stats.items()
    }


def host_profile(manager: Any, ids: torch.Tensor, new: int) -> dict[str, Any]:
    """The host's time per decode step by function (a call of new + 1 tokens less one of 1)."""
    wall_1, first = _host_times(manager, ids, 1)
    wall, funcs = _host_times(manager, ids, new + 1)
    per_step = []
    for name, (calls, own) in funcs.items():
        c0, t0 = first.get(name, (0, 0.0))
        if calls > c0:
            per_step.append((name, (calls - c0) / new, 1e6 * (own - t0) / new))
    per_step.sort(key=lambda x: -x[2])
    return {
        "decode_step_s_wall_under_cprofile": (wall - wall_1) / new,
        "host_us_per_step_total": sum(t for _, _, t in per_step),
        "top_functions_per_step": [
            {"name": n, "calls": c, "own_us": t} for n, c, t in per_step[:30]
        ],
    }


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
    ap.add_argument("--runs", default="auto,fp8,fp8_hf")
    ap.add_argument("--host", action="store_true", help="also cProfile the host's side")
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    runs = args.runs.split(",")
    known = {"auto", "fp8", "fp8_hf"}
    if not runs or not set(runs) <= known:
        ap.error(f"--runs {args.runs!r}: each of {sorted(known)}")
    import reviva

    model = build_model(32)
    ids = torch.randint(1, 32000, (1, args.tokens), device="cuda")
    out: dict[str, Any] = {"environment": environment(True), "runs": {}}
    for run, kv, row_ops in (
        ("auto", "auto", "on"),
        ("fp8", "fp8", "on"),
        ("fp8_hf", "fp8", "off"),
    ):
        if run not in runs:
            continue
        os.environ["REVIVA_DECODE_ROW_OPS"] = row_ops  # (read when the graphs are captured)
        manager = reviva.RevivaManager(model, reviva.RevivaConfig(kv_dtype=kv))
        out["runs"][run] = r = profile(manager, ids, args.new)
        # the device's time in the decode steps: the call's busy time less the prefill's
        print(run, json.dumps({k: v for k, v in r.items() if k != "top_kernels_per_step"}))
        for k in r["top_kernels_per_step"]:
            us, n, mean = k["us"], k["calls"], k["mean_us"]
            print(f"   {us:9.1f} us/step {n:6.1f} x {mean:8.1f} us  {k['name']}")
        if args.host:
            r["host"] = h = host_profile(manager, ids, args.new)
            print(
                f"  host: {h['host_us_per_step_total']:.0f} us of Python a step, "
                f"{1e3 * h['decode_step_s_wall_under_cprofile']:.2f} ms a step under cProfile"
            )
            for f in h["top_functions_per_step"][:20]:
                print(f"   {f['own_us']:9.1f} us/step {f['calls']:6.1f} x  {f['name']}")
        del manager
        torch.cuda.empty_cache()
    os.environ.pop("REVIVA_DECODE_ROW_OPS")
    path = Path(args.out) / "decode-profile.json"
    path.write_text(json.dumps(out, indent=1))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
