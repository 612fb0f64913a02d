"""The one memory model of a generate call: budget -> chunk, attention mode, residency, slots.

A generate call holds on the device what was there before it (the weights: `baseline`), torch's
working set of the prefill or decode step (`working_set`, margin included), and K/V: the
resident layers' buffers and the staging slots of streamed layers, from the core's arena, each
at most a layer's K/V at full capacity rounded up to the arena's granularity. The budget is the
config's, capped by what the device can give now (free memory + torch's cached but unused blocks
+ what is already held): a plan never counts on memory the card does not have.

    plan = make_plan(layout, config, device_state(layout, arena), batch=1, prompt_tokens=65536,
                     new_tokens=32)
    budget = budget_for(layout, config, state, 1, 65536, 32, resident_layers=24)

`budget_for` is the inverse: the smallest budget whose plan keeps `resident_layers` layers'
K/V resident, found by bisection over the same `make_plan`, so it cannot drift from it.

The plan is searched for here (make_plan, and its inverse budget_for over smallest_budget); its
parts live in one module each: the coefficients (plan/memory_model.py), what the device and the host
can give now (plan/memory_state.py), the Plan (plan/call_plan.py), its memory arithmetic and
residency (plan/arithmetic.py), the rings' sizes (cache/window_rings.py), and where decode attends
streamed K/V (plan/host_decode.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

from reviva._C import RevivaOutOfMemoryError
from reviva.adapters import DecoderLayout
from reviva.config import RevivaConfig
from reviva.plan.arithmetic import _make_plan, _round_up
from reviva.plan.call_plan import Plan
from reviva.plan.memory_model import (
    MODEL,
    MemoryModel,
    _MiB,
)
from reviva.plan.memory_state import DeviceState, HostState

log = logging.getLogger("reviva.planner")  # (the name users filter on)


def _check_shape(batch: int, prompt_tokens: int, new_tokens: int) -> None:
    for name, value, least in (
        ("batch", batch, 1),
        ("prompt_tokens", prompt_tokens, 1),
        ("new_tokens", new_tokens, 0),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"plan: {name} must be an int >= {least}, got {value!r}")


def make_plan(
    layout: DecoderLayout,
    config: RevivaConfig,
    state: DeviceState,
    batch: int,
    prompt_tokens: int,
    new_tokens: int,
    padded: bool = False,
    model: MemoryModel = MODEL,
    host: HostState | None = None,
    weight_layers: int = 0,
    weight_layer_bytes: int = 0,
    weight_decode_slot_bytes: int = 0,
    past_tokens: int = 0,
    rings: bool = False,
    weight_experts: tuple[int, int, int] = (0, 0, 0),
) -> Plan:
    """How a generate call of this shape uses the budget; raises RevivaOutOfMemoryError naming
    the numbers when the weights, the minimum working set and one layer's K/V do not fit, or
    (given `host`) when the pinned host memory it needs is more than the host can give.

    With weight_layers > 0 the decoder layers' weights (weight_layer_bytes each at most) live in
    pinned host memory (Note [Streamed weights] in reviva/weights/streamed.py), and the plan splits
    the room left beside the working set between resident weights, resident K/V and the staging
    room of each, keeping resident the mix that moves the fewest bytes per decode step: a byte
    of either kept on the device is a byte a step does not copy, so the mix that holds the most
    bytes resident (the streaming rooms taken off) wins, and of mixes that hold as much, the one
    with more weights (they stay across calls, and their layers' decode steps run as graphs).

    The prompt's hidden states stay on the device (the measured path) unless they do not fit there:
    then, with config.prefill_residual "auto" (or always, with "host"), they live in pinned host
    memory through prefill (Note [Residual stream on the host] in generate/llama_layer.py), which
    takes them and the whole prompt's rotary tables out of the working set.

    past_tokens: a call continued from a returned cache (Note [A returned cache] in
    cache/returned.py) holds that many tokens' K/V before its prefill of prompt_tokens: the K/V is
    planned for all of them, the working set for the prompt_tokens' queries over every key.

    rings: sliding-window layers whose window leaves keys out keep a ring of their window (Note
    [Window rings] in cache/window_rings.py): each is planned by its ring's bytes, not the call's.

    weight_experts: (one expert's bytes, experts, experts per token) of a model whose streamed
    layers' decode steps copy only the routed experts (Note [Routed experts] in
    reviva/weights/routed_experts.py), (0, 0, 0) otherwise: what a step's copies are forecast by."""
    _check_shape(batch, prompt_tokens, new_tokens)
    if isinstance(past_tokens, bool) or not isinstance(past_tokens, int) or past_tokens < 0:
        raise ValueError(f"plan: past_tokens must be an int >= 0, got {past_tokens!r}")
    if weight_layers and weight_layers != layout.num_layers:
        raise ValueError(
            f"plan: weight_layers must be 0 or the model's {layout.num_layers} layers, got "
            f"{weight_layers!r}"
        )
    weights = (
        weight_layers,
        _round_up(weight_layer_bytes, state.granularity),
        _round_up(weight_decode_slot_bytes, state.granularity),
    )
    args = (
        layout,
        config,
        state,
        batch,
        prompt_tokens,
        new_tokens,
        padded,
        model,
        host,
        weights,
        past_tokens,
        rings,
    )
    mode = config.prefill_residual
    if mode == "host":
        plan = _make_plan(*args, host_residual=True)
    else:
        try:
            plan = _make_plan(*args, host_residual=False)
        except RevivaOutOfMemoryError:
            if mode != "auto" or padded:
                raise
            plan = _make_plan(*args, host_residual=True)
    if not weight_layers or not weight_experts[0]:
        return plan
    expert, experts, per_token = weight_experts
    return replace(
        plan,
        weight_expert_bytes=expert,
        weight_experts=experts,
        weight_experts_per_token=per_token,
    )


def budget_for(
    layout: DecoderLayout,
    config: RevivaConfig,
    state: DeviceState,
    batch: int,
    prompt_tokens: int,
    new_tokens: int,
    resident_layers: int,
    padded: bool = False,
) -> int:
    """The smallest vram_budget (bytes) whose plan keeps `resident_layers` layers' K/V resident
    in prefill, on a device that could give it (the device's own limit is ignored here)."""
    if not 0 <= resident_layers <= layout.num_layers:
        raise ValueError(
            f"budget_for: resident_layers must be in [0, {layout.num_layers}], got "
            f"{resident_layers!r}"
        )
    return smallest_budget(
        layout,
        config,
        state,
        batch,
        prompt_tokens,
        new_tokens,
        lambda p: len(p.resident_layers) >= resident_layers,
        padded,
    )


def smallest_budget(
    layout: DecoderLayout,
    config: RevivaConfig,
    state: DeviceState,
    batch: int,
    prompt_tokens: int,
    new_tokens: int,
    keeps: Callable[[Plan], bool],
    padded: bool = False,
    past_tokens: int = 0,
) -> int:
    """The smallest vram_budget (bytes, to 4 KiB) whose plan satisfies `keeps` (which must hold
    for every larger budget once it holds), by bisection over make_plan (past_tokens: a call
    continued from a returned cache, make_plan's)."""
    unlimited = replace(state, available=1 << 62)

    def holds(budget: int) -> bool:
        try:
            p = make_plan(
                layout,
                replace(config, vram_budget=budget),
                unlimited,
                batch,
                prompt_tokens,
                new_tokens,
                padded,
                past_tokens=past_tokens,
            )
        except RevivaOutOfMemoryError:
            return False
        return keeps(p)

    low, high = max(state.baseline, _MiB), max(state.baseline, 1 << 30)
    while not holds(high):
        low, high = high, high * 2
        if high > 1 << 56:
            raise ValueError("budget_for: no budget gives such a plan (model too large?)")
    while high - low > 4096:
        mid = (low + high) // 2
        if holds(mid):
            high = mid
        else:
            low = mid
    return high
