"""A training step with activation offload (issue 5), on the GPU: time against peak memory.

Model: Llama-shaped, hidden 2048, 16 layers, MLP 8192, 32 heads, 8 K/V heads, vocab 32000, bf16,
sequence 8192, forward+backward with labels. Contenders in one run: plain;
torch.autograd.graph.save_on_cpu(pin_memory=True); Reviva offload-all (and variants: sources held
until copied, a 128 MiB window); Reviva with budgets 6/8/10/12/16 GB (a time-vs-memory curve,
also drawn as a PNG). Each contender also runs one untimed step from an emptied cache that
records the reserved peak and where memory grows (allocated and reserved at each layer's forward
and backward). The roofline of a step that offloads A bytes is max(forward, A / D2H bandwidth) +
max(backward, A / H2D bandwidth), with forward and backward timed on the plain run and the
bandwidths of plain 1 GiB pinned copies measured in the same run. The JSON's `checks` holds the
issue's acceptance figures.

    python benchmarks/bench_train.py [--steps 5] [--budgets 6GB,8GB,10GB,12GB,16GB] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

# Every contender runs on torch's allocator with expandable segments (as bench_generate does):
# without them, freed blocks of other sizes are not reused and the reserved peak measures
# fragmentation. Set before CUDA starts.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402

import reviva  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, print_table, write_result  # noqa: E402

SHAPE = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=32000,
    max_position_embeddings=16384,
)
ANCHORS = {
    "plain_step_s": 0.158,
    "plain_peak_gb": 19.8,
    "save_on_cpu_step_s": 1.07,
    "save_on_cpu_peak_gb": 5.4,
}


def build_model() -> Any:
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(**SHAPE, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    return model.train()


def copy_bandwidths(nbytes: int = 1 << 30, repeats: int = 5) -> dict:
    """Plain pinned copies of `nbytes` each way (GB/s, best of `repeats`): the roofline's
    bandwidths, measured in the same run as the steps."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = {}
    for name, dst, src in (("d2h", host, dev), ("h2d", dev, host)):
        best = float("inf")
        for _ in range(repeats):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src, non_blocking=True)
            b.record()
            torch.cuda.synchronize()
            best = min(best, a.elapsed_time(b) / 1e3)
        out[name] = nbytes / best / 1e9
    return out


def timed_steps(model: Any, ids: torch.Tensor, steps: int, wrap: Any, probe: Any = None) -> dict:
    """Median step, forward and backward times after one warm-up step, and the last peak;
    `probe()` (a counter) is read around each step and its median increase reported."""
    times, fwd, bwd, deltas = [], [], [], []
    for _ in range(steps + 1):  # the first is warm-up
        p0 = probe() if probe else 0
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        with wrap():
            e0.record()
            loss = model(input_ids=ids, labels=ids).loss
            e1.record()
            loss.backward()
            e2.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e2) / 1e3)
        fwd.append(e0.elapsed_time(e1) / 1e3)
        bwd.append(e1.elapsed_time(e2) / 1e3)
        deltas.append((probe() if probe else 0) - p0)
    peak_allocated = torch.cuda.max_memory_allocated()
    # One more, untimed step from an emptied cache: the memory torch reserved for it, which
    # also counts blocks freed but waiting for a copy stream (record_stream), unlike allocated;
    # and where in the step memory peaks and time goes (MemoryTrace).
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    tracer = MemoryTrace(model)
    try:
        with wrap():
            loss = model(input_ids=ids, labels=ids).loss  # the logits are dropped, as timed
            tracer.note("loss")
            loss.backward()
            tracer.note("end")
            del loss
    finally:
        tracer.remove()
    torch.cuda.synchronize()
    trace = tracer.rows()
    peak_reserved = max(row["segment_peak_reserved_gb"] for row in trace)
    top = max(trace, key=lambda row: row["segment_peak_allocated_gb"])
    print(
        f"  traced step: allocated peaked at {top['segment_peak_allocated_gb']:.3f} GB in the "
        f"segment ending at {top['at']}; reserved peak {peak_reserved:.3f} GB; device "
        f"{trace[-1]['device_ms']:.1f} ms",
        flush=True,
    )
    return {
        "peak_reserved_gb": peak_reserved,
        "memory_trace": trace,
        "probe_delta": statistics.median(deltas[1:]),
        "step_s": statistics.median(times[1:]),
        "forward_s": statistics.median(fwd[1:]),
        "backward_s": statistics.median(bwd[1:]),
        "peak_gb": peak_allocated / 1e9,
    }


