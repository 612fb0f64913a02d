"""Where a decode step's time goes (a diagnostic, GPU only): the 8B shape on the whole card, a
prompt of --tokens, RevivaManager with bf16 and with fp8 K/V (default settings otherwise). A
warm call, then a call of --new tokens under torch.profiler: per step the wall time, the
device's busy time (the sum of its kernels' durations, which do not overlap on one stream) and
the largest kernels by total time. A step whose busy time is near its wall time is bound by the
device; far below, by the host.

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


def profile(manager: Any, ids: torch.Tensor, new: int) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    manager.generate(ids, max_new_tokens=4, do_sample=False)  # warm (graphs captured)
    torch.cuda.synchronize()
    t = time.perf_counter()
    manager.generate(ids, max_new_tokens=1, do_sample=False)
    torch.cuda.synchronize()
    prefill = time.perf_counter() - t
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        manager.generate(ids, max_new_tokens=new + 1, do_sample=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    step_s = (wall - prefill) / new
    kernels: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels.setdefault(e.name, []).append(e.device_time_total / 1e6)
    busy = sum(sum(v) for v in kernels.values())
    top = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:12]
    st = manager.get_memory_stats()
    graphs = manager._graphs
    return {
        "prefill_s": prefill,
        "decode_step_s_wall": step_s,
        "device_busy_s_whole_call": busy,
        "top_kernels": [
            {"name": k[:90], "calls": len(v), "total_s": sum(v), "mean_us": 1e6 * sum(v) / len(v)}
            for k, v in top
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
        print(kv, json.dumps({k: v for k, v in r.items() if k != "top_kernels"}))
        for k in r["top_kernels"]:
            ms, n, us = k["total_s"] * 1e3, k["calls"], k["mean_us"]
            print(f"   {ms:9.1f} ms {n:6d} x {us:8.1f} us  {k['name']}")
        del manager
        torch.cuda.empty_cache()
    path = Path(args.out) / "decode-profile.json"
    path.write_text(json.dumps(out, indent=1))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
