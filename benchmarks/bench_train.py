"""A training step with activation offload, on a card of N GB as a user runs it: time against peak
memory.

Model: Llama-shaped, hidden 2048, 16 layers, MLP 8192, 32 heads, 8 K/V heads, vocab 32000, bf16
(1.2B), sequence 8192, forward+backward with labels. Contenders:
    plain              no offload
    save_on_cpu        torch.autograd.graph.save_on_cpu(pin_memory=True)
    reviva_all         reviva.offload_activations with one ActivationOffload (offload-all,
                       default min_bytes 0: every saved tensor); reviva_all_min1024K:
                       tensors under 1 MiB stay on the device; reviva_all_arena: the
                       blocks brought back in Reviva's arena (memory="arena") instead of
                       torch's pool
    reviva_<budget>    ActivationOffload(budget=<budget>), e.g. reviva_6GB
    growth             offload-all for --growth-steps steps on one engine: device and pinned
                       memory after each (a leak shows as growth)
Each contender times --steps steps after one warm-up step (the first step's time is recorded
too), then one untimed step from an emptied cache that records the reserved peak and where memory
grows (allocated and reserved at each layer's forward and backward). The roofline of a step that
offloads A bytes is max(forward, A / D2H bandwidth) + max(backward, A / H2D bandwidth), with
forward and backward from the plain run (the no-card one when there is one) and the bandwidths of
plain 1 GiB pinned copies measured in the plain workers.

Card mode (the default; DESIGN.md, "Measuring as a user runs it")
    python benchmarks/bench_train.py [--card 24GB] [--contenders ...] [--no-card-contenders plain]
        [--steps 5] [--max-wall-s 540] [--out DIR]
Every contender runs in a fresh worker process that takes (device total - N) with cudaMalloc
outside torch's allocator before the model is built, with torch's allocator at its defaults
(PYTORCH_CUDA_ALLOC_CONF and PYTORCH_ALLOC_CONF removed from its environment; no per-process
fraction). A thread polls torch.cuda.mem_get_info every ~2 ms during the steps: card_peak_used_gb
= N - least free seen. Rows are written to the JSON as they arrive.

Checks (the JSON's `checks`):
    train_card     on the card: reviva_all's step <= 0.5x save_on_cpu's, its peak (allocated)
                   <= save_on_cpu's, its step <= 1.05x the roofline; every reviva_<budget>'s
                   peak (allocated) <= its budget. A contender whose blocks live in Reviva's
                   arena adds the arena's peak mapped bytes to torch's peak allocated (an upper
                   bound of the two at once); card_peak_used_gb counts everything.
    offload_all*, reviva_<budget>, no_growth   the earlier figures, from the card runs.
Reproduce: python benchmarks/bench_train.py --out $OUT --max-wall-s 540 (12 workers, ~4.5 min
estimated on the H200; printed first). CPU dry run of every path (tiny model): --dry-run.

In-process mode (the earlier measurement; not how a user runs it): --mode inprocess runs every
contender in this one process with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True and no card.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

import reviva

sys.path.insert(0, str(Path(__file__).resolve().parent))
from card import (  # noqa: E402
    ALLOC_CONF_VARS,
    CardSampler,
    WorkerRun,
    child_environment,
    emit,
    error_fields,
    gb,
    prepare_device,
    rss_bytes,
    safe,
    say,
)
from common import environment, print_table, result_path, write_json  # noqa: E402
from plots import plot_beside  # noqa: E402

SHAPE = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=32000,
    max_position_embeddings=16384,
)
DRY_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=2048,
)
ANCHORS = {
    "plain_step_s": 0.158,
    "plain_peak_gb": 19.8,
    "save_on_cpu_step_s": 1.07,
    "save_on_cpu_peak_gb": 5.4,
}
CONTENDERS = (
    "plain,save_on_cpu,reviva_all,reviva_all_min1024K,"
    "reviva_6GB,reviva_8GB,reviva_10GB,reviva_12GB,reviva_16GB,growth"
)
DRY_CONTENDERS = "plain,save_on_cpu,reviva_all,reviva_all_min0K,reviva_2MB,growth"
DESIGN_COPY_GBPS = {"d2h": 55.3, "h2d": 55.4}  # DESIGN.md, when no plain worker measured them
MAX_VS_SAVE_ON_CPU = 0.5
MAX_ROOFLINE_RATIO = 1.05
# Rough H200 seconds for the printed estimates.
EST_START_S, EST_BUILD_S = 12.0, 6.0
EST_STEP_S = {"plain": 0.16, "save_on_cpu": 1.07, "reviva": 0.3, "growth": 0.3}
DONE_GRACE_S = 60.0


def contender_spec(name: str) -> dict[str, Any]:
    """What a contender name runs; ValueError naming it when unknown."""
    if name in ("plain", "save_on_cpu", "growth"):
        return {"kind": name}
    if name == "reviva_all":
        return {"kind": "reviva", "budget": None, "min_bytes": None}
    if name == "reviva_all_arena":  # the blocks brought back in Reviva's arena
        return {"kind": "reviva", "budget": None, "min_bytes": None, "memory": "arena"}
    if name.startswith("reviva_all_min") and name.endswith("K"):
        kib = name[len("reviva_all_min") : -1]
        if kib.isdigit():
            return {"kind": "reviva", "budget": None, "min_bytes": int(kib) << 10}
    elif name.startswith("reviva_"):
        budget = name[len("reviva_") :]
        reviva.parse_bytes(budget)  # ValueError naming it
        return {"kind": "reviva", "budget": budget, "min_bytes": None}
    raise ValueError(
        f"unknown contender {name!r}: use plain, save_on_cpu, growth, reviva_all, "
        "reviva_all_arena, reviva_all_min<N>K or reviva_<budget> (e.g. reviva_8GB)"
    )


def build_model(dry_run: bool = False) -> Any:
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(**(DRY_SHAPE if dry_run else SHAPE), attn_implementation="sdpa")
    torch.manual_seed(0)
    if dry_run:
        return AutoModelForCausalLM.from_config(cfg).train()
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    return model.train()


class Clock:
    """Points in device time (CUDA events on the current stream) or host time (CPU)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def mark(self) -> Any:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def seconds(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


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
    del host, dev
    torch.cuda.empty_cache()
    return out


def timed_steps(
    model: Any,
    ids: torch.Tensor,
    steps: int,
    wrap: Any,
    out: dict,
    cuda: bool,
    probe: Any = None,
    arena: Any = None,
) -> None:
    """Fills `out` as it goes (a failed step leaves what came before): median step, forward and
    backward times after one warm-up step (whose time is first_step_s), the last step's peak;
    `probe()` (a counter) is read around each step and its median increase reported.
    peak_gb is torch's max_memory_allocated plus, with `arena` (Reviva's device memory, outside
    torch's allocator: the activations brought back), the most the arena mapped in the step:
    an upper bound of their sum at any instant (both also reported alone)."""
    clock = Clock(cuda)
    times, fwd, bwd, deltas = [], [], [], []
    out["step_times_s"] = times
    for _ in range(steps + 1):  # the first is warm-up
        p0 = probe() if probe else 0
        model.zero_grad(set_to_none=True)
        clock.sync()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        if arena is not None:
            arena.reset_peak()
        with wrap():
            e0 = clock.mark()
            loss = model(input_ids=ids, labels=ids).loss
            e1 = clock.mark()
            loss.backward()
            e2 = clock.mark()
        del loss
        clock.sync()
        times.append(clock.seconds(e0, e2))
        fwd.append(clock.seconds(e0, e1))
        bwd.append(clock.seconds(e1, e2))
        deltas.append((probe() if probe else 0) - p0)
    out.update(
        first_step_s=times[0],
        probe_delta=statistics.median(deltas[1:]),
        step_s=statistics.median(times[1:]),
        forward_s=statistics.median(fwd[1:]),
        backward_s=statistics.median(bwd[1:]),
        torch_peak_gb=gb(torch.cuda.max_memory_allocated()) if cuda else None,
        arena_peak_gb=gb(arena.stats()["peak_bytes"]) if arena is not None else None,
        peak_gb=gb(
            torch.cuda.max_memory_allocated()
            + (arena.stats()["peak_bytes"] if arena is not None else 0)
        )
        if cuda
        else None,
        max_reserved_timed_gb=gb(torch.cuda.max_memory_reserved()) if cuda else None,
    )
    if not cuda:
        out.update(peak_reserved_gb=None, memory_trace=None)
        return
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
    say(
        f"  traced step: allocated peaked at {top['segment_peak_allocated_gb']:.3f} GB in the "
        f"segment ending at {top['at']}; reserved peak {peak_reserved:.3f} GB; device "
        f"{trace[-1]['device_ms']:.1f} ms"
    )
    out.update(peak_reserved_gb=peak_reserved, memory_trace=trace)


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


def growth_run(model: Any, ids: torch.Tensor, steps: int, cuda: bool, out: dict) -> None:
    """Offload-all for `steps` steps on one engine: after each, the device memory torch holds
    and reserves, the device's free memory, and the pinned pool's reserved and in-use bytes (a
    leak shows as growth). Fills `out` as it goes."""
    rt = reviva.Runtime("cuda:0" if cuda else "cpu")
    pool = reviva.PinnedHostPool(rt, 0)
    engine = reviva.TransferEngine(rt, pool)
    off = reviva.ActivationOffload(model, engine=engine)
    for k in (
        "allocated_gb",
        "reserved_gb",
        "device_free_gb",
        "pinned_reserved_gb",
        "pinned_in_use_bytes",
        "rss_gb",
        "step_s",
    ):
        out[k] = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        with reviva.offload_activations(model, offload=off):
            model(input_ids=ids, labels=ids).loss.backward()
        if cuda:
            torch.cuda.synchronize()
        out["step_s"].append(time.perf_counter() - t0)
        engine.synchronize()
        pool.synchronize_pending()
        st = pool.stats()
        out["allocated_gb"].append(gb(torch.cuda.memory_allocated()) if cuda else None)
        out["reserved_gb"].append(gb(torch.cuda.memory_reserved()) if cuda else None)
        out["device_free_gb"].append(gb(torch.cuda.mem_get_info()[0]) if cuda else None)
        out["pinned_reserved_gb"].append(gb(st.get("bytes_reserved")))
        out["pinned_in_use_bytes"].append(st.get("bytes_in_use"))
        out["rss_gb"].append(gb(rss_bytes()))


def run_contender(
    name: str,
    model: Any,
    ids: torch.Tensor,
    args: argparse.Namespace,
    cuda: bool,
    probe: Any,
    probe_total: int,
) -> dict[str, Any]:
    """One contender's steps and what they took; a failure is recorded in the row."""
    spec = contender_spec(name)
    row: dict[str, Any] = {"contender": name, "spec": spec}
    sampler = CardSampler(probe, args.sample_ms / 1e3)
    off = None
    try:
        with sampler:
            if spec["kind"] == "plain":
                timed_steps(model, ids, args.steps, contextlib.nullcontext, row, cuda)
            elif spec["kind"] == "save_on_cpu":
                timed_steps(
                    model,
                    ids,
                    args.steps,
                    lambda: torch.autograd.graph.save_on_cpu(pin_memory=True),
                    row,
                    cuda,
                )
            elif spec["kind"] == "growth":
                growth = row["growth"] = {}
                growth_run(model, ids, args.growth_steps, cuda, growth)
            else:
                kwargs = {} if spec["min_bytes"] is None else {"min_bytes": spec["min_bytes"]}
                if "memory" in spec:
                    kwargs["memory"] = spec["memory"]
                off = reviva.ActivationOffload(model, budget=spec["budget"], **kwargs)
                say(f"  reviva: budget {spec['budget']}, min_bytes {off.min_bytes}")
                row.update(
                    budget=spec["budget"],
                    min_bytes=off.min_bytes,
                    memory=off.memory,
                    window_bytes=getattr(off, "window_bytes", None),
                    engine_before=safe(off.engine.stats),
                )
                timed_steps(
                    model,
                    ids,
                    args.steps,
                    lambda: reviva.offload_activations(model, offload=off),
                    row,
                    cuda,
                    probe=lambda: off.stats.bytes_to_host,
                    arena=off.arena,
                )
        row.update(error=None, oom=False, completed=True)
    except Exception as e:  # a failure is a result too: recorded, not hidden
        row.update(error_fields(e), completed=False)
    if "probe_delta" in row:
        delta = row.pop("probe_delta")
        if spec["kind"] == "reviva":
            row["bytes_offloaded_per_step"] = delta  # median, after the warm-up step
    if off is not None:
        st = off.stats
        eng = safe(off.engine.stats) or {}
        row.update(
            engine_d2h_gbps=(eng.get("to_host") or {}).get("bandwidth_gbps"),
            engine_h2d_gbps=(eng.get("to_device") or {}).get("bandwidth_gbps"),
            stall_s_total=getattr(st, "stall_s", None),
            overlap_ratio=getattr(st, "overlap_ratio", None),
            offloaded_layers=getattr(st, "offloaded_layers", None),
            host_wait_s_total=getattr(st, "host_wait_s", None),
            narrowed_tensors_total=getattr(st, "narrowed_tensors", None),
            prefetched=getattr(st, "prefetched", None),
            demand_fetched=getattr(st, "demand_fetched", None),
            manager=safe(off.manager.metrics),
            scheduler=safe(off.scheduler.stats) if off.scheduler is not None else None,
        )
    low = sampler.min_free
    row["card_min_free_gb"] = gb(low)
    row["card_peak_used_gb"] = None if low is None else gb(probe_total - low)
    row["sampler"] = sampler.summary()
    if spec["kind"] == "plain" and cuda and args.bandwidth:
        model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        try:
            row["pinned_copy_gbps"] = copy_bandwidths()
            say(
                f"  pinned copies: D2H {row['pinned_copy_gbps']['d2h']:.1f} GB/s, H2D "
                f"{row['pinned_copy_gbps']['h2d']:.1f} GB/s"
            )
        except Exception as e:  # e.g. no room on the card: the driver falls back to DESIGN's
            row["pinned_copy_error"] = f"{type(e).__name__}: {e}"[:500]
    return row


# --- analysis -------------------------------------------------------------------------------------


def add_rooflines(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The roofline of every Reviva row, from the plain run's forward and backward (no card when
    there is one) and the measured pinned copy bandwidths (else DESIGN.md's); says which."""
    plain = [r for r in rows if r["contender"] == "plain" and r.get("completed")]
    plain.sort(key=lambda r: r.get("mode") != "no_card")
    ref = plain[0] if plain else None
    bw_rows = [r for r in plain if r.get("pinned_copy_gbps")]
    bw = bw_rows[0]["pinned_copy_gbps"] if bw_rows else DESIGN_COPY_GBPS
    info = {
        "compute_from": f"{ref['mode']} plain" if ref else None,
        "forward_s": ref and ref["forward_s"],
        "backward_s": ref and ref["backward_s"],
        "pinned_copy_gbps": bw,
        "pinned_copy_gbps_from": f"{bw_rows[0]['mode']} plain" if bw_rows else "DESIGN.md",
    }
    for r in rows:
        a = r.get("bytes_offloaded_per_step")
        if a is None or not r.get("completed") or ref is None:
            continue
        roof = max(ref["forward_s"], a / (bw["d2h"] * 1e9)) + max(
            ref["backward_s"], a / (bw["h2d"] * 1e9)
        )
        r["roofline_s"] = roof
        r["ratio_to_roofline"] = r["step_s"] / roof
    return info


def acceptance(rows: list[dict]) -> dict:
    """The earlier checks, from rows of one mode (card or in-process)."""
    by = {r["contender"]: r for r in rows if r.get("completed")}
    soc = by.get("save_on_cpu")
    out: dict[str, Any] = {}
    for name, everything in by.items():
        if not name.startswith("reviva_all") or soc is None:
            continue
        ratio = everything.get("ratio_to_roofline")
        res, soc_res = everything.get("peak_reserved_gb"), soc.get("peak_reserved_gb")
        out[name.replace("reviva_all", "offload_all")] = {
            "ratio_to_roofline": ratio,
            "within_15pct_of_roofline": ratio is not None and ratio <= 1.15,
            "vs_save_on_cpu_time": everything["step_s"] / soc["step_s"],
            "at_most_half_of_save_on_cpu": everything["step_s"] <= 0.5 * soc["step_s"],
            "peak_gb": everything.get("peak_gb"),
            "save_on_cpu_peak_gb": soc.get("peak_gb"),
            "peak_not_above_save_on_cpu": _le(everything.get("peak_gb"), soc.get("peak_gb")),
            "peak_reserved_gb": res,
            "save_on_cpu_peak_reserved_gb": soc_res,
            "peak_reserved_not_above_save_on_cpu": _le(res, soc_res),
        }
    for r in rows:
        if r.get("budget") and r.get("completed"):
            limit = reviva.parse_bytes(r["budget"]) / 1e9
            ratio = r.get("ratio_to_roofline")
            out[r["contender"]] = {
                "peak_gb": r.get("peak_gb"),
                "peak_le_budget": _le(r.get("peak_gb"), limit),
                "peak_reserved_gb": r.get("peak_reserved_gb"),
                "peak_reserved_le_budget": _le(r.get("peak_reserved_gb"), limit),
                "ratio_to_roofline": ratio,
                "within_10pct_of_roofline": ratio is not None and ratio <= 1.1,
            }
    growth = next((r["growth"] for r in rows if r.get("growth")), None)
    if growth and growth.get("step_s"):
        steps = len(growth["step_s"])
        out["no_growth"] = {
            "steps": steps,
            "allocated_constant": len(set(growth["allocated_gb"])) == 1,
            "reserved_constant_after_5": len(set(growth["reserved_gb"][5:])) <= 1,
            "pinned_constant_after_5": len(set(growth["pinned_reserved_gb"][5:])) <= 1,
            "pinned_in_use_zero": not any(growth["pinned_in_use_bytes"]),
        }
    return out


def _le(a: float | None, b: float | None) -> bool:
    return a is not None and b is not None and a <= b


def train_card_check(rows: list[dict], card: str) -> dict[str, Any]:
    """The card mode's acceptance: offload-all against save_on_cpu and its roofline, budgets."""
    by = {r["contender"]: r for r in rows if r.get("mode") == "card"}
    soc, everything = by.get("save_on_cpu"), by.get("reviva_all")
    missing = []
    for name, r in (("save_on_cpu", soc), ("reviva_all", everything)):
        if r is None:
            missing.append(f"no {name} run on the card")
        elif not r.get("completed"):
            missing.append(f"{name} on the card failed: {r.get('error')}")
    offload_all: dict[str, Any] = {"contender": "reviva_all"}
    if everything is not None and everything.get("completed") and soc and soc.get("completed"):
        ratio = everything.get("ratio_to_roofline")
        if ratio is None:
            missing.append("no roofline for reviva_all (no completed plain run)")
        offload_all.update(
            step_s=everything["step_s"],
            first_step_s=everything.get("first_step_s"),
            save_on_cpu_step_s=soc["step_s"],
            vs_save_on_cpu_time=everything["step_s"] / soc["step_s"],
            time_ok=everything["step_s"] <= MAX_VS_SAVE_ON_CPU * soc["step_s"],
            peak_gb=everything.get("peak_gb"),
            save_on_cpu_peak_gb=soc.get("peak_gb"),
            peak_ok=_le(everything.get("peak_gb"), soc.get("peak_gb")),
            card_peak_used_gb=everything.get("card_peak_used_gb"),
            save_on_cpu_card_peak_used_gb=soc.get("card_peak_used_gb"),
            ratio_to_roofline=ratio,
            roofline_ok=ratio is not None and ratio <= MAX_ROOFLINE_RATIO,
        )
        offload_all["ok"] = bool(
            offload_all["time_ok"] and offload_all["peak_ok"] and offload_all["roofline_ok"]
        )
    else:
        offload_all["ok"] = False
    budgets = {}
    for name, r in by.items():
        spec = r.get("spec") or {}
        if spec.get("kind") != "reviva" or not spec.get("budget"):
            continue
        limit = reviva.parse_bytes(spec["budget"]) / 1e9
        budgets[name] = {
            "budget_gb": limit,
            "completed": bool(r.get("completed")),
            "error": r.get("error"),
            "peak_gb": r.get("peak_gb"),
            "ok": bool(r.get("completed")) and _le(r.get("peak_gb"), limit),
            "peak_reserved_gb": r.get("peak_reserved_gb"),
            "max_reserved_timed_gb": r.get("max_reserved_timed_gb"),
            "card_peak_used_gb": r.get("card_peak_used_gb"),
            "step_s": r.get("step_s"),
            "ratio_to_roofline": r.get("ratio_to_roofline"),
        }
    if not budgets:
        missing.append("no reviva_<budget> run on the card")
    return {
        "card": card,
        "criteria": f"reviva_all: step <= {MAX_VS_SAVE_ON_CPU}x save_on_cpu's, peak (allocated) "
        f"<= save_on_cpu's, step <= {MAX_ROOFLINE_RATIO}x the roofline; every reviva_<budget>: "
        "completed, peak (allocated) <= the budget",
        "missing": missing,
        "offload_all": offload_all,
        "budgets": budgets,
        "pass": not missing and offload_all["ok"] and all(b["ok"] for b in budgets.values()),
    }


def print_rows(rows: list[dict]) -> None:
    def f(x: Any, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    print_table(
        [
            "mode",
            "contender",
            "result",
            "step s",
            "first s",
            "peak GB",
            "reserved GB",
            "card peak GB",
            "offloaded GB",
            "roofline s",
            "ratio",
        ],
        [
            [
                r.get("mode", "-"),
                r["contender"],
                "ok" if r.get("completed") else ("OOM" if r.get("oom") else "ERROR"),
                f(r.get("step_s"), ".3f"),
                f(r.get("first_step_s"), ".3f"),
                f(r.get("peak_gb"), ".2f"),
                f(r.get("peak_reserved_gb"), ".2f"),
                f(r.get("card_peak_used_gb"), ".2f"),
                f(gb(r.get("bytes_offloaded_per_step")), ".2f"),
                f(r.get("roofline_s"), ".3f"),
                f(r.get("ratio_to_roofline"), ".3f"),
            ]
            for r in rows
        ],
    )


# --- card mode: worker and driver -----------------------------------------------------------------


def worker(args: argparse.Namespace) -> int:
    card = None if args.card == "none" else args.card
    cuda = not args.dry_run and torch.cuda.is_available()
    head: dict[str, Any] = {
        "contender": args.contender,
        "mode": "card" if card else "no_card",
        "card": card,
        "pid": os.getpid(),
        "allocator_env": {k: os.environ.get(k) for k in ALLOC_CONF_VARS},
        "device": "cuda" if cuda else "cpu (dry run)",
    }
    say(f"# worker pid {os.getpid()}: {args.contender}, {head['mode']}")
    if not cuda and not args.dry_run:
        emit("ROW", {**head, "completed": False, "error": "no CUDA device (use --dry-run)"})
        return 2
    prepared, ballast, probe, probe_total = prepare_device(
        reviva.parse_bytes(card) if card else None, cuda
    )
    head["device_setup"] = prepared
    if "error" in prepared:
        emit("ROW", {**head, "completed": False, "error": prepared["error"]["error"]})
        return 3
    emit("ENV", environment())
    try:
        t = time.perf_counter()
        model = build_model(args.dry_run)
        head["build_s"] = time.perf_counter() - t
        head["params"] = sum(p.numel() for p in model.parameters())
        vocab = model.config.vocab_size
        device = "cuda" if cuda else "cpu"
        gen = torch.Generator(device=device).manual_seed(0)
        ids = torch.randint(0, vocab, (1, args.seq), device=device, generator=gen)
        say(f"# model built in {head['build_s']:.1f} s; {args.steps} steps + warm-up")
    except Exception as e:
        emit("ROW", {**head, **error_fields(e), "completed": False})
        gc.collect()
        if ballast is not None:
            ballast.free()
        emit("DONE", {"rss_bytes": rss_bytes(), "setup_failed": True})
        return 0
    row = run_contender(args.contender, model, ids, args, cuda, probe, probe_total)
    emit("ROW", {**head, **row})
    del model, ids
    gc.collect()
    if cuda:
        safe(torch.cuda.synchronize)
        safe(torch.cuda.empty_cache)
    if ballast is not None:
        ballast.free()
    emit("DONE", {"rss_bytes": rss_bytes()})
    return 0


def estimate_s(name: str, args: argparse.Namespace) -> float:
    kind = contender_spec(name)["kind"]
    if kind == "growth":
        work = args.growth_steps * EST_STEP_S["growth"]
    else:
        work = (args.steps + 2) * EST_STEP_S[kind] + (3.0 if kind == "plain" else 0.0)
    return EST_START_S + EST_BUILD_S + work


def finish(rows: list[dict], mode_rows: list[dict], card: str | None) -> dict[str, Any]:
    roof = add_rooflines(rows)
    checks = acceptance(mode_rows)
    if card:
        checks["train_card"] = train_card_check(rows, card)
    return {"roofline_reference": roof, "checks": checks}


def driver(args: argparse.Namespace) -> int:
    card = args.card
    reviva.parse_bytes(card)
    on_card = [c for c in args.contenders.split(",") if c]
    no_card = [c for c in args.no_card_contenders.split(",") if c]
    runs = [("no_card", c) for c in no_card] + [("card", c) for c in on_card]
    for _, name in runs:
        contender_spec(name)  # every name checked before any run
    env = environment(cuda=False)
    child_env, removed = child_environment()
    settings = {
        "mode": "card",
        "card": card,
        "seq": args.seq,
        "steps": args.steps,
        "growth_steps": args.growth_steps,
        "contenders": on_card,
        "no_card_contenders": no_card,
        "sample_ms": args.sample_ms,
        "allocator": "torch defaults: " + ", ".join(ALLOC_CONF_VARS) + " removed from every "
        "worker's environment; no set_per_process_memory_fraction",
        "removed_from_worker_env": removed,
        "ballast": "cudaMalloc of (device total - card) outside torch's allocator, after "
        "torch.cuda.init() and before the model, in every card worker",
        "dry_run": args.dry_run,
        "max_wall_s": args.max_wall_s,
    }
    estimates = []
    say(f"# card mode, card {card}: {len(runs)} workers")
    for mode, name in runs:
        est = estimate_s(name, args)
        estimates.append({"mode": mode, "contender": name, "estimate_s": est})
        say(f"#   {mode:>7} {name:>18}: ~{est:.0f} s (H200 estimate)")
    say(f"# estimated total ~{sum(e['estimate_s'] for e in estimates):.0f} s")
    if args.estimate_only:
        return 0
    rows: list[dict[str, Any]] = []
    workers: list[dict[str, Any]] = []
    path = result_path(args.name or "train-card", env, args.out_dir)

    def save(final: bool = False) -> dict[str, Any]:
        analysis = finish(rows, [r for r in rows if r.get("mode") == "card"], card)
        write_json(
            path,
            {
                "environment": env,
                "complete": final,
                "model": DRY_SHAPE if args.dry_run else SHAPE,
                "settings": settings,
                "anchors": ANCHORS,
                "estimates": estimates,
                "workers": workers,
                "runs": rows,
                **analysis,
            },
        )
        return analysis

    save()
    say(f"# writing {path} as results arrive")
    t_start = time.perf_counter()
    for i, ((mode, name), est) in enumerate(zip(runs, estimates, strict=True)):
        record: dict[str, Any] = {"mode": mode, "contender": name, "estimate_s": est["estimate_s"]}
        workers.append(record)
        elapsed = time.perf_counter() - t_start
        if args.max_wall_s and elapsed + est["estimate_s"] > args.max_wall_s:
            record["status"] = (
                f"skipped: estimated {est['estimate_s']:.0f} s, {args.max_wall_s - elapsed:.0f} s "
                f"left of --max-wall-s {args.max_wall_s:.0f}"
            )
            rows.append(
                {"mode": mode, "contender": name, "completed": False, "error": record["status"]}
            )
            say(f"# [{i + 1}] {record['status']}")
            save()
            continue
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--worker",
            "--contender",
            name,
            "--card",
            card if mode == "card" else "none",
            "--steps",
            str(args.steps),
            "--seq",
            str(args.seq),
            "--growth-steps",
            str(args.growth_steps),
            "--sample-ms",
            str(args.sample_ms),
        ] + (["--dry-run"] if args.dry_run else [])
        record["command"] = " ".join(cmd[1:])
        say(f"# [{i + 1}/{len(runs)}] {record['command']}")
        t0 = time.perf_counter()
        got: list[dict] = []

        def on_line(tag: str, obj: Any, record: dict[str, Any] = record, got: list = got) -> None:
            if tag == "TEXT":
                say("  | " + obj)
            elif tag == "ENV":
                for k in ("gpu", "gpu_memory_bytes", "gpu_count", "torch_cuda", "reviva_core"):
                    if k in obj and env.get(k) is None:
                        env[k] = obj[k]
            elif tag == "ROW":
                got.append(obj)
                rows.append(obj)
                say(
                    f"  = {obj.get('mode')} {obj['contender']}: "
                    + (
                        f"step {obj.get('step_s')} s, peak {obj.get('peak_gb')} GB, card peak "
                        f"{obj.get('card_peak_used_gb')} GB"
                        if obj.get("completed")
                        else f"FAILED {obj.get('error')}"
                    )
                )
                save()
            elif tag == "DONE":
                record["done"] = obj

        deadline = t_start + args.max_wall_s if args.max_wall_s else None
        worker_run = WorkerRun(cmd, child_env, ("ENV", "ROW", "DONE"), DONE_GRACE_S)
        record["status"] = worker_run.follow(deadline, on_line)
        record["returncode"] = worker_run.returncode
        record["wall_s"] = time.perf_counter() - t0
        record["log_tail"] = worker_run.tail[-60:]
        if not got:
            rows.append(
                {
                    "mode": mode,
                    "contender": name,
                    "completed": False,
                    "error": f"no result: {record['status']}",
                }
            )
        say(f"# [{i + 1}] {record['status']} after {record['wall_s']:.0f} s")
        save()
    analysis = save(final=True)
    print_rows(rows)
    print(json.dumps(analysis["checks"], indent=1))
    say(f"wrote {path}")
    plot_beside(path)
    return 0


# --- in-process mode (the earlier measurement) ----------------------------------------------------


def inprocess(args: argparse.Namespace) -> int:
    if os.environ.get("PYTORCH_CUDA_ALLOC_CONF") is None and not args.dry_run:
        # Expandable segments for every contender, as this mode always measured; set before
        # torch's allocator starts, which only a fresh process guarantees.
        env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    cuda = not args.dry_run and torch.cuda.is_available()
    if not cuda and not args.dry_run:
        raise SystemExit("no CUDA device: use --dry-run")
    env = environment()
    _, _, probe, probe_total = prepare_device(None, cuda)
    model = build_model(args.dry_run)
    device = "cuda" if cuda else "cpu"
    ids = torch.randint(0, model.config.vocab_size, (1, args.seq), device=device)
    rows = []
    for name in [c for c in args.contenders.split(",") if c]:
        say(f"# {name}")
        row = run_contender(name, model, ids, args, cuda, probe, probe_total)
        row["mode"] = "inprocess"
        rows.append(row)
        if not row.get("completed"):
            say(f"  FAILED {row.get('error')}")
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
    analysis = finish(rows, rows, None)
    print_rows(rows)
    print(json.dumps(analysis["checks"], indent=1))
    path = result_path(args.name or "train", env, args.out_dir)
    write_json(
        path,
        {
            "environment": env,
            "complete": True,
            "model": DRY_SHAPE if args.dry_run else SHAPE,
            "seq": args.seq,
            "settings": {"mode": "inprocess", "dry_run": args.dry_run},
            "anchors": ANCHORS,
            "allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
            "runs": rows,
            **analysis,
        },
    )
    say(f"wrote {path}")
    plot_beside(path)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mode", choices=("card", "inprocess"), default="card")
    parser.add_argument("--card", default="24GB", help="card mode: the card's memory")
    parser.add_argument(
        "--contenders", default=None, help=f"default {CONTENDERS} (dry run: {DRY_CONTENDERS})"
    )
    parser.add_argument(
        "--no-card-contenders",
        default="plain",
        help="card mode: contenders also run without a card (plain: the roofline's forward and "
        "backward); '' for none",
    )
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seq", type=int, default=None, help="tokens (default 8192; dry run 256)")
    parser.add_argument("--growth-steps", type=int, default=None, help="default 50 (dry run 6)")
    parser.add_argument("--sample-ms", type=float, default=2.0)
    parser.add_argument("--max-wall-s", type=float, default=0.0)
    parser.add_argument("--dry-run", action="store_true", help="on the CPU, a tiny model")
    parser.add_argument("--estimate-only", action="store_true")
    parser.add_argument("--no-bandwidth", dest="bandwidth", action="store_false")
    parser.add_argument("--out", default=None)
    parser.add_argument("--name", default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--contender", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.out_dir = Path(args.out) if args.out else None
    args.seq = args.seq or (256 if args.dry_run else 8192)
    args.growth_steps = args.growth_steps or (6 if args.dry_run else 50)
    args.contenders = (
        args.contenders
        if args.contenders is not None
        else (DRY_CONTENDERS if args.dry_run else CONTENDERS)
    )
    if args.worker:
        return worker(args)
    if args.mode == "inprocess":
        return inprocess(args)
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