class MemoryTrace:
    """Notes torch's allocated and reserved bytes, and their peaks since the previous note, as
    the host reaches each decoder layer's forward (fwd{i}), the head (head), the loss, each
    layer's backward (bwd{i}: the gradient of its output) and the end; plus the device time of
    each point (an event on the current stream). The host runs ahead of the device, so the
    memory is the allocator's view, which is what decides reuse; a segment's peak is what the
    allocator held between two points in host order."""

    def __init__(self, model: Any) -> None:
        self._rows: list[tuple[str, int, int, int, int, Any]] = []
        self._handles = []
        for i, layer in enumerate(model.model.layers):
            self._handles.append(
                layer.register_forward_pre_hook(lambda m, a, i=i: self.note(f"fwd{i}"))
            )

            def post(m: Any, a: Any, out: Any, i: int = i) -> None:
                t = out[0] if isinstance(out, tuple | list) else out
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda g: self.note(f"bwd{i}"))

            self._handles.append(layer.register_forward_hook(post))
        head = model.get_output_embeddings()
        self._handles.append(head.register_forward_pre_hook(lambda m, a: self.note("head")))
        self.note("start")

    def note(self, where: str) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self._rows.append(
            (
                where,
                torch.cuda.memory_allocated(),
                torch.cuda.memory_reserved(),
                torch.cuda.max_memory_allocated(),
                torch.cuda.max_memory_reserved(),
                event,
            )
        )
        torch.cuda.reset_peak_memory_stats()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()

    def rows(self) -> list[dict]:
        """After a synchronize: one dict per point; segment peaks are of the segment that
        ends at the point; device_ms from the first point."""
        t0 = self._rows[0][5]
        return [
            {
                "at": where,
                "allocated_gb": alloc / 1e9,
                "reserved_gb": res / 1e9,
                "segment_peak_allocated_gb": peak_alloc / 1e9,
                "segment_peak_reserved_gb": peak_res / 1e9,
                "device_ms": t0.elapsed_time(event),
            }
            for where, alloc, res, peak_alloc, peak_res, event in self._rows
        ]


def growth_run(model: Any, ids: torch.Tensor, steps: int) -> dict:
    """Offload-all for `steps` steps on one engine: after each, the device memory torch holds
    and reserves, and the pinned pool's reserved and in-use bytes (a leak shows as growth)."""
    rt = reviva.Runtime("cuda:0")
    pool = reviva.PinnedHostPool(rt, 0)
    engine = reviva.TransferEngine(rt, pool)
    off = reviva.ActivationOffload(model, engine=engine)
    out: dict[str, list] = {
        "allocated_gb": [],
        "reserved_gb": [],
        "pinned_reserved_gb": [],
        "pinned_in_use_bytes": [],
        "step_s": [],
    }
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        with reviva.offload_activations(model, offload=off):
            model(input_ids=ids, labels=ids).loss.backward()
        torch.cuda.synchronize()
        out["step_s"].append(time.perf_counter() - t0)
        engine.synchronize()
        pool.synchronize_pending()
        st = pool.stats()
        out["allocated_gb"].append(torch.cuda.memory_allocated() / 1e9)
        out["reserved_gb"].append(torch.cuda.memory_reserved() / 1e9)
        out["pinned_reserved_gb"].append(st["bytes_reserved"] / 1e9)
        out["pinned_in_use_bytes"].append(st["bytes_in_use"])
    return out


def acceptance(rows: list[dict]) -> dict:
    by = {r["contender"]: r for r in rows}
    soc = by["save_on_cpu"]
    out: dict[str, Any] = {}
    for name, everything in by.items():
        if not name.startswith("reviva_all"):
            continue
        out[name.replace("reviva_all", "offload_all")] = {
            "ratio_to_roofline": everything["ratio_to_roofline"],
            "within_15pct_of_roofline": everything["ratio_to_roofline"] <= 1.15,
            "vs_save_on_cpu_time": everything["step_s"] / soc["step_s"],
            "at_most_half_of_save_on_cpu": everything["step_s"] <= 0.5 * soc["step_s"],
            "peak_gb": everything["peak_gb"],
            "save_on_cpu_peak_gb": soc["peak_gb"],
            "peak_not_above_save_on_cpu": everything["peak_gb"] <= soc["peak_gb"],
            "peak_reserved_gb": everything["peak_reserved_gb"],
            "save_on_cpu_peak_reserved_gb": soc["peak_reserved_gb"],
            "peak_reserved_not_above_save_on_cpu": everything["peak_reserved_gb"]
            <= soc["peak_reserved_gb"],
        }
    for r in rows:
        if r.get("budget"):
            limit = reviva.parse_bytes(r["budget"]) / 1e9
            out[r["contender"]] = {
                "peak_gb": r["peak_gb"],
                "peak_le_budget": r["peak_gb"] <= limit,
                "peak_reserved_gb": r["peak_reserved_gb"],
                "peak_reserved_le_budget": r["peak_reserved_gb"] <= limit,
                "ratio_to_roofline": r["ratio_to_roofline"],
                "within_10pct_of_roofline": r["ratio_to_roofline"] <= 1.1,
            }
    return out


