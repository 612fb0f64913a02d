"""Where decode attends streamed K/V, by the memory model's rates: the room prefill leaves
shared between promoted weights and K/V when the host attends (host_decode_mix, Note [Weights
first when the host attends] in plan/decode_placement.py), whether attending on the host pays for
RevivaConfig(decode_attention="auto") (host_attention_pays against device_decode_step_s), and,
with fp8 rows, how many fetched layers the host attends beside the copies (host_kv_layers, Note
[The host beside the copies]). plan/decode_placement.py applies them to a call.
"""

from __future__ import annotations

from dataclasses import dataclass

from reviva.plan.call_plan import Plan
from reviva.plan.memory_model import MODEL, MemoryModel


@dataclass(frozen=True)
class HostDecodeMix:
    """Note [Weights first when the host attends] (plan/decode_placement.py): decode's room shared
    with decode's streamed K/V attended on the host."""

    weights_promoted: int  # weight layers made resident for decode
    kv_promoted: int  # K/V layers made resident with the rest (weight-resident layers first)
    host_exposed_layers: int  # weight-resident layers whose K/V is attended on the host
    step_s: float  # the step's copies and the host's time not under them (the model's estimate)
    host_s: float  # all the host's attention time of a step


def host_decode_mix(plan: Plan, model: MemoryModel = MODEL) -> HostDecodeMix:
    """Note [Weights first when the host attends] (plan/decode_placement.py): how the room prefill
    leaves is shared in decode when the streamed K/V is attended on the host. A layer whose
    weights stream takes max(its copy, its host attention) (the next blocks' copies run while
    the host works, in decode's room of HOST_DECODE_ROOMS blocks: Note [Decode rooms when the
    host attends]); a layer whose weights stay and whose K/V is on the host adds its host time
    in full. So the K/V kept goes to weight-resident layers first, and the weights promoted are
    the count that makes a step shortest (ties: fewer)."""
    streamed = plan.streamed_weight_layers
    resident_w = len(plan.weight_resident_layers)
    kv_streamed = plan.streamed_layers
    kv_unit = plan.layer_kv_bytes
    wb = plan.weight_layer_bytes
    room = max(plan.decode_room(host_attention=True), 0)
    kv_bytes = plan.capacity * plan.kv_token_bytes  # (a layer's K/V at the call's end)
    per_layer = kv_bytes / model.host_attention_bps + model.host_attention_layer_s
    copy_layer = plan.weight_step_bytes / model.copy_bps if wb > 0 else 0.0

    def mix(w: int) -> HostDecodeMix:
        kept = min(kv_streamed, (room - w * wb) // kv_unit) if kv_unit > 0 else 0
        kv_resident = len(plan.resident_layers) + kept
        exposed = max(resident_w + w - kv_resident, 0)
        step = (streamed - w) * max(copy_layer, per_layer) + exposed * per_layer
        host = (kv_streamed - kept) * per_layer
        return HostDecodeMix(w, kept, exposed, step, host)

    most = min(streamed, room // wb) if streamed > 0 and wb > 0 else 0
    return min((mix(w) for w in range(most + 1)), key=lambda m: (m.step_s, m.weights_promoted))


def device_decode_step_s(plan: Plan, model: MemoryModel = MODEL) -> float:
    """A decode step's copies with the streamed K/V fetched (decode_attention="device"): the
    streamed weights and the K/V of the layers still streamed after prefill's promotions, each
    at the call's final length, at the model's copy rate."""
    fetched = plan.streamed_layers - min(plan.promotable_layers(), plan.streamed_layers)
    copies = plan.streamed_weight_layers * plan.weight_step_bytes
    copies += fetched * plan.capacity * plan.kv_token_bytes
    return copies / model.copy_bps


def host_attention_pays(plan: Plan, model: MemoryModel = MODEL) -> bool:
    """Whether RevivaConfig(decode_attention="auto") attends the streamed K/V on the host: for
    one sequence where weights stream too (where it was measured to pay: bench_weights'
    card8_8b and card24_32b) and the step host_decode_mix plans is shorter than
    device_decode_step_s by the model's margin. Not for a batch: on the H200 at 5ce5c4c, 8
    sequences of 4k on the 32B shape took 11.8 ms a layer on the host against 3.3 ms for one of
    32k (as many rows), and decoded at 5.6 tokens a second, against 8.66 with the K/V fetched
    at 76490f3."""
    if plan.batch > 1 or plan.streamed_weight_layers == 0 or plan.streamed_layers == 0:
        return False
    host = host_decode_mix(plan, model).step_s
    return host <= model.host_attention_margin * device_decode_step_s(plan, model)


# Note [The host beside the copies]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# With fp8 K/V and every layer's weights resident (a long context on a card the weights fit),
# a decode step is bound by the K/V fetched over PCIe: at 512k on a 24 GB card (Llama-3-8B
# shape) 29 layers of 1.08 GB, ~0.57 s a step at 55 GB/s. The host's cores can read a layer's
# rows where its pinned copy lies while the copy engine fetches another's: a host-attended layer
# blocks the step for its host time, and the fetch of the next streamed layer runs meanwhile
# into the slot the last one left. So of the S layers still streamed after prefill's promotions,
# h are attended on the host (spread among the others, so that each host layer has a fetch to
# run beside it), h chosen so that the longer of the copies ((S - h) layers) and the host's time
# (h layers) is least. Not with streamed weights (host_decode_mix shares that room), not for a
# batch, and only for fp8 rows: for bf16 the host's rate was measured with the weights' copies
# (host_attention_bps), and the 512k bf16 plans were measured with every layer fetched.
def host_kv_layers(plan: Plan, model: MemoryModel = MODEL) -> int:
    """Note [The host beside the copies]: how many of the fp8 layers still streamed after
    prefill's promotions decode attends on the host (0: none, where it does not pay by
    host_attention_margin)."""
    if not plan.kv_fp8 or plan.batch > 1 or plan.streamed_weight_layers > 0:
        return 0
    streamed = plan.streamed_layers - min(plan.promotable_layers(), plan.streamed_layers)
    if streamed < 2:
        return 0
    kv = plan.capacity * plan.kv_token_bytes  # (a layer's K/V at the call's end)
    copy = kv / model.copy_bps
    host = kv / model.host_fp8_attention_bps + model.host_attention_layer_s

    def step(h: int) -> float:
        return max((streamed - h) * copy, h * host)

    best = min(range(streamed + 1), key=lambda h: (step(h), h))
    return best if step(best) <= model.host_attention_margin * step(0) else 0
