"""The lifetime of Reviva's generate calls on one RevivaManager: many calls in a row leave nothing
behind, and an interrupted call leaves the model, the device and the next call as they were
(DESIGN.md, "Lifetime of a call").

GPU: a small Llama-shaped model (hidden 512, 8 layers, 8 heads of 64, 8 K/V heads, MLP 1408, vocab
32000, random weights, the head scaled by 8 so that greedy argmax is robust to last-bit
differences, as the tests do), an 8k prompt and 16 new tokens; one process, torch's allocator at
its defaults (PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF removed by re-executing without them).
The vram_budget is chosen so that layers are streamed: from RevivaManager.plan(), the weights, the
working sets and the K/V of half the layers in decode (at least one slot in prefill), then checked
by a first call and lowered a layer's K/V at a time until the call's stats report streamed layers
(every attempt is recorded). Without a GPU (or with --cpu): a tiny fp32 model on the CPU (host
backend), a 256-token prompt; device figures are then absent and their criteria not applied.

    python benchmarks/bench_lifetime.py [--calls 100] [--gc-calls 10] [--out DIR] [--cpu]

Checks (the JSON's `checks`):
    repeat_100  --calls (100) calls of the same generate (bf16 on the GPU) on one manager, after
                the call(s) that chose its budget, gc enabled as a user has it: all complete,
                with streamed layers; after every call torch's allocated and reserved
                bytes, the device's used bytes (mem_get_info), Reviva's pinned/host figures (every
                get_memory_stats() key naming 'host' or 'pinned': whatever exists) and the RSS
                (/proc/self/statm) are recorded; from call 5 to the last, the device figures and
                the pinned ones stay within 1 MiB and the RSS within 1%. Then --gc-calls more
                calls under gc.disable(): after each, no RevivaCache alive (gc.get_objects()) and
                the weak references to the call's RevivaCache and its KVStore (taken by a forward
                pre-hook with kwargs on layer 0, which sees past_key_values) dead.
    interrupt   per dtype (fp32 and bf16 on the GPU), three interrupted calls after two clean
                ones: KeyboardInterrupt raised by a streamer's put() at the 4th new token;
                torch.OutOfMemoryError("injected") raised by a forward pre-hook of the middle
                decoder layer at its first call (prefill) and at its 4th (decode). After each: the
                exception reached the caller as raised; every module's __dict__ as before (a
                'forward' entry only where there was one, the same object, the same keys);
                torch's allocated bytes equal to before the call and the memory outside torch's
                allocator (mem_get_info's used minus torch's reserved: Reviva's arena) within
                1 MiB of it, measured at once after the exception (no gc.collect; the figures
                after one are recorded too; torch's cache of freed blocks and mem_get_info's
                free are recorded, not judged: torch keeps or gives back its cache); the
                next call completes with plain HF's greedy tokens (model.generate without Reviva)
                in fp32, and in bf16 with Reviva's own uninterrupted tokens (a different decode
                attention kernel; equality with HF's is recorded beside). The same interruptions
                of plain HF are recorded as a control (not part of the check).
Reproduce: python benchmarks/bench_lifetime.py --out $OUT (about 2 minutes on the H200, estimated:
model builds in seconds, ~0.2 s a call).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import weakref
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from card import ALLOC_CONF_VARS, error_fields, rss_bytes, say  # noqa: E402
from common import environment, print_table, result_path, write_json  # noqa: E402

GPU_SHAPE = dict(
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=8,
    vocab_size=32000,
    max_position_embeddings=16384,
)
CPU_SHAPE = dict(
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=211,
    max_position_embeddings=2048,
)
MiB = 1 << 20
FLAT_FROM_CALL = 5  # 1-based: figures after calls 5..N must be flat
DEVICE_TOLERANCE = MiB
RSS_TOLERANCE = 0.01


def build_model(shape: dict, dtype: Any, device: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(**shape, attn_implementation="sdpa")
    cfg.pad_token_id, cfg.eos_token_id = 0, None
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    with torch.no_grad():  # near-uniform random logits made peaked: argmax robust (as the tests)
        model.lm_head.weight.mul_(8.0)
    return model


# --- what is measured around a call ---------------------------------------------------------------


def device_memory(cuda: bool) -> dict[str, int | None]:
    import torch

    if not cuda:
        return {"allocated": None, "reserved": None, "free": None, "used": None}
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return {
        "allocated": torch.cuda.memory_allocated(),
        "reserved": torch.cuda.memory_reserved(),
        "free": free,
        "used": total - free,
    }


def pinned_figures(stats: dict[str, Any]) -> dict[str, Any]:
    """Every get_memory_stats() figure of host or pinned memory held (whatever this version has;
    not the bytes_to_* traffic counters)."""
    return {
        k: v
        for k, v in stats.items()
        if ("host" in k or "pinned" in k)
        and not k.startswith("bytes_to")
        and isinstance(v, int | float)
        and not isinstance(v, bool)
    }


def pinned_in_bytes(key: str, value: float) -> float:
    """Reviva's stats give sizes in MiB where the key ends in _mb, else in bytes."""
    return value * MiB if key.endswith("_mb") else value


