"""Where a decode step's time goes (a diagnostic, GPU only): the 8B shape on the whole card, a
prompt of --tokens, RevivaManager with bf16 and with fp8 K/V (default settings otherwise). A
warm call, then calls of 1 and of --new + 1 tokens under torch.profiler, their difference per
decode step: the wall time, the device's busy time (the sum of its kernels' durations, which do
not overlap on one stream) and the largest kernels. A step whose busy time is near its wall
time is bound by the device; far below, by the host.

    python benchmarks/diag_decode_profile.py [--tokens 65536] [--new 16] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_generate import build_model  # noqa: E402
from common import environment  # noqa: E402


def _kernels(manager: Any, ids: torch.Tensor, new_tokens: int) -> tuple[float, dict[str, Any]]:
    """One profiled call: its wall time and each CUDA kernel's durations by name."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        manager.generate(ids, max_new_tokens=new_tokens, do_sample=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    kernels: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels.setdefault(e.name, []).append(e.device_time_total / 1e6)
    return wall, kernels


def profile(manager: Any, ids: torch.Tensor, new: int) -> dict[str, Any]:
    manager.generate(ids, max_new_tokens=4, do_sample=False)  # warm (graphs captured)
    torch.cuda.synchronize()
    # The decode steps' kernels: a call of new + 1 tokens less a call of 1 token (the prefill and
    # the first token), kernel by kernel.
    wall_1, first = _kernels(manager, ids, 1)
    wall, kernels = _kernels(manager, ids, new + 1)
    step_s = (wall - wall_1) / new
    per_step: dict[str, tuple[int, float]] = {}
    for name, times in kernels.items():
        before = first.get(name, [])
        calls, total = len(times) - len(before), sum(times) - sum(before)
        if calls > 0:
            per_step[name] = (calls, total)
    busy = sum(t for _, t in per_step.values()) / new
    top = sorted(per_step.items(), key=lambda kv: -kv[1][1])[:16]
    st = manager.get_memory_stats()
    graphs = manager._graphs
    return {
        "prefill_s": wall_1,
        "decode_step_s_wall": step_s,
        "decode_step_s_device_busy": busy,
        "kernel_launches_per_step": sum(c for c, _ in per_step.values()) / new,
        "top_kernels_per_step": [
            {"name": k[:90], "calls": c / new, "us": 1e6 * t / new, "mean_us": 1e6 * t / c}
            for k, (c, t) in top
        ],
        "decode_tok_s": st.get("decode_tok_s"),
        "fused_graph_layers": len(graphs.fused) if graphs is not None else 0,
        "graph_replays": st.get("decode_graph_replays"),
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
    for kv in ("auto", "fp8"):
        manager = reviva.RevivaManager(model, reviva.RevivaConfig(kv_dtype=kv))
        out["runs"][kv] = r = profile(manager, ids, args.new)
        # the device's time in the decode steps: the call's busy time less the prefill's
        print(kv, json.dumps({k: v for k, v in r.items() if k != "top_kernels_per_step"}))
        for k in r["top_kernels_per_step"]:
            us, n, mean = k["us"], k["calls"], k["mean_us"]
            print(f"   {us:9.1f} us/step {n:6.1f} x {mean:8.1f} us  {k['name']}")
        del manager
        torch.cuda.empty_cache()
    path = Path(args.out) / "decode-profile.json"
    path.write_text(json.dumps(out, indent=1))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
