"""The synthetic layer pipeline against its roofline: N layers of cuBLAS GEMMs whose activations
are offloaded during forward and prefetched back in reverse order for backward, with no offload,
with naive synchronous offload, and with Reviva (OffloadManager + PrefetchScheduler), in one run.

    python benchmarks/bench_pipeline.py --cpp-bench build/benchmarks/reviva_bench_pipeline

The C++ program (benchmarks/bench_pipeline.cpp) does the measuring: two configurations by
default, compute per layer 2x and 0.5x the copy time of one activation at the bandwidth it
measures, each in modes none, naive and reviva. This script adds the environment, writes one
JSON under benchmarks/results/ and prints a table with the acceptance checks of issue 3:
where copies are below compute, reviva within 5% of compute-only with an overlap ratio >= 0.95;
where they are above, within 10% of the roofline max(T_f, A / BW_d2h) + max(T_b, A / BW_h2d);
the device budget never exceeded; outputs bit-identical to the run without offload.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, print_table, write_result  # noqa: E402

# DESIGN.md's measured pinned bandwidth on the H200 (GB/s), shown beside this run's.
ANCHORS = {"h2d": 55.4, "d2h": 55.3}
MODES = ("none", "naive", "reviva")


def cpp_command(args: argparse.Namespace, json_path: Path) -> list[str]:
    cmd = [args.cpp_bench, "--json", str(json_path), "--backend", args.backend]
    for flag, value in (
        ("--layers", args.layers),
        ("--activation", args.activation),
        ("--hidden", args.hidden),
        ("--dtype", args.dtype),
        ("--ratios", args.ratios),
        ("--window", args.window),
        ("--budget-activations", args.budget_activations),
        ("--policy", args.policy),
        ("--warmup", args.warmup),
        ("--steps", args.steps),
    ):
        if value is not None:
            cmd += [flag, str(value)]
    if args.adaptive:
        cmd.append("--adaptive")
    return cmd


def mode_row(config: dict[str, Any], mode: str) -> list[Any]:
    m = config["modes"][mode]
    overlap = m.get("overlap_ratio")
    stall = m.get("compute_stall_ms_per_step")
    return [
        config["name"],
        mode,
        m["step_ms_median"],
        m["forward_ms_median"],
        m["backward_ms_median"],
        m["time_over_compute_only"],
        m["time_over_roofline"],
        "-" if overlap is None else f"{overlap:.3f}",
        "-" if stall is None else f"{stall:.3f}",
        m["bytes_to_host_per_step"] / 2**20,
        m["bytes_to_device_per_step"] / 2**20,
        m["peak_device_bytes"] / 2**20,
        m["budget_bytes"] / 2**20 if m["budget_bytes"] else "-",
        "ok" if m["steps_differing_from_none"] == 0 else "DIFFERS",
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--cpp-bench", required=True, help="path of reviva_bench_pipeline")
    ap.add_argument(
        "--backend",
        default="cuda",
        choices=("cuda", "host"),
        help="host: the simulation (no GPU; for testing this script, not for figures)",
    )
    ap.add_argument("--layers", type=int, default=None, help="default 16")
    ap.add_argument("--activation", default=None, help="bytes of one activation (default 64MiB)")
    ap.add_argument("--hidden", type=int, default=None, help="GEMM width (default 4096)")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default=None)
    ap.add_argument("--ratios", default=None, help="compute / copy per layer (default 2.0,0.5)")
    ap.add_argument("--window", type=int, default=None, help="prefetch window (default 2)")
    ap.add_argument("--budget-activations", type=int, default=None, help="default window + 2")
    ap.add_argument("--policy", choices=("lru", "2q", "belady"), default=None)
    ap.add_argument("--adaptive", action="store_true", help="adaptive prefetch window")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 3)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 15)")
    ap.add_argument("--out-dir", type=Path, default=None, help="where the JSON goes")
    args = ap.parse_args()

    env = environment()
    if args.backend == "cuda" and not env.get("gpu"):
        print("bench_pipeline: no CUDA device; this benchmark measures the GPU", file=sys.stderr)
        return 3

    with tempfile.TemporaryDirectory() as tmp:
        cpp_json = Path(tmp) / "cpp.json"
        proc = subprocess.run(cpp_command(args, cpp_json), check=False)
        # 0: all checks passed, 1: some failed (the JSON is written either way).
        if proc.returncode not in (0, 1) or not cpp_json.exists():
            print(f"bench_pipeline: {args.cpp_bench} failed ({proc.returncode})", file=sys.stderr)
            return proc.returncode or 2
        cpp = json.loads(cpp_json.read_text())

    checks = list(cpp["acceptance"])
    names = {c["name"] for c in cpp["configs"]}
    wanted = {"copy_below_compute", "copy_above_compute"}
    if args.ratios is None:
        checks.append(
            {
                "what": "both regimes measured (copy below and above compute)",
                "measured": float(len(names & wanted)),
                "threshold": 2.0,
                "pass": wanted <= names,
            }
        )

    payload = {
        "environment": env,
        "benchmark": "pipeline",
        "anchors_gbps": ANCHORS,
        "device": cpp["device"],
        "config": cpp["config"],
        "configs": cpp["configs"],
        "acceptance": checks,
    }
    path = write_result("pipeline", payload, args.out_dir)

    print()
    print_table(
        ["config", "D2H GB/s", "H2D GB/s", "copy/layer ms", "compute/layer ms", "roofline ms"],
        [
            [
                c["name"],
                c["bandwidth"]["d2h_gbps"],
                c["bandwidth"]["h2d_gbps"],
                max(c["copy_ms_per_layer_d2h"], c["copy_ms_per_layer_h2d"]),
                c["calibration"]["forward_ms_per_layer"],
                c["roofline_ms"],
            ]
            for c in cpp["configs"]
        ],
    )
    print()
    print_table(
        [
            "config",
            "mode",
            "step ms",
            "fwd ms",
            "bwd ms",
            "/compute",
            "/roofline",
            "overlap",
            "stall ms",
            "D2H MiB",
            "H2D MiB",
            "peak MiB",
            "budget MiB",
            "output",
        ],
        [mode_row(c, mode) for c in cpp["configs"] for mode in MODES],
    )
    print()
    for c in checks:
        print(f"{'PASS' if c['pass'] else 'FAIL'}  {c['what']}: {c['measured']:.4f}")
    print(f"wrote {path}")
    return 0 if all(c["pass"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
