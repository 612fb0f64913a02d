"""Where a 64k generate on a 24 GB card spends its time, call 1 against call 2 (a diagnostic).

    python benchmarks/diag_phases.py [--out DIR]

Card mode as bench_generate runs it (a ballast leaves 24 GB, default allocator), Llama-3-8B
shape, bf16, 64k prompt, 32 new tokens, RevivaConfig(vram_budget="24GB"), two calls in one
process. CUDA events at each decoder layer's start and end give, per call: the time before layer
0 starts (planning, pinning), each layer's prefill time, and for each decode step its span (layer
0's start to layer 31's end) and the gap to the next step, and each layer's mean decode time (the
streamed ones wait for their copies); with the layers resident in prefill and in decode and the
manager's statistics. Writes phases.json to --out (default: the current folder).
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_generate import build_model  # noqa: E402
from card import prepare_device  # noqa: E402

LAYERS = 32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    _prepared, _ballast, _probe, _card = prepare_device(24 * 10**9, True)
    model = build_model(LAYERS)
    manager = reviva.RevivaManager(model, reviva.RevivaConfig(vram_budget="24GB"))
    events: list[tuple[str, int, torch.cuda.Event]] = []
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
    for call in (1, 2):
        events.clear()
        seen.clear()
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        manager.generate(ids, max_new_tokens=32, do_sample=False)
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
            "prefill_resident": seen.get("prefill"),
            "decode_resident": seen.get("decode"),
            "stats": {
                k: v for k, v in manager.get_memory_stats().items() if not isinstance(v, dict)
            },
        }
        print(json.dumps({k: v for k, v in out[call].items() if k != "stats"})[:3000], flush=True)
    path = Path(args.out) / "phases.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
