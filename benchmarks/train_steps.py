"""What one bench_train contender's steps take: the timed steps (device time by CUDA events, the
peak, the bytes offloaded), an untimed step traced layer by layer (MemoryTrace), the growth run
(memory after each of many steps), and the pinned copy bandwidths of the roofline. Runs inside a
card worker or in-process."""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from typing import Any

import torch
from card import CardSampler, error_fields, gb, rss_bytes, safe, say
from train_contenders import contender_spec

import reviva


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
