"""Transfer bandwidth: Reviva's TransferEngine against plain cudaMemcpyAsync and torch's copy_,
in one run, per direction and both at once, 64 KiB to 1 GiB; pool latency against cudaHostAlloc.

    python benchmarks/bench_transfer.py --cpp-bench build/benchmarks/reviva_bench_transfer

The C++ program (engine vs. cudaMemcpyAsync, pool latency) runs first in the same job; this
script adds torch's `copy_` (non_blocking, pinned memory) and the engine through the Python
binding, then writes one JSON under benchmarks/results/ and prints a table with the acceptance
checks of issue 2 against DESIGN.md's anchors (55.4 / 55.3 GB/s one way, 95.2 both).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, print_table, write_result  # noqa: E402

ANCHORS = {"h2d": 55.4, "d2h": 55.3, "both": 95.2}
THRESHOLDS = {"h2d": 52.0, "d2h": 52.0, "both": 90.0}


def sizes(min_size: int, max_size: int) -> list[int]:
    out, s = [], min_size
    while s <= max_size:
        out.append(s)
        s *= 4
    return out


def timed(count: int, reps: int, submit, sync) -> list[float]:
    """Seconds for `count` submissions + sync, `reps` times after one warm-up."""
    submit(1)
    sync()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        submit(count)
        sync()
        samples.append(time.perf_counter() - t0)
    return samples


def _torch_submit(buffers, streams, n: int) -> None:
    ds, dd, hs, hd, d2h, h2d = buffers
    for _ in range(n):
        if d2h:
            with torch.cuda.stream(streams[0]):
                hd.copy_(ds, non_blocking=True)
        if h2d:
            with torch.cuda.stream(streams[1]):
                dd.copy_(hs, non_blocking=True)


def _binding_submit(engine, buffers, last: dict, n: int) -> None:
    ds, dd, hs, hd, d2h, h2d = buffers
    for _ in range(n):
        if d2h:
            last["d2h"] = engine.copy_(hd, ds)
        if h2d:
            last["h2d"] = engine.copy_(dd, hs)


def _sync_streams(streams, *_: object) -> None:
    for s in streams:
        s.synchronize()


def _wait_all(last: dict, *_: object) -> None:
    for t in last.values():
        t.wait()


def torch_and_binding(min_size: int, max_size: int, reps: int) -> list[dict]:
    import reviva

    rt = reviva.Runtime("cuda:0")
    pool = reviva.PinnedHostPool(rt, slab_bytes=256 << 20)
    engine = reviva.TransferEngine(rt, pool)
    cap = max_size
    dev_src = torch.empty(cap, dtype=torch.uint8, device="cuda").fill_(0x3C)
    dev_dst = torch.empty(cap, dtype=torch.uint8, device="cuda")
    host_src = torch.empty(cap, dtype=torch.uint8).pin_memory().fill_(0x5A)
    host_dst = torch.empty(cap, dtype=torch.uint8).pin_memory()
    s_d2h, s_h2d = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    rows = []
    for size in sizes(min_size, max_size):
        count = min(4096, max(3, (1 << 30) // size))
        ds, dd, hs, hd = dev_src[:size], dev_dst[:size], host_src[:size], host_dst[:size]
        for direction in ("d2h", "h2d", "both"):
            d2h = direction != "h2d"
            h2d = direction != "d2h"
            moved = size * (2 if d2h and h2d else 1)

            last: dict[str, reviva.Transfer] = {}
            buffers = (ds, dd, hs, hd, d2h, h2d)
            torch_submit = functools.partial(_torch_submit, buffers, (s_d2h, s_h2d))
            binding_submit = functools.partial(_binding_submit, engine, buffers, last)
            torch_sync = functools.partial(_sync_streams, (s_d2h, s_h2d))
            binding_sync = functools.partial(_wait_all, last)

            tt = timed(count, reps, torch_submit, torch_sync)
            bt = timed(count, reps, binding_submit, binding_sync)
            rows.append(
                {
                    "bytes": size,
                    "direction": direction,
                    "copies_per_sample": count,
                    "torch_copy_gbps_median": moved * count / statistics.median(tt) / 1e9,
                    "torch_copy_gbps_best": moved * count / min(tt) / 1e9,
                    "reviva_binding_gbps_median": moved * count / statistics.median(bt) / 1e9,
                    "reviva_binding_gbps_best": moved * count / min(bt) / 1e9,
                }
            )
    engine.synchronize()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--cpp-bench", required=True, help="path of reviva_bench_transfer")
    ap.add_argument("--min-size", type=int, default=64 << 10)
    ap.add_argument("--max-size", type=int, default=1 << 30)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out-dir", type=Path, default=None, help="where the JSON goes")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_transfer: no CUDA device; this benchmark measures the GPU", file=sys.stderr)
        return 3

    env = environment()
    with tempfile.TemporaryDirectory() as tmp:
        cpp_json = Path(tmp) / "cpp.json"
        subprocess.run(
            [
                args.cpp_bench,
                "--json",
                str(cpp_json),
                "--min-size",
                str(args.min_size),
                "--max-size",
                str(args.max_size),
                "--reps",
                str(args.reps),
            ],
            check=True,
        )
        cpp = json.loads(cpp_json.read_text())
    py_rows = torch_and_binding(args.min_size, args.max_size, args.reps)

    merged = []
    for c in cpp["bandwidth"]:
        p = next(
            r for r in py_rows if r["bytes"] == c["bytes"] and r["direction"] == c["direction"]
        )
        merged.append({**c, **p})

    checks = []
    for row in merged:
        if row["bytes"] >= 64 << 20:
            need = THRESHOLDS[row["direction"]]
            checks.append(
                {
                    "what": f"reviva {row['direction']} at {row['bytes'] >> 20} MiB >= {need} GB/s",
                    "measured": row["reviva_gbps_median"],
                    "pass": row["reviva_gbps_median"] >= need,
                }
            )
    for p in cpp["pool_latency"]:
        checks.append(
            {
                "what": f"pool allocate+free of a cached {p['bytes'] >> 10} KiB block < 5 us",
                "measured": p["reviva_cached_us_median"],
                "pass": p["reviva_cached_us_median"] < 5.0,
            }
        )

    payload = {
        "environment": env,
        "benchmark": "transfer",
        "anchors_gbps": ANCHORS,
        "bandwidth": merged,
        "pool_latency": cpp["pool_latency"],
        "pool_stats": cpp["pool_stats"],
        "acceptance": checks,
    }
    path = write_result("transfer", payload, args.out_dir)

    print()
    print_table(
        ["MiB", "dir", "reviva", "cudaMemcpy", "torch copy_", "binding", "anchor"],
        [
            [
                f"{r['bytes'] / 2**20:g}",
                r["direction"],
                r["reviva_gbps_median"],
                r["cuda_gbps_median"],
                r["torch_copy_gbps_median"],
                r["reviva_binding_gbps_median"],
                ANCHORS[r["direction"]],
            ]
            for r in merged
        ],
    )
    print()
    print_table(
        ["KiB", "reviva us", "reviva+stream us", "cudaHostAlloc+Free us"],
        [
            [
                p["bytes"] >> 10,
                p["reviva_cached_us_median"],
                p["reviva_cached_with_stream_use_us_median"],
                p["cuda_host_alloc_free_us_median"],
            ]
            for p in cpp["pool_latency"]
        ],
    )
    print()
    for c in checks:
        print(f"{'PASS' if c['pass'] else 'FAIL'}  {c['what']}: {c['measured']:.3f}")
    print(f"wrote {path}")
    return 0 if all(c["pass"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
