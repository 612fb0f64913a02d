"""Where a 64k generate on a 24 GB card spends its time, call 1 against call 2 (a diagnostic).

    python benchmarks/diagnostics/diag_phases.py [--out DIR]

Card mode as bench_generate runs it (a ballast leaves 24 GB, default allocator), Llama-3-8B
shape, bf16, 64k prompt, 32 new tokens, RevivaConfig(vram_budget="24GB"), two calls in one
process. CUDA events at each decoder layer's start and end give, per call: the time before layer
0 starts (planning, pinning), each layer's prefill time, and for each decode step its span (layer
0's start to layer 31's end) and the gap to the next step, and each layer's mean decode time (the
streamed ones wait for their copies); with the layers resident in prefill and in decode and the
manager's statistics. With the store's timeline (every copy and every wait of compute for one,
aligned to the same clock), the first decode steps are taken apart: per step the copy stream's
busy time, idle time and bytes within the step, the promotions' host time, and each layer's time.
Writes phases.json to --out (default: the current folder).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

import reviva
import reviva.generate.call

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from card import CallTimer, CardSampler, prepare_device  # noqa: E402
from generate_model import build_model  # noqa: E402

LAYERS = 32
FIRST_STEPS = 12  # decode steps taken apart layer by layer


def copy_per_step(
    timeline: list[dict[str, Any]], offset_ms: float, decode: list[dict[str, dict[int, float]]]
) -> list[dict[str, Any]]:
    """Per decode step (layer 0's start to the next step's start): the H2D stream's busy and idle
    ms in it, the bytes of the copies that ended in it, compute's waits, and for the first steps
    each copy (block, start, end, MB) on this clock."""
    copies = sorted(
        (e["start_s"] * 1e3 + offset_ms, e["end_s"] * 1e3 + offset_ms, e["bytes"], e["block"])
        for e in timeline
        if e["kind"] == "copy_to_device"
    )
    stalls = [
        (e["start_s"] * 1e3 + offset_ms, e["end_s"] * 1e3 + offset_ms)
        for e in timeline
        if e["kind"] == "compute_stall"
    ]
    out = []
    for k, f in enumerate(decode):
        a = f["pre"][0]
        b = decode[k + 1]["pre"][0] if k + 1 < len(decode) else f["post"][LAYERS - 1]
        busy = 0.0
        cursor = a
        for s, e, _, _ in copies:  # copies of one stream do not overlap
            s, e = max(s, cursor), min(e, b)
            if e > s:
                busy += e - s
                cursor = e
        row: dict[str, Any] = {
            "span_ms": round(b - a, 2),
            "h2d_busy_ms": round(busy, 2),
            "h2d_idle_ms": round(b - a - busy, 2),
            "h2d_mb": round(sum(n for _, e, n, _ in copies if a <= e < b) / 1e6, 1),
            "stall_ms": round(sum(min(e, b) - max(s, a) for s, e in stalls if e > a and s < b), 2),
        }
        if k < 3:
            row["copies"] = [
                [blk, round(s, 2), round(e, 2), round(n / 1e6, 1)]
                for s, e, n, blk in copies
                if a - 60 <= s < b
            ]
            row["layer_pre_ms"] = [round(f["pre"][i], 2) for i in range(LAYERS)]
        out.append(row)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".")
    parser.add_argument("--calls", type=int, default=4, help="1 to 4 (see below)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    _prepared, _ballast, probe, _card = prepare_device(24 * 10**9, True)
    model = build_model(LAYERS)
    manager = reviva.RevivaManager(model, reviva.RevivaConfig(vram_budget="24GB"))
    manager._timeline_capacity = 1 << 16
    # The store's timeline counts from its construction (its origin event is synchronized
    # there): an event recorded right after, on an idle device, gives the offset to this clock.
    built: list[torch.cuda.Event] = []
    cache_cls = reviva.generate.call.RevivaCache

    class TimedCache(cache_cls):  # type: ignore[misc, valid-type]
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            torch.cuda.synchronize()
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            built.append(e)

    reviva.generate.call.RevivaCache = TimedCache
    promote = manager._promote_after_prefill
    host: dict[str, float] = {}

    def timed_promote() -> None:
        t = time.perf_counter()
        promote()
        host["promote_ms"] = (time.perf_counter() - t) * 1e3

    manager._promote_after_prefill = timed_promote
    events: list[tuple[str, int, torch.cuda.Event]] = []
    host_times: list[float] = []
    seen: dict[str, Any] = {}

    def record(kind: str, i: int) -> None:
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        events.append((kind, i, e))

    def pre(i: int) -> Any:
        def hook(module: Any, args: Any) -> None:
            if i == 0 and manager._plan is not None and "prefill" not in seen:
                seen["prefill"] = list(manager._plan.resident_layers)
            if i == 0 and manager._cache is not None:
                store = manager._cache.store
                seen["decode"] = [j for j in range(LAYERS) if store.resident(j)]
            record("pre", i)
            if i == 0:
                host_times.append(time.perf_counter())
            issued = seen.setdefault("prefill_host", [])
            if len(issued) < LAYERS:
                issued.append(time.perf_counter())

        return hook

    def post(i: int) -> Any:
        def hook(module: Any, args: Any, output: Any) -> None:
            record("post", i)

        return hook

    for i, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(pre(i))
        layer.register_forward_hook(post(i))
    gen = torch.Generator(device="cuda").manual_seed(65536)
    ids = torch.randint(1, model.config.vocab_size, (1, 65536), device="cuda", generator=gen)
    out: dict[int, dict[str, Any]] = {}
    # Calls 3 and 4 as bench_generate makes them: 3 with its streamer (card.CallTimer), 4 with
    # that streamer and its card sampler (a thread polling free memory every 2 ms).
    for call in range(1, min(max(args.calls, 1), 4) + 1):
        events.clear()
        seen.clear()
        built.clear()
        host.clear()
        host_times.clear()
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        timer = CallTimer(lambda: torch.cuda.current_stream().synchronize()) if call >= 3 else None
        sampler = CardSampler(probe, 0.002 if call == 4 else 0.0)
        with sampler:
            manager.generate(ids, max_new_tokens=32, do_sample=False, streamer=timer)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        forwards: list[dict[str, dict[int, float]]] = []
        for kind, i, e in events:
            if kind == "pre" and i == 0:
                forwards.append({"pre": {}, "post": {}})
            forwards[-1][kind][i] = start.elapsed_time(e)
        prefill, decode = forwards[0], forwards[1:]
        steady = decode[1:] or decode

        def mean(values: list[float]) -> float:
            return round(sum(values) / len(values), 3)

        out[call] = {
            "wall_s": wall,
            "before_layer0_ms": prefill["pre"][0],
            "prefill_layer_ms": [
                round(prefill["post"][i] - prefill["pre"][i], 1) for i in range(LAYERS)
            ],
            "decode_span_ms": [round(f["post"][LAYERS - 1] - f["pre"][0], 2) for f in decode],
            "decode_gap_ms": [
                round(decode[k + 1]["pre"][0] - decode[k]["post"][LAYERS - 1], 2)
                for k in range(len(decode) - 1)
            ],
            "decode_layer_ms": [
                mean([f["post"][i] - f["pre"][i] for f in steady]) for i in range(LAYERS)
            ],
            "first_steps_layer_ms": [
                [round(f["post"][i] - f["pre"][i], 2) for i in range(LAYERS)]
                for f in decode[:FIRST_STEPS]
            ],
            "promote_host_ms": host.get("promote_ms"),
            # How far the host ran ahead of the device at each step's layer 0 (ms): near 0, the
            # host is what the device waits for.
            "host_lead_ms": [
                round(f["pre"][0] - (t - t0) * 1e3, 2)
                for f, t in zip(decode, host_times[1:], strict=False)
            ],
            "copy_per_step": copy_per_step(
                manager._last_timeline, start.elapsed_time(built[0]) if built else 0.0, decode
            ),
            # When the host issued each layer of prefill (ms since the call began), beside when
            # the device started it (prefill_start_ms): how far ahead the host ran.
            "prefill_host_ms": [round((t - t0) * 1e3, 1) for t in seen.get("prefill_host", [])],
            "prefill_start_ms": [round(prefill["pre"][i], 1) for i in range(LAYERS)],
            "prefill_resident": seen.get("prefill"),
            "decode_resident": seen.get("decode"),
            "stats": {
                k: v for k, v in manager.get_memory_stats().items() if not isinstance(v, dict)
            },
        }
        brief = {k: v for k, v in out[call].items() if k not in ("stats", "copy_per_step")}
        print(json.dumps(brief)[:3000], flush=True)
        st = out[call]["stats"]
        print(
            f"call {call}: prefill {st['prefill_s']:.3f} s, decode {st['decode_s']:.4f} s "
            f"({st['decode_tok_s']:.2f} tok/s), graphs {st.get('decode_graphs')} captures "
            f"{st.get('decode_graph_captures')} in "
            f"{st.get('decode_graph_capture_s', 0) * 1e3:.1f} ms",
            flush=True,
        )
        for k, row in enumerate(out[call]["copy_per_step"][:4]):
            print(f"  step {k}: " + json.dumps({x: y for x, y in row.items() if x != "copies"}))
    path = Path(args.out) / "phases.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