def main() -> int:
    import contextlib

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--budgets", default="6GB,8GB,10GB,12GB,16GB")
    parser.add_argument("--out", default=None)
    parser.add_argument("--growth-steps", type=int, default=50)
    args = parser.parse_args()
    model = build_model()
    ids = torch.randint(0, SHAPE["vocab_size"], (1, args.seq), device="cuda")
    rows: list[dict] = []
    bw = copy_bandwidths()
    print(f"pinned copies: D2H {bw['d2h']:.1f} GB/s, H2D {bw['h2d']:.1f} GB/s", flush=True)

    plain = timed_steps(model, ids, args.steps, contextlib.nullcontext)
    plain.pop("probe_delta")
    rows.append({"contender": "plain", **plain})
    soc = timed_steps(
        model, ids, args.steps, lambda: torch.autograd.graph.save_on_cpu(pin_memory=True)
    )
    soc.pop("probe_delta")
    rows.append({"contender": "save_on_cpu", **soc})
    # Offload-all at the default min_bytes and with smaller tensors offloaded too (save_on_cpu
    # moves every saved tensor), then the budget curve.
    variants = [(None, None), (None, 16 << 10), (None, 0)]
    variants += [(b, None) for b in args.budgets.split(",")]
    for budget, min_bytes in variants:
        kwargs = {} if min_bytes is None else {"min_bytes": min_bytes}
        off = reviva.ActivationOffload(model, budget=budget, **kwargs)
        print(f"reviva: budget {budget}, min_bytes {off.min_bytes}", flush=True)
        before = off.engine.stats()
        r = timed_steps(
            model,
            ids,
            args.steps,
            lambda off=off: reviva.offload_activations(model, offload=off),
            probe=lambda off=off: off.stats.bytes_offloaded,
        )
        st = off.engine.stats()
        offloaded = r.pop("probe_delta")  # bytes per step (median, after the warm-up step)
        roof = max(plain["forward_s"], offloaded / (bw["d2h"] * 1e9)) + max(
            plain["backward_s"], offloaded / (bw["h2d"] * 1e9)
        )
        rows.append(
            {
                "contender": f"reviva_{budget or 'all'}"
                + ("" if min_bytes is None else f"_min{min_bytes >> 10}K"),
                "min_bytes": off.min_bytes,
                "window_bytes": off.window_bytes,
                "budget": budget,
                **r,
                "bytes_offloaded_per_step": offloaded,
                "engine_d2h_gbps": st["d2h"]["bandwidth_gbps"],
                "engine_h2d_gbps": st["h2d"]["bandwidth_gbps"],
                "stall_ms_total": off.stats.stall_ms,
                "overlap_ratio": off.stats.overlap_ratio,
                "roofline_s": roof,
                "ratio_to_roofline": r["step_s"] / roof,
                "offloaded_layers": off.stats.offloaded_layers,
                "forward_wait_ms_total": off.stats.forward_wait_ms,
                "narrowed_tensors_total": off.stats.narrowed_tensors,
                "prefetched": off.stats.prefetched,
                "demand_fetched": off.stats.demand_fetched,
                "engine_before": before,
            }
        )
    growth = growth_run(model, ids, args.growth_steps)
    print(
        f"growth over {args.growth_steps} offload-all steps: allocated "
        f"{growth['allocated_gb'][0]:.3f} -> {growth['allocated_gb'][-1]:.3f} GB, reserved "
        f"{growth['reserved_gb'][0]:.3f} -> {growth['reserved_gb'][-1]:.3f} GB, pinned "
        f"{growth['pinned_reserved_gb'][0]:.3f} -> {growth['pinned_reserved_gb'][-1]:.3f} GB",
        flush=True,
    )
    print_table(
        ["contender", "step s", "peak GB", "reserved GB", "offloaded GB", "roofline s", "ratio"],
        [
            [
                r["contender"],
                f"{r['step_s']:.3f}",
                f"{r['peak_gb']:.2f}",
                f"{r['peak_reserved_gb']:.2f}",
                f"{r.get('bytes_offloaded_per_step', 0) / 1e9:.2f}",
                f"{r['roofline_s']:.3f}" if "roofline_s" in r else "-",
                f"{r['ratio_to_roofline']:.3f}" if "ratio_to_roofline" in r else "-",
            ]
            for r in rows
        ],
    )
    checks = acceptance(rows)
    checks["no_growth"] = {
        "steps": args.growth_steps,
        "allocated_constant": len(set(growth["allocated_gb"])) == 1,
        "reserved_constant_after_5": len(set(growth["reserved_gb"][5:])) == 1,
        "pinned_constant_after_5": len(set(growth["pinned_reserved_gb"][5:])) == 1,
        "pinned_in_use_zero": not any(growth["pinned_in_use_bytes"]),
    }
    print(json.dumps(checks, indent=1))
    out_dir = Path(args.out) if args.out else None
    path = write_result(
        "train",
        {
            "environment": environment(),
            "model": SHAPE,
            "seq": args.seq,
            "anchors": ANCHORS,
            "pinned_copy_gbps": bw,
            "allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
            "runs": rows,
            "growth": growth,
            "checks": checks,
        },
        out_dir,
    )
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for r in rows:
            ax.scatter(r["peak_gb"], r["step_s"])
            ax.annotate(r["contender"], (r["peak_gb"], r["step_s"]), fontsize=7)
        ax.set_xlabel("peak GB")
        ax.set_ylabel("step s")
        ax.set_title("training step: time against peak memory")
        fig.savefig(path.with_suffix(".png"), dpi=120, bbox_inches="tight")
    except ImportError:
        print("matplotlib not installed: no PNG")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
