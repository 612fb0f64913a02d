"""bench_lifetime's interrupt check: a KeyboardInterrupt from a streamer and an injected
torch.OutOfMemoryError in a layer (prefill and decode) leave the model, the device's memory and
the next call as they were; the same interruptions of plain HF recorded as a control."""

from __future__ import annotations

import gc
from typing import Any

from card import error_fields, say
from lifetime_measure import (
    DEVICE_TOLERANCE,
    CacheWatch,
    MiB,
    device_memory,
    module_snapshot,
    snapshot_differences,
)


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