def module_snapshot(model: Any) -> dict[str, tuple[bool, int | None, tuple[str, ...]]]:
    """Per module: whether its __dict__ holds a 'forward', which object, and its keys."""
    out = {}
    for name, m in model.named_modules():
        fwd = m.__dict__.get("forward")
        keys = tuple(sorted(m.__dict__))
        out[name] = ("forward" in m.__dict__, id(fwd) if fwd is not None else None, keys)
    return out


def snapshot_differences(before: dict, after: dict) -> list[str]:
    diffs = []
    for name in sorted(set(before) | set(after)):
        a, b = before.get(name), after.get(name)
        if a == b:
            continue
        if a is None or b is None:
            diffs.append(f"{name or '<model>'}: module {'added' if a is None else 'removed'}")
            continue
        if a[0] != b[0] or a[1] != b[1]:
            diffs.append(f"{name or '<model>'}: forward in __dict__ {a[0]} -> {b[0]}")
        if a[2] != b[2]:
            diffs.append(
                f"{name or '<model>'}: __dict__ keys +{sorted(set(b[2]) - set(a[2]))} "
                f"-{sorted(set(a[2]) - set(b[2]))}"
            )
    return diffs


class CacheWatch:
    """Weak references to the RevivaCache of each call, and to its KVStore, taken by a forward
    pre-hook (with kwargs) on the first decoder layer, which is handed past_key_values."""

    def __init__(self, model: Any) -> None:
        try:
            from reviva import RevivaCache

            self.cache_type: Any = RevivaCache
        except ImportError:
            self.cache_type = None
        self.caches: list[weakref.ReferenceType] = []
        self.stores: list[weakref.ReferenceType] = []
        self.store_note: str | None = None
        layer = model.model.layers[0]
        self.handle = layer.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _is_cache(self, obj: Any) -> bool:
        # type(), not isinstance: gc.get_objects() holds objects whose __class__ property warns
        if self.cache_type is not None:
            return issubclass(type(obj), self.cache_type)
        return type(obj).__name__ == "RevivaCache"

    def _hook(self, module: Any, args: Any, kwargs: dict) -> None:
        cache = kwargs.get("past_key_values")
        if cache is None or not self._is_cache(cache):
            return None
        if any(r() is cache for r in self.caches):
            return None
        self.caches.append(weakref.ref(cache))
        store = getattr(cache, "store", None)
        if store is not None:
            try:
                self.stores.append(weakref.ref(store))
            except TypeError as e:
                self.store_note = f"KVStore takes no weak reference: {e}"
        return None

    def start_call(self) -> None:
        self.caches, self.stores = [], []

    def alive(self) -> dict[str, Any]:
        return {
            "caches_seen": len(self.caches),
            "caches_alive": sum(r() is not None for r in self.caches),
            "stores_seen": len(self.stores),
            "stores_alive": sum(r() is not None for r in self.stores),
            "store_note": self.store_note,
        }

    def live_caches_in_gc(self) -> int:
        return sum(1 for o in gc.get_objects() if self._is_cache(o))

    def remove(self) -> None:
        self.handle.remove()


