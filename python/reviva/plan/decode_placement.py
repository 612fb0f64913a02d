"""Where a generate call's decode runs its attention and keeps its K/V and weights, decided at
the switch from prefill to decode: whether decode attends streamed K/V on the host's cores
(RevivaConfig.decode_attention, the planner's rates deciding "auto"), streamed weights promoted
first when it does (Note [Weights first when the host attends]), the room prefill's working set
leaves given to K/V promotions (Plan.promotable_layers), and the layers left streaming handed
to the host's attention.

The policy (how many, which rates) is reviva.plan.planner's; this module applies it to the call's
cache and weights against what the device can give now. DecodePlacement is a mixin of
RevivaManager. State it reads: the manager's config, layout, arena, weights, and the call's
_plan and _cache. State it writes: the call's _phase record (host_attention's companions:
host_beside_copies, weights promoted, promotions refused and the first refusal's state), the
cache's slots, promotions and host-attended layers, and the weights' promotions.
"""

from __future__ import annotations

import logging

import torch

from reviva.plan.arithmetic import spread
from reviva.plan.call_plan import Plan
from reviva.plan.host_decode import host_attention_pays, host_decode_mix, host_kv_layers
from reviva.plan.memory_model import MODEL

# (the manager's logger: what a user filters on stays RevivaManager's)
log = logging.getLogger("reviva.manager")


