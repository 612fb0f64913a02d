"""The host's share of a decode step (a diagnostic): how long the host takes to issue one decoder
layer of a decode step, plain HF against Reviva (all layers resident, and some streamed).

    python benchmarks/diagnostics/diag_host.py [--out DIR] [--profile]

Reviva with CUDA graphs for decode (Note [Decode graphs]) and without. A Llama-layout model of
32 layers, small enough (hidden 1024) that the device finishes each
layer's kernels before the host has issued the next: the decode time per layer is then the
host's. Also the process's CPU time against the wall time in decode (above 1.0: threads of the
process besides the one issuing work were busy), and with --profile the functions where the
host spends a streamed call's decode (cProfile, by own time). Writes host.json to --out.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import reviva

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import environment  # noqa: E402

LAYERS, NEW = 32, 64
CUDA = torch.cuda.is_available()
PROMPT = 4096 if CUDA else 256  # (without a GPU: a smoke test of the script, fp32 on the CPU)
DEVICE = "cuda" if CUDA else "cpu"


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def build() -> Any:
    cfg = LlamaConfig(
        hidden_size=1024,
        intermediate_size=3584,
        num_hidden_layers=LAYERS,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=32000,
        max_position_embeddings=PROMPT + NEW,
        attn_implementation="sdpa",
    )
    cfg.pad_token_id, cfg.eos_token_id = 0, None
    torch.manual_seed(0)
    with torch.device(DEVICE):
        dtype = torch.bfloat16 if CUDA else torch.float32
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()


def cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def timed(run: Any) -> dict[str, float]:
    """Wall and process CPU seconds of one call, after the device is idle."""
    sync()
    w, c = time.perf_counter(), cpu_s()
    run()
    sync()
    wall, cpu = time.perf_counter() - w, cpu_s() - c
    return {"wall_s": wall, "cpu_s": cpu, "cpu_per_wall": cpu / wall}


def pieces(manager: Any, call: Any) -> dict[str, float]:
    """Mean host microseconds of the cache's calls in a streamed call's decode (its own methods,
    timed one by one)."""
    cls = reviva.cache.kv_cache.RevivaCache
    acc: dict[str, list[float]] = {}

    def clock(name: str, t: float) -> float:
        now = time.perf_counter()
        acc.setdefault(name, []).append((now - t) * 1e6)
        return now

    def timed_method(name: str, method: Any) -> Any:
        def run(self: Any, *a: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            r = method(self, *a, **kw)
            clock(name, t)
            return r

        return run

    names = ("write", "acquire", "release", "view", "get_seq_length")
    saved = {k: getattr(cls, k) for k in names}
    for k in names:
        setattr(cls, k, timed_method(k, saved[k]))
    try:
        call(NEW)()
        sync()
    finally:
        for k, v in saved.items():
            setattr(cls, k, v)
    return {k: round(sum(v) / len(v), 2) for k, v in acc.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    model = build()
    ids = torch.randint(1, 32000, (1, PROMPT), device=DEVICE)
    out: dict[str, Any] = {
        "environment": environment(CUDA),
        "threads_at_start": len(os.listdir("/proc/self/task")),
    }

    def hf(n: int) -> Any:
        return lambda: model.generate(ids, max_new_tokens=n, do_sample=False)

    # Decode per layer: a 64-token call less a 1-token call (prefill alone), over 63 steps.
    def streamed(**config: Any) -> Any:
        budget = reviva.RevivaManager(model).budget_for(1, PROMPT, NEW, resident_layers=8)
        manager = reviva.RevivaManager(model, reviva.RevivaConfig(vram_budget=budget, **config))
        # The layers streamed in prefill stay streamed in decode: the diagnostic is about a
        # streamed layer's host work, which promotions would make rare at this size.
        manager._promote_after_prefill = lambda: None
        return manager

    for name, make in (
        ("hf", lambda: None),
        ("reviva_resident", lambda: reviva.RevivaManager(model)),
        (
            "reviva_resident_eager",
            lambda: reviva.RevivaManager(model, reviva.RevivaConfig(cuda_graphs=False)),
        ),
        ("reviva_streamed", streamed),
        ("reviva_streamed_eager", lambda: streamed(cuda_graphs=False)),
    ):
        manager = make()

        def call(n: int, m: Any = manager) -> Any:
            if m is None:
                return hf(n)
            return lambda: m.generate(ids, max_new_tokens=n, do_sample=False)

        rows = []
        for _ in range(3):
            one, full = timed(call(1)), timed(call(NEW))
            per_layer = (full["wall_s"] - one["wall_s"]) / (NEW - 1) / LAYERS
            rows.append(
                {
                    "host_ms_per_layer": round(per_layer * 1e3, 4),
                    "decode_cpu_per_wall": round(
                        (full["cpu_s"] - one["cpu_s"]) / max(full["wall_s"] - one["wall_s"], 1e-9),
                        3,
                    ),
                }
            )
        entry: dict[str, Any] = {"calls": rows}
        if manager is not None:
            st = manager.get_memory_stats()
            entry["streamed_layers"] = st["streamed_layers"]
            entry["own_decode_attention"] = st["own_decode_attention"]
            entry["decode_graphs"] = st["decode_graphs"]
            entry["decode_graph_replays"] = st["decode_graph_replays"]
        out[name] = entry
        print(name, json.dumps(entry), flush=True)
        if name == "reviva_streamed":
            out["pieces"] = pieces(manager, call)
            print("pieces", json.dumps(out["pieces"]), flush=True)
        if args.profile and name != "hf":
            prof = cProfile.Profile()
            prof.enable()
            call(NEW)()
            sync()
            prof.disable()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(35)
            entry["profile"] = s.getvalue()
            print(s.getvalue(), flush=True)
    out["threads_at_end"] = len(os.listdir("/proc/self/task"))
    best = {
        k: min(c["host_ms_per_layer"] for c in v["calls"])
        for k, v in out.items()
        if isinstance(v, dict) and "calls" in v
    }
    # What the diagnostic shows, as checks: graphs issue a layer in under half HF's host time.
    out["checks"] = {
        name: {
            "host_ms_per_layer": best[name],
            "hf_host_ms_per_layer": best["hf"],
            "ok": best[name] <= 0.5 * best["hf"],
        }
        for name in ("reviva_resident", "reviva_streamed")
        if name in best and "hf" in best
    }
    path = Path(args.out) / "host.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