def spread(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return (max(vals) - min(vals)) if vals else None


# --- choosing a budget that streams layers --------------------------------------------------------


def choose_budget(
    model: Any,
    ids: Any,
    new_tokens: int,
    cuda: bool,
    attempts: list[dict],
    residual: str = "auto",
) -> tuple[Any, int]:
    """A manager whose budget streams layers in decode, and the budget (attempts recorded)."""
    import reviva

    prompt = ids.shape[1]
    n = model.config.num_hidden_layers
    budget = None
    layer_kv = None
    manager = reviva.RevivaManager(model, reviva.RevivaConfig(prefill_residual=residual))
    try:
        from reviva.plan.memory_state import device_state
        from reviva.plan.planner import smallest_budget

        # The planner's own inverse: the smallest budget whose plan holds half the layers'
        # K/V on the device (resident layers and staging slots), so that the rest streams.
        budget = smallest_budget(
            manager.layout,
            manager.config,
            device_state(manager.layout, manager.arena),
            1,
            prompt,
            new_tokens,
            lambda p: len(p.resident_layers) + p.slots >= max(1, n // 2),
        )
        layer_kv = manager.plan(1, prompt, new_tokens).layer_kv_bytes
        attempts.append({"from": "planner.smallest_budget", "budget": budget})
    except Exception as e:  # the planner API changed: a rougher start below
        attempts.append({"from": "planner.smallest_budget", **error_fields(e)})
        budget = None
    if budget is None:
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        head_dim = model.config.hidden_size // model.config.num_attention_heads
        layer_kv = (2 * (prompt + new_tokens) * model.config.num_key_value_heads * head_dim) * next(
            model.parameters()
        ).element_size()
        budget = weights + 96 * MiB + (n // 2) * layer_kv
        attempts.append({"from": "weights + 96 MiB + half the K/V", "budget": budget})
    assert layer_kv is not None
    for _ in range(2 * n):
        config = reviva.RevivaConfig(vram_budget=budget, prefill_residual=residual)
        manager = reviva.RevivaManager(model, config)
        rec: dict[str, Any] = {"budget": budget}
        try:
            manager.generate(ids, max_new_tokens=new_tokens, do_sample=False)
            st = manager.get_memory_stats()
            rec.update(
                streamed_layers=st.get("streamed_layers"),
                resident_layers_in_prefill=st.get("resident_layers_in_prefill"),
            )
        except Exception as e:
            rec.update(error_fields(e))
        attempts.append(rec)
        if rec.get("error") and rec.get("oom"):
            budget += layer_kv // 2  # too small after all: a little more
            continue
        if rec.get("error"):
            raise RuntimeError(f"generate failed while choosing a budget: {rec['error']}")
        if (rec.get("streamed_layers") or 0) > 0:
            return manager, budget
        budget -= layer_kv
    raise RuntimeError(f"no budget streamed a layer: {attempts}")


# --- repeat_100 -----------------------------------------------------------------------------------


def repeat(
    manager: Any,
    model: Any,
    ids: Any,
    new_tokens: int,
    calls: int,
    gc_calls: int,
    cuda: bool,
    hf_tokens: list[int],
) -> dict[str, Any]:
    watch = CacheWatch(model)
    prompt = ids.shape[1]
    records: list[dict[str, Any]] = []
    first_tokens = None
    try:
        for k in range(1, calls + 1):
            watch.start_call()
            t0 = time.perf_counter()
            rec: dict[str, Any] = {"call": k, "gc": "enabled"}
            try:
                out = manager.generate(ids, max_new_tokens=new_tokens, do_sample=False)
                tokens = out[0, prompt:].tolist()
                del out
                rec["completed"] = len(tokens) == new_tokens
                if first_tokens is None:
                    first_tokens = tokens
                rec["same_tokens_as_call_1"] = tokens == first_tokens
            except Exception as e:
                rec.update(error_fields(e), completed=False)
            rec["wall_s"] = time.perf_counter() - t0
            st = manager.get_memory_stats()
            rec.update(
                streamed_layers=st.get("streamed_layers"),
                resident_layers_in_prefill=st.get("resident_layers_in_prefill"),
                prefill_residual=st.get("prefill_residual"),
                device=device_memory(cuda),
                pinned=pinned_figures(st),
                rss=rss_bytes(),
                **watch.alive(),
            )
            records.append(rec)
            if k in (1, 2, 5) or k % 25 == 0:
                d = rec["device"]
                say(
                    f"  call {k}: {'ok' if rec['completed'] else rec.get('error')}, "
                    f"{rec['wall_s']:.2f} s, allocated {d['allocated']}, used {d['used']}, "
                    f"rss {rec['rss']}, pinned {rec['pinned']}, caches alive {rec['caches_alive']}"
                )
        gc.collect()
        gc.disable()
        try:
            for k in range(calls + 1, calls + gc_calls + 1):
                watch.start_call()
                rec = {"call": k, "gc": "disabled"}
                try:
                    out = manager.generate(ids, max_new_tokens=new_tokens, do_sample=False)
                    rec["completed"] = out.shape[1] == prompt + new_tokens
                    del out
                except Exception as e:
                    rec.update(error_fields(e), completed=False)
                rec.update(
                    device=device_memory(cuda),
                    rss=rss_bytes(),
                    revivacaches_in_gc=watch.live_caches_in_gc(),
                    **watch.alive(),
                )
                records.append(rec)
        finally:
            gc.enable()
    finally:
        watch.remove()

    main = [r for r in records if r["gc"] == "enabled"]
    window = main[FLAT_FROM_CALL - 1 :]
    flat: dict[str, Any] = {}
    for key in ("allocated", "reserved", "used"):
        s = spread([r["device"][key] for r in window])
        flat[f"device_{key}_spread_bytes"] = s
        flat[f"device_{key}_ok"] = s is None or s <= DEVICE_TOLERANCE
    rss_vals = [r["rss"] for r in window]
    flat["rss_spread_bytes"] = spread(rss_vals)
    flat["rss_ok"] = bool(rss_vals) and spread(rss_vals) <= RSS_TOLERANCE * min(rss_vals)
    pinned_keys = sorted({k for r in window for k in r["pinned"]})
    flat["pinned_keys_found"] = pinned_keys
    for key in pinned_keys:
        vals = [pinned_in_bytes(key, r["pinned"][key]) for r in window if key in r["pinned"]]
        flat[f"pinned_{key}_spread_bytes"] = spread(vals)
        flat[f"pinned_{key}_ok"] = spread(vals) <= DEVICE_TOLERANCE
    gc_rows = [r for r in records if r["gc"] == "disabled"]
    survivors = {
        "calls": len(gc_rows),
        "revivacaches_in_gc_after_calls": [r["revivacaches_in_gc"] for r in gc_rows],
        "caches_alive_after_calls": [r["caches_alive"] for r in gc_rows],
        "stores_alive_after_calls": [r["stores_alive"] for r in gc_rows],
        "caches_seen": [r["caches_seen"] for r in gc_rows],
        "stores_seen": [r["stores_seen"] for r in gc_rows],
        "store_note": gc_rows[-1]["store_note"] if gc_rows else None,
    }
    survivors["ok"] = bool(gc_rows) and all(
        r.get("completed")
        and r["revivacaches_in_gc"] == 0
        and r["caches_alive"] == 0
        and r["stores_alive"] == 0
        and r["caches_seen"] == 1
        for r in gc_rows
    )
    all_ok = all(r.get("completed") for r in main) and len(main) == calls
    streamed = all((r.get("streamed_layers") or 0) > 0 for r in main)
    ok_flags = [v for k, v in flat.items() if k.endswith("_ok")]
    return {
        "calls": calls,
        "all_completed": all_ok,
        "streamed_in_every_call": streamed,
        "same_tokens_every_call": all(r.get("same_tokens_as_call_1") for r in main),
        "tokens_equal_plain_hf": first_tokens == hf_tokens,
        "flat_from_call": FLAT_FROM_CALL,
        "flat": flat,
        "gc_disabled": survivors,
        "caches_alive_after_calls_gc_enabled": [r["caches_alive"] for r in main],
        "device_checked": cuda,
        "pass": bool(all_ok and streamed and all(ok_flags) and survivors["ok"]),
        "records": records,
    }


# --- interrupt ------------------------------------------------------------------------------------


def _interrupting_streamer(at_token: int) -> Any:
    from transformers.generation.streamers import BaseStreamer

    class InterruptingStreamer(BaseStreamer):
        """Raises KeyboardInterrupt from put() at the `at_token`-th new token (the prompt is
        put first)."""

        def __init__(self) -> None:
            self.puts = 0

        def put(self, value: Any) -> None:
            self.puts += 1
            if self.puts == at_token + 1:
                raise KeyboardInterrupt(f"interrupted at new token {at_token}")

        def end(self) -> None:
            pass

    return InterruptingStreamer()


def _oom_hook(at_call: int) -> Any:
    import torch

    state = {"calls": 0}

    def hook(module: Any, args: Any) -> None:
        state["calls"] += 1
        if state["calls"] == at_call:
            raise torch.OutOfMemoryError("injected")

    return hook


SCENARIOS = {
    # name: (what raises, expected exception type name, layer call or new token number)
    "keyboard_interrupt_decode": ("streamer", "KeyboardInterrupt", 4),
    "oom_prefill": ("layer", "OutOfMemoryError", 1),
    "oom_decode": ("layer", "OutOfMemoryError", 4),
}


def interrupted_call(
    generate: Any, model: Any, scenario: str, cuda: bool, watch: CacheWatch | None
) -> dict[str, Any]:
    """One interrupted call through `generate(streamer=...)`, and the state after it."""
    source, expected, at = SCENARIOS[scenario]
    layer = model.model.layers[len(model.model.layers) // 2]
    snap = module_snapshot(model)
    gc.collect()  # a clean "before": garbage of earlier calls must not be freed during this one
    before = device_memory(cuda)
    streamer, handle = None, None
    if source == "streamer":
        streamer = _interrupting_streamer(at)
    else:
        handle = layer.register_forward_pre_hook(_oom_hook(at))
    if watch is not None:
        watch.start_call()
    raised: dict[str, Any] = {"type": None}
    try:
        generate(streamer)
    except KeyboardInterrupt as e:
        raised = {"type": type(e).__name__, "message": str(e)[:300]}
    except Exception as e:
        raised = {
            "type": type(e).__name__,
            "message": str(e).splitlines()[0][:300] if str(e) else "",
        }
    finally:
        if handle is not None:
            handle.remove()
    after = device_memory(cuda)  # at once: no gc.collect, as a user's next line would see it
    alive = watch.alive() if watch is not None else None
    diffs = snapshot_differences(snap, module_snapshot(model))
    gc.collect()
    after_gc = device_memory(cuda)
    rec: dict[str, Any] = {
        "scenario": scenario,
        "expected": expected,
        "raised": raised,
        "raised_as_expected": raised["type"] == expected,
        "module_differences": diffs[:20],
        "restored": not diffs,
        "memory_before": before,
        "memory_after": after,
        "memory_after_gc_collect": after_gc,
        "cache_refs_after": alive,
    }
    if cuda:
        # What the call took: torch's tensors (allocated) and memory outside torch's allocator
        # (Reviva's arena: device used minus torch's reserved). Torch's cache of freed blocks
        # (reserved - allocated) is torch's to keep or give back, reported, not judged.
        def outside(m: dict[str, int]) -> int:
            return m["used"] - m["reserved"]

        rec["allocated_returned"] = after["allocated"] == before["allocated"]
        rec["outside_torch_returned"] = abs(outside(after) - outside(before)) <= DEVICE_TOLERANCE
        rec["free_within_1mib"] = abs(after["free"] - before["free"]) <= DEVICE_TOLERANCE
        rec["torch_cache_change"] = after["reserved"] - before["reserved"]
        rec["allocated_returned_after_gc"] = after_gc["allocated"] == before["allocated"]
        rec["free_within_1mib_after_gc"] = abs(after_gc["free"] - before["free"]) <= MiB
    return rec


def interrupt(
    model: Any,
    ids: Any,
    new_tokens: int,
    budget: int,
    cuda: bool,
    dtype_name: str,
    residual: str = "auto",
) -> dict[str, Any]:
    import torch

    import reviva

    prompt = ids.shape[1]
    kw = dict(max_new_tokens=new_tokens, do_sample=False)
    hf_tokens = model.generate(ids, **kw)[0, prompt:].tolist()
    config = reviva.RevivaConfig(vram_budget=budget, prefill_residual=residual)
    manager = reviva.RevivaManager(model, config)
    watch = CacheWatch(model)
    clean = []
    for _ in range(2):  # the steady state the interrupted calls start from
        clean.append(manager.generate(ids, **kw)[0, prompt:].tolist())
    st = manager.get_memory_stats()
    reviva_tokens = clean[-1]
    exact_reference = "plain HF" if dtype_name == "float32" else "Reviva uninterrupted"
    reference = hf_tokens if dtype_name == "float32" else reviva_tokens
    out: dict[str, Any] = {
        "dtype": dtype_name,
        "budget": budget,
        "streamed_layers": st.get("streamed_layers"),
        "resident_layers_in_prefill": st.get("resident_layers_in_prefill"),
        "reviva_clean_equal_plain_hf": reviva_tokens == hf_tokens,
        "clean_calls_equal": clean[0] == clean[1],
        "next_call_reference": exact_reference,
        "scenarios": [],
        "plain_hf_control": [],
    }
    for scenario in SCENARIOS:
        say(f"  {dtype_name} {scenario}")
        rec = interrupted_call(
            lambda s: manager.generate(ids, streamer=s, **kw), model, scenario, cuda, watch
        )
        try:
            nxt = manager.generate(ids, **kw)[0, prompt:].tolist()
            rec["next_call_completed"] = len(nxt) == new_tokens
            rec["next_tokens_equal_reference"] = nxt == reference
            rec["next_tokens_equal_plain_hf"] = nxt == hf_tokens
        except Exception as e:
            rec.update(next_call_completed=False, next_call_error=error_fields(e)["error"])
            rec["next_tokens_equal_reference"] = False
        rec["memory_after_next_call"] = device_memory(cuda)
        checks = [
            rec["raised_as_expected"],
            rec["restored"],
            rec["next_call_completed"],
            rec["next_tokens_equal_reference"],
        ]
        if cuda:
            checks += [rec["allocated_returned"], rec["outside_torch_returned"]]
        rec["ok"] = all(checks)
        out["scenarios"].append(rec)
        ctl = interrupted_call(
            lambda s: model.generate(ids, streamer=s, **kw), model, scenario, cuda, None
        )
        out["plain_hf_control"].append(ctl)
    watch.remove()
    manager = None
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
    out["pass"] = all(r["ok"] for r in out["scenarios"])
    return out


# --- entry ----------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--gc-calls", type=int, default=10)
    parser.add_argument("--prompt", type=int, default=None, help="default 8192 (CPU: 256)")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--cpu", action="store_true", help="the CPU fallback even with a GPU")
    parser.add_argument(
        "--interrupt-dtypes", default=None, help="default float32,bfloat16 (CPU: float32)"
    )
    parser.add_argument(
        "--prefill-residual",
        default="auto",
        choices=("auto", "device", "host"),
        help="RevivaConfig.prefill_residual of every manager (host: the prompt's hidden states "
        "in pinned host memory through prefill)",
    )
    parser.add_argument("--out", default=None)
    parser.add_argument("--name", default="lifetime")
    args = parser.parse_args()
    removed = {k: os.environ[k] for k in ALLOC_CONF_VARS if k in os.environ}
    if removed:  # torch's allocator at its defaults, as a user has it: a fresh process without
        env = {k: v for k, v in os.environ.items() if k not in ALLOC_CONF_VARS}
        env["REVIVA_BENCH_REMOVED_ALLOC_CONF"] = repr(removed)
        os.execve(sys.executable, [sys.executable, *sys.argv], env)

    import torch

    cuda = torch.cuda.is_available() and not args.cpu
    device = "cuda" if cuda else "cpu"
    shape = GPU_SHAPE if cuda else CPU_SHAPE
    prompt = args.prompt or (8192 if cuda else 256)
    dtypes = args.interrupt_dtypes or ("float32,bfloat16" if cuda else "float32")
    env = environment()
    path = result_path(args.name, env, Path(args.out) if args.out else None)
    payload: dict[str, Any] = {
        "environment": env,
        "complete": False,
        "model": {**shape, "lm_head_scaled_by": 8.0, "weights": "random init"},
        "settings": {
            "device": device,
            "prompt_tokens": prompt,
            "new_tokens": args.new_tokens,
            "calls": args.calls,
            "gc_calls": args.gc_calls,
            "repeat_dtype": "bfloat16" if cuda else "float32",
            "interrupt_dtypes": dtypes.split(","),
            "allocator": "torch defaults (" + ", ".join(ALLOC_CONF_VARS) + " unset)",
            "removed_alloc_conf": os.environ.get("REVIVA_BENCH_REMOVED_ALLOC_CONF"),
            "flat_from_call": FLAT_FROM_CALL,
            "prefill_residual": args.prefill_residual,
            "device_tolerance_bytes": DEVICE_TOLERANCE,
            "rss_tolerance": RSS_TOLERANCE,
        },
        "checks": {},
    }
    write_json(path, payload)
    say(f"# lifetime on {device}; writing {path}")

    # repeat_100
    dtype = torch.bfloat16 if cuda else torch.float32
    model = build_model(shape, dtype, device)
    gen = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(1, shape["vocab_size"], (1, prompt), device=device, generator=gen)
    hf_tokens = model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False)[
        0, prompt:
    ].tolist()
    attempts: list[dict] = []
    budget = None
    try:
        manager, budget = choose_budget(
            model, ids, args.new_tokens, cuda, attempts, args.prefill_residual
        )
        payload["settings"]["budget_bytes"] = budget
        payload["budget_attempts"] = attempts
        say(f"# repeat: budget {budget} bytes ({attempts[-1]})")
        result = repeat(
            manager, model, ids, args.new_tokens, args.calls, args.gc_calls, cuda, hf_tokens
        )
        del manager
    except Exception as e:
        result = {"pass": False, **error_fields(e)}
        payload["budget_attempts"] = attempts
    payload["checks"]["repeat_100"] = {k: v for k, v in result.items() if k != "records"}
    payload["repeat_records"] = result.get("records")
    write_json(path, payload)
    del model
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()

    # interrupt, per dtype, each on a fresh model
    per_dtype = {}
    for name in dtypes.split(","):
        model = build_model(shape, getattr(torch, name), device)
        dtype_attempts: list[dict] = []
        try:
            # Chosen again for each model: what the device holds (its baseline) moved since.
            _, b = choose_budget(
                model, ids, args.new_tokens, cuda, dtype_attempts, args.prefill_residual
            )
            per_dtype[name] = interrupt(
                model, ids, args.new_tokens, b, cuda, name, args.prefill_residual
            )
            per_dtype[name]["budget_attempts"] = dtype_attempts
        except Exception as e:
            per_dtype[name] = {"pass": False, **error_fields(e)}
        del model
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        payload["checks"]["interrupt"] = {
            "pass": all(v.get("pass") for v in per_dtype.values()),
            "dtypes": per_dtype,
        }
        write_json(path, payload)

    rep = payload["checks"]["repeat_100"]
    flat = rep.get("flat", {})
    print_table(
        ["check", "pass", "details"],
        [
            [
                "repeat_100",
                rep.get("pass"),
                f"completed {rep.get('all_completed')}, streamed "
                f"{rep.get('streamed_in_every_call')}, allocated spread "
                f"{flat.get('device_allocated_spread_bytes')} B, used spread "
                f"{flat.get('device_used_spread_bytes')} B, rss spread "
                f"{flat.get('rss_spread_bytes')}"
                f" B, survivors ok {rep.get('gc_disabled', {}).get('ok')}",
            ],
            *[
                [
                    f"interrupt {name} {s['scenario']}",
                    s["ok"],
                    f"raised {s['raised']['type']}, restored {s['restored']}, allocated returned "
                    f"{s.get('allocated_returned')}, outside torch returned "
                    f"{s.get('outside_torch_returned')} (torch cache "
                    f"{s.get('torch_cache_change')} B), "
                    f"next tokens ok {s['next_tokens_equal_reference']}",
                ]
                for name, d in per_dtype.items()
                for s in d.get("scenarios", [])
            ],
        ],
    )
    for name, d in per_dtype.items():
        if "error" in d:
            print(f"interrupt {name}: {d['error']}")
    if "error" in rep:
        print(f"repeat_100: {rep['error']}")
    payload["complete"] = True
    write_json(path, payload)
    say(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