class DecodePlacement:
    """Decode's attention and residency after prefill (RevivaManager's mixin; see the module)."""

    def _decode_attention_on_host(self, plan: Plan, beams: int, padded: bool, share: int) -> bool:
        """Whether this call's decode attends its streamed K/V on the host (RevivaConfig.
        decode_attention): "host" unless something below rules it out, and then it raises
        naming it; "device" never; "auto" where nothing rules it out and it pays (below)."""
        choice = self.config.decode_attention
        if choice == "device":
            return False
        why = None
        if not plan.kv_fp8 and self.layout.dtype not in (torch.bfloat16, torch.float32):
            why = f"K/V in {self.layout.dtype} (the host reads bf16, fp32 or fp8 rows)"
        elif plan.page_tokens:
            why = f"kv_page_tokens={plan.page_tokens}"
        elif plan.disk_layers:  # (Note [Spilled layers] in src/kv_store_disk.cpp)
            why = f"{len(plan.disk_layers)} layers' K/V spilled to disk (offload_device='disk')"
        elif beams > 1:
            why = f"num_beams={beams} (beams reorder rows on the device)"
        elif share > 1:
            why = "a prompt shared by several sequences"
        elif padded:
            why = "a padded batch (a padding mask)"
        if choice == "host":
            if why is not None:
                raise ValueError(
                    f"RevivaManager.generate: RevivaConfig(decode_attention='host') with {why}, "
                    "which attention on the host does not support; use decode_attention='auto' "
                    "or 'device'"
                )
            return True
        # "auto": on a GPU, where the weights stream too and the model plans a shorter step
        # with the host attending (planner.host_attention_pays; Note [Decode rooms when the host
        # attends] in weights/streamed.py), or, for fp8 rows, some of the layers fetched (Note [The
        # host beside the copies] in plan/host_decode.py); never on the CPU, whose cores are the
        # device's
        if why is not None or self.layout.device.type != "cuda":
            return False
        if plan.kv_fp8:
            return self._host_beside_copies(plan) > 0
        return host_attention_pays(plan, MODEL)

    def _host_beside_copies(self, plan: Plan) -> int:
        """Note [The host beside the copies] (plan/host_decode.py): the streamed layers
        decode attends on the host while the others are fetched (0: none), kept for the call in
        the phase."""
        count = host_kv_layers(plan, MODEL)
        if count > 0:
            self._phase["host_beside_copies"] = count
        return count

    # Note [Weights first when the host attends]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # Without attention on the host, the room prefill's working set leaves goes to K/V
    # promotions: a layer's K/V kept on the device saves its bytes at every step, as a layer's
    # weights do. With it, a streamed layer's K/V costs the step no copy but host time. In a layer
    # whose weights stream, that time runs while the next blocks' copies go on (the layer takes
    # the longer of its copy and its host attention); in a layer whose weights stay, nothing
    # hides it. So K/V kept goes to weight-resident layers first, and weights are promoted as
    # long as the step gets shorter: w layers promoted save w copies and may leave weight-
    # resident layers with their K/V on the host (planner.host_decode_mix, with MemoryModel's
    # rates measured on the H200; the forecast uses the same split). At ace9acc, promoting
    # weights until the host time matched the copies (the host attending 30 of 32 layers, 12 of
    # them with resident weights) ran at 3.6-3.95 tok/s against 4.04 on the device: host time in
    # weight-resident layers is not hidden.
    def _promote_weights_for_host_decode(self) -> None:
        plan, cache, weights = self._plan, self._cache, self.weights
        if plan is None or cache is None or weights is None:
            return
        if not self._phase.get("host_attention", False):
            return
        streamed = [i for i in range(plan.weight_layers) if not weights.resident(i)]
        best = host_decode_mix(plan, MODEL).weights_promoted
        self._phase["weights_promoted_for_host"] = 0
        if best <= 0 or not streamed:
            return
        wb = plan.weight_layer_bytes
        if self.layout.device.type == "cuda":
            torch.cuda.empty_cache()  # prefill's cached working set: the device's again
            free = torch.cuda.mem_get_info(self.layout.device)[0]
            free += int(self.arena.stats()["retiring_bytes"])
            best = min(best, max(free - plan.decode_working_set, 0) // wb)
        picks = [streamed[k] for k in spread(int(best), len(streamed))]
        if picks and weights.promote(picks):
            self._phase["weights_promoted_for_host"] = len(picks)
            self._phase["weight_promoted_bytes"] = len(picks) * wb
        log.info("reviva: %d weight layers promoted for decode with attention on the host", best)

    def _promote_after_prefill(self) -> None:
        """Prefill's working set is gone: slots beyond the plan's decode_slots are given up and
        streamed layers that now fit become resident (Plan.promotable_layers). On CUDA each
        promotion also needs the memory to be on the device now, beside decode's working set:
        torch's cached prefill blocks go back to the device first, and a layer the device cannot
        take (another part of the process holds the memory) stays streamed; the stats count it."""
        plan, cache = self._plan, self._cache
        if plan is None or cache is None or plan.streamed_layers == 0:
            return
        # (layers attended on the host need no slot: their room goes to promotions too, and
        # the last slot goes once they are on the host, _attend_on_host_after_prefill)
        # (Note [The host beside the copies]: the layers fetched keep their slots)
        host = self._phase.get("host_attention", False) and not self._phase.get(
            "host_beside_copies"
        )
        # (Note [Weights first when the host attends]: the weights promoted took room first, in
        # whole layers' K/V)
        taken = -(-self._phase.get("weight_promoted_bytes", 0) // plan.layer_kv_bytes)
        full_count, ring_count = plan.promotable_split(host, taken * plan.layer_kv_bytes)
        count = full_count + ring_count
        if count <= 0:
            return
        for _ in range(plan.slots - (min(plan.decode_slots, 1) if host else plan.decode_slots)):
            cache.drop_slot()
        cuda = self.layout.device.type == "cuda"
        if cuda:
            torch.cuda.empty_cache()  # prefill's cached working set: the device's again
        streamed = list(plan.streamed_layer_ids)
        # Note [Fetch tails]: a sliding layer streamed moves its window a step, a full one all
        # its tokens: full layers are promoted first. Rings (Note [Window rings] in
        # cache/window_rings.py) take the room left, by their own bytes.
        rings = [i for i in streamed if i in plan.ring_layers]
        full = [i for i in streamed if i not in cache.fetch_windows and i not in rings]
        windowed = [i for i in streamed if i in cache.fetch_windows]
        if host and self.weights is not None:
            # Note [Weights first when the host attends]: a layer whose weights stay has no copy
            # to hide its host attention under: its K/V comes first
            stay = [i for i in streamed if self.weights.resident(i)]
            rest = [i for i in streamed if i not in stay]
            picks = stay[: int(count)]
            more = int(count) - len(picks)
            picks += [rest[k] for k in spread(min(more, len(rest)), len(rest))]
        else:
            # (Note [Spilled layers] in src/kv_store_disk.cpp: a layer on disk is read back every
            # step at the disk's rate, far below PCIe's: those are promoted first)
            spilled = [i for i in full if i in plan.disk_layers]
            pinned = [i for i in full if i not in plan.disk_layers]
            picks = [spilled[k] for k in spread(min(full_count, len(spilled)), len(spilled))]
            more = full_count - len(picks)
            picks += [pinned[k] for k in spread(min(more, len(pinned)), len(pinned))]
            picks += [windowed[k] for k in spread(full_count - len(picks), len(windowed))]
            picks += [rings[k] for k in spread(ring_count, len(rings))]
        promoted = refused = 0
        first_refusal: dict | None = None
        for layer in picks:
            if cuda:
                # (the arena's retiring memory, given back and waiting for its streams, is the
                # arena's to map again: freed weight slots and dropped K/V slots are there)
                free = torch.cuda.mem_get_info(self.layout.device)[0]
                free += int(self.arena.stats()["retiring_bytes"])
                if free < plan.kv_bytes(layer) + plan.decode_working_set:
                    refused += 1
                    first_refusal = first_refusal or self._refusal_state("device", free, promoted)
                    continue
            if cache.promote(layer):
                promoted += 1
            else:
                refused += 1
                first_refusal = first_refusal or self._refusal_state("store", None, promoted)
        self._phase["promotions_refused_by_device"] = refused
        self._phase["first_promotion_refusal"] = first_refusal
        log.info("reviva: %d of %d planned promotions after prefill", promoted, count)

    def _refusal_state(self, by: str, free: int | None, promoted: int) -> dict:
        """What the device and the arena held when a promotion was first refused (bytes)."""
        st = self.arena.stats()
        state = {
            "refused_by": by,
            "promoted_before": promoted,
            "arena_mapped_bytes": int(st["mapped_bytes"]),
            "arena_retiring_bytes": int(st["retiring_bytes"]),
            "arena_limit_bytes": int(st["limit_bytes"]),
        }
        if free is not None:
            dev = self.layout.device
            state["device_free_bytes"] = free
            state["torch_allocated_bytes"] = torch.cuda.memory_allocated(dev)
            state["torch_reserved_bytes"] = torch.cuda.memory_reserved(dev)
        return state

    def _attend_on_host_after_prefill(self) -> None:
        """Note [Attention on the host] (src/host_attention.cpp): with the call's decode
        attention on the host, every layer whose K/V still streams after the promotions stays in
        its pinned host copy from here on (never fetched again), and the store's slots go."""
        cache = self._cache
        if cache is None or not self._phase.get("host_attention", False):
            return
        beside = self._phase.get("host_beside_copies")
        # Note [The host beside the copies] (plan/host_decode.py): some, between the fetched
        if beside:
            streamed = [i for i in range(len(cache.layers)) if not cache.store.resident(i)]
            for k in spread(min(beside, len(streamed)), len(streamed)):
                cache.attend_on_host(streamed[k])
            return
        for i in range(len(cache.layers)):
            if not cache.store.resident(i):
                cache.attend_on_host(i)
        while cache.drop_slot():
            pass
