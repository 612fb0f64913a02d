"""Where the host time of a first generate goes, against the second (a diagnostic).

    python benchmarks/diagnostics/diag_first_call.py [--out DIR] [--new-tokens N] [--shape 8b|32b]

Card mode as bench_generate runs it (24 GB, default allocator), Llama-3-8B shape, bf16, 64k
prompt, RevivaConfig(vram_budget="24GB"); or (--shape 32b) as bench_weights' card24_32b runs it:
the Qwen2.5-32B shape, its weights streamed, a 32k prompt. Two calls in one process, each under
torch.profiler (CPU and CUDA, every thread): per call the CPU ops and CUDA API calls of longest self
time (aggregated), and the longest single events with their start (ms since the call began) and
thread. Run it as a fresh process: lazy kernel loading, cuBLAS and allocator growth, pinning and
capture show only in a process's first call. Writes first_call_<shape>.json to --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

import reviva

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from card import prepare_device  # noqa: E402
from generate_model import build_model  # noqa: E402


def summary(prof: Any, wall_ms: float) -> dict[str, Any]:
    table = [
        {
            "name": a.key,
            "count": a.count,
            "self_cpu_ms": round(a.self_cpu_time_total / 1e3, 2),
            "cpu_total_ms": round(a.cpu_time_total / 1e3, 2),
        }
        for a in sorted(prof.key_averages(), key=lambda a: -a.self_cpu_time_total)[:40]
    ]
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    t0 = min(e.time_range.start for e in events) if events else 0
    longest = sorted(events, key=lambda e: -(e.time_range.end - e.time_range.start))[:60]

    def row(e: Any) -> dict[str, Any]:
        return {
            "name": e.name,
            "start_ms": round((e.time_range.start - t0) / 1e3, 1),
            "ms": round((e.time_range.end - e.time_range.start) / 1e3, 2),
            "thread": e.thread,
        }

    early = [e for e in events if e.time_range.start - t0 < 1.5e6]  # the call's first 1.5 s
    early = [e for e in early if e.time_range.end - e.time_range.start >= 3e3]
    return {
        "wall_ms": round(wall_ms, 1),
        # the events of >= 3 ms that began in the call's first 1.5 s, in order (where a first
        # call's time before its first layer goes)
        "early": [row(e) for e in sorted(early, key=lambda e: e.time_range.start)][:200],
        "by_self_cpu": table,
        "longest": [row(e) for e in longest],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".")
    parser.add_argument("--new-tokens", type=int, default=4)
    parser.add_argument("--shape", choices=("8b", "32b"), default="8b")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    _prepared, _ballast, _probe, _card = prepare_device(24 * 10**9, True)
    config = reviva.RevivaConfig(vram_budget="24GB")
    if args.shape == "8b":
        prompt = 65536
        model = build_model(32)
        manager = reviva.RevivaManager(model, config)
    else:
        from bench_weights import config_of, fill_random, random_model

        prompt = 32768
        model = random_model(config_of("32b", prompt + args.new_tokens + 64), "layers_on_meta")
        manager = reviva.RevivaManager(model, config, fill_layer=fill_random)
    gen = torch.Generator(device="cuda").manual_seed(prompt)
    ids = torch.randint(1, model.config.vocab_size, (1, prompt), device="cuda", generator=gen)
    out: dict[str, Any] = {}
    for call in (1, 2):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t = time.perf_counter()
            manager.generate(ids, max_new_tokens=args.new_tokens, do_sample=False)
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t) * 1e3
        st = manager.get_memory_stats()
        out[str(call)] = {
            "stats": {k: v for k, v in st.items() if not isinstance(v, dict)},
            **summary(prof, wall),
        }
        print(f"call {call}: wall {wall:.0f} ms, prefill {st['prefill_s']:.3f} s", flush=True)
        print("   setup (host s):", json.dumps(st.get("prefill_setup_host_s")))
        for row in out[str(call)]["by_self_cpu"][:25]:
            print("  ", json.dumps(row))
        for row in out[str(call)]["longest"][:25]:
            print("  >", json.dumps(row))
        for row in out[str(call)]["early"][:120]:
            print("  early", json.dumps(row))
    Path(args.out, f"first_call_{args.shape}.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
