"""Pinning a generate call's host copies: the pinned host memory its streamed layers' K/V
leaves for, reserved in the process's pool before compute or on a helper thread while prefill's
first layers run (REVIVA_PIN_HOST_COPIES). Mechanism only: which layers stream, and the size of
each one's copy, are the plan's (reviva.plan.planner)."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterable
from typing import Any

from reviva import switches
from reviva.plan.call_plan import Plan

# The helper thread pins the rest of a call's host copies when the host issues this layer's
# prefill (pin_host_copies; the go is given in CallPhases._prefill_layer_starts).
_PIN_AFTER_LAYER = 2


def _reserve_host_copies(pool: Any, plan: Plan, layers: Iterable[int]) -> None:
    """Pins the host copies of these streamed layers now, each of its own size (a ring's or the
    call's: Note [Window rings] in cache/window_rings.py)."""
    for size, count in Counter(plan.kv_tokens(i) * plan.kv_token_bytes for i in layers).items():
        pool.reserve(count, size)


def pin_host_copies(pool: Any, plan: Plan, phase: dict[str, Any]) -> float:
    """Pins the streamed layers' host copies for the call (the pool keeps them for later
    calls, so from the second call of a shape this finds them there). Returns the seconds
    the calling thread spent on it. `phase` is the call's phase record (RevivaManager._phase):
    the mode, and for the helper thread its go event, its thread, its cancel flag, its time
    and its error, go there.

    Where (REVIVA_PIN_HOST_COPIES): "background" (the default) pins the copies of layers 0
    and 1 (those streamed in prefill) before compute, and the rest on a helper thread once
    the host issues layer 2's prefill (_PIN_AFTER_LAYER): the pool lets allocations wait for
    slabs landing (Note [Slabs landing]); the calling thread joins the helper before the
    call returns. Pinning registers memory with the driver, which holds up the calling
    thread's CUDA calls meanwhile (Note [Pinning by registration] in cuda_backend_memory.cpp); in
    a process's first call the host, not the device, sets the pace until its first layers
    are issued (kernels loaded, cuBLAS and cuDNN set up), so pinning then cost the call
    what it took. From layer 2 on the host runs a layer ahead of the device and such waits
    hide. (H200, 64k on a 24 GB card: pinning from the start of the call on the helper
    thread left call 1's time before layer 0 and layer 0 itself ~0.6 s over a no-card
    call 1's, benchmarks/results/logs/5c3b5e3, a19b83d.)
    "before_compute" pins everything before the call's compute starts."""
    if plan.streamed_layers == 0:
        return 0.0
    t = time.perf_counter()
    # (of the layers spilled to disk, as many host copies as are staged at a time: Note
    # [Spilled layers] in src/kv_store_disk.cpp)
    staged = plan.disk_layers[: plan.disk_staged_layers]
    streamed = [i for i in plan.streamed_layer_ids if i not in plan.disk_layers or i in staged]
    phase["pin_mode"] = switches.pin_mode()
    if phase["pin_mode"] == "before_compute":
        _reserve_host_copies(pool, plan, streamed)
        return time.perf_counter() - t
    first = [i for i in streamed if i < _PIN_AFTER_LAYER]
    rest = [i for i in streamed if i >= _PIN_AFTER_LAYER]
    if first:
        _reserve_host_copies(pool, plan, first)
    if not rest:
        return time.perf_counter() - t
    go = threading.Event()

    def pin() -> None:
        go.wait()
        if phase.get("pin_cancel"):
            return
        t0 = time.perf_counter()
        try:
            # (the early layers hold their blocks by now: layer 2 is issued after them)
            _reserve_host_copies(pool, plan, rest)
        except Exception as e:  # noqa: BLE001 (the call's own allocations raise theirs)
            phase["pin_error"] = f"{type(e).__name__}: {e}"[:300]
        finally:
            phase["pin_background_s"] = time.perf_counter() - t0

    thread = threading.Thread(target=pin, name="reviva-pin", daemon=True)
    phase["pin_go"] = go
    phase["pin_thread"] = thread
    thread.start()
    return time.perf_counter() - t
