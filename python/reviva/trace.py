"""What a user sees of a call while it runs and after: a progress line for long prefills, named
ranges for profilers, and a trace file of compute, copies and stalls.

Note [Traces]
~~~~~~~~~~~~~
RevivaManager.trace(path) (and ActivationOffload.trace(path)) writes the last call (step) as a
Chrome trace (JSON; opens in Perfetto, ui.perfetto.dev, or chrome://tracing), one track each:
- "compute": prefill, each prefill layer, decode, each decode step: CUDA events on the compute
  stream (the host's clock on the host backend);
- "K/V to device", "K/V to host", "weights to device": each copy the core's TransferEngine ran
  for the stores, start to end on their copy streams (the core's timeline, TimelineEvent);
- "stalls": compute waiting for a copy (the core's ComputeStall events), and "host waits" (the
  host thread blocked on a copy: HostWait).
Every time counts from the call's start. The stores' timelines count from their own origin event,
which the core records and synchronizes when a store is made; the manager notes the host clock
then, so an event at t ms from a store's origin is at (origin_host - call_start_host) * 1e3 + t.
The compute events count from the call's first CUDA event. Both alignments assume the device is
idle at those two moments (a store is made before any of the call's work is queued, and a call
starts after the previous one returned): within a few microseconds on the H200.

The core keeps at most 65536 events per store (then counts them as dropped: the trace's
metadata says how many); the weight store lives as long as the manager, so its events are taken
(OffloadManager::take_timeline) at each call's start and end.

Ranges: torch.profiler.record_function around the call, prefill, each prefill layer, decode and
each decode step (names "reviva.generate", "reviva.prefill", "reviva.prefill.layer",
"reviva.decode", "reviva.decode.step"), so they show in torch.profiler's traces, and as NVTX
ranges under `torch.autograd.profiler.emit_nvtx()` (Nsight Systems).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterable
from typing import Any, TextIO

import torch

from reviva import switches

_TRACKS = (  # in this order; a track without spans is left out
    "compute",
    "K/V to device",
    "K/V to host",
    "weights to device",
    "weights to host",
    "activations to host",
    "activations to device",
    "stalls",
    "host waits",
)
_KIND_TRACK = {
    "copy_to_device": "to device",
    "copy_to_host": "to host",
}


class Ranges:
    """A stack of torch.profiler.record_function ranges entered and left by hand (the phases
    begin and end in different hooks)."""

    def __init__(self) -> None:
        self._open: list[tuple[str, Any]] = []

    def push(self, name: str) -> None:
        r = torch.profiler.record_function(name)
        r.__enter__()
        self._open.append((name, r))

    def pop(self, name: str) -> None:
        """Leaves `name` and every range opened inside it (none if it is not open)."""
        if not any(n == name for n, _ in self._open):
            return
        while self._open:
            n, r = self._open.pop()
            r.__exit__(None, None, None)
            if n == name:
                return

    def swap(self, name: str) -> None:
        """Leaves `name` if open, and opens it again (one range per layer, per step)."""
        self.pop(name)
        self.push(name)

    def close(self) -> None:
        while self._open:
            self._open.pop()[1].__exit__(None, None, None)


class PrefillProgress:
    """A line on stderr through a long prefill: layer i of N issued, tokens a second so far.
    Redrawn at most 5 times a second; ended by a newline when prefill is over."""

    def __init__(self, layers: int, tokens: int, out: TextIO | None = None) -> None:
        self.layers, self.tokens = layers, tokens
        self.out = out if out is not None else sys.stderr
        self.t0 = time.perf_counter()
        self._drawn = 0.0
        self._open = False

    @staticmethod
    def wanted(setting: str | bool, tokens: int, out: TextIO | None = None) -> bool:
        """RevivaConfig.progress: True, False, or "auto": a terminal on stderr, a prompt of
        16k tokens or more, and REVIVA_PROGRESS not off."""
        if setting is True or setting is False:
            return setting
        if not switches.progress():
            return False
        stream = out if out is not None else sys.stderr
        return tokens >= 16384 and bool(getattr(stream, "isatty", lambda: False)())

    def layer(self, i: int) -> None:
        now = time.perf_counter()
        if now - self._drawn < 0.2 and i + 1 < self.layers:
            return
        self._drawn = now
        done = self.tokens * (i + 1) / self.layers
        rate = done / max(now - self.t0, 1e-9)
        self.out.write(
            f"\rreviva: prefill layer {i + 1}/{self.layers}, {self.tokens} tokens, "
            f"{rate:,.0f} tok/s, {now - self.t0:.1f} s"
        )
        self.out.flush()
        self._open = True

    def close(self) -> None:
        if self._open:
            self.out.write(f" (prefill issued in {time.perf_counter() - self.t0:.1f} s)\n")
            self.out.flush()
            self._open = False


def span(name: str, track: str, start_ms: float, end_ms: float, **args: Any) -> dict[str, Any]:
    return {
        "name": name,
        "ph": "X",
        "pid": 1,
        "tid": track,  # (chrome_trace numbers the tracks)
        "ts": round(start_ms * 1e3, 3),
        "dur": round(max(end_ms - start_ms, 0.0) * 1e3, 3),
        "args": args,
    }


def store_spans(events: Iterable[dict[str, Any]], what: str, offset_ms: float) -> list[dict]:
    """The core's timeline events of one store (what: "K/V" or "weights") as trace spans,
    shifted by offset_ms (its origin from the call's start)."""
    out = []
    for e in events:
        kind = e["kind"]
        start, end = e["start_s"] * 1e3 + offset_ms, e["end_s"] * 1e3 + offset_ms
        if kind in _KIND_TRACK:
            track = f"{what} {_KIND_TRACK[kind]}"
            out.append(span(f"{what} block {e['block']}", track, start, end, bytes=e["bytes"]))
        elif kind == "compute_stall":
            out.append(span(f"waits for {what} block {e['block']}", "stalls", start, end))
        elif kind == "host_wait":
            out.append(span(f"host waits for {what} copies", "host waits", start, end))
    return out


def chrome_trace(spans: list[dict[str, Any]], metadata: dict[str, Any]) -> dict[str, Any]:
    """The trace file's object: the tracks named and numbered, the spans in time order, and
    metadata."""
    used = {s["tid"] for s in spans}
    tids = {name: i + 1 for i, name in enumerate(t for t in _TRACKS if t in used)}
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "reviva"}}
    ]
    for name, tid in tids.items():
        events.append(
            {"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": name}}
        )
        events.append(
            {
                "name": "thread_sort_index",
                "ph": "M",
                "pid": 1,
                "tid": tid,
                "args": {"sort_index": tid},
            }
        )
    for s in sorted(spans, key=lambda s: (s["ts"], _TRACKS.index(s["tid"]))):
        events.append({**s, "tid": tids[s["tid"]]})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": metadata}


def write_trace(path: str | os.PathLike[str], trace: dict[str, Any] | None, what: str) -> str:
    if trace is None:
        raise RuntimeError(f"{what}.trace: nothing to write yet: trace() writes the last call")
    path = os.fspath(path)
    with open(path, "w") as f:
        json.dump(trace, f)
    return path
