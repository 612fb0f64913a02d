"""Plan: how one generate call uses the budget (chunk, attention mode, K/V residency and
staging, streamed weights, fp8 rows, pages, rings; all figures in bytes), and the figures read
from it (bytes held and pinned, decode's room for promotions). Made by
reviva.plan.planner.make_plan.
"""

from __future__ import annotations

from dataclasses import dataclass

from reviva.weights.streamed import DECODE_ROOMS, HOST_DECODE_ROOMS


@dataclass(frozen=True)
class Plan:
    """How one generate call uses the budget (all figures in bytes)."""

    budget: int  # the budget planned with: the config's, capped by the device's limit
    requested_budget: int  # the config's
    device_limit: int  # what the device can give in all (baseline + available)
    baseline: int  # held before the call (weights, buffers)
    batch: int
    prompt_tokens: int  # the tokens this call's prefill runs (after past_tokens)
    capacity: int  # past + prompt + new tokens
    chunk_tokens: int
    # Attention over the whole prompt in one call (queries and output held whole) while the
    # projections and the MLP go by chunks; else attention by query chunks too. (Paged layers
    # attend by query chunks, page by page, either way.)
    whole_attention: bool
    kv_token_bytes: int  # K and V of one token of one layer
    layer_kv_bytes: int  # K and V of one layer at full capacity, in arena granules
    working_set: int  # estimated transient peak (prefill or decode), margin included
    decode_working_set: int  # the same for decode alone (after prefill), its margin included
    margin: int  # part of the working set kept for allocator rounding and fragmentation
    decode_slots: int  # staging slots kept in decode while layers stream (MemoryModel)
    num_layers: int
    resident_layers: tuple[int, ...]
    slots: int
    prefetch_layers: int
    # Note [Residual stream on the host] (generate/llama_layer.py): the prompt's hidden states live
    # in pinned host memory through prefill and stream through each layer by chunks.
    residual_on_host: bool = False
    hidden_bytes_per_token: int = 0  # one token's hidden state (hidden_size x dtype bytes)
    # Note [fp8 K/V rows] (cache/fp8.py): K/V as e4m3 rows, attended by blocks of this many tokens.
    kv_fp8: bool = False
    kv_block_tokens: int = 0
    kv_decode_block_tokens: int = 0  # the same in decode steps (MemoryModel.kv_decode_block_bytes)
    # Note [fp8 prefill shadow] (cache/fp8_reads.py): bytes of the layer's 16-bit K/V that prefill
    # keeps beside its fp8 rows while it runs, or 0 (attended by blocks)
    kv_fp8_shadow_bytes: int = 0
    # Note [Paged layers] (src/kv_store_pages.cpp): streamed layers' K/V in pages of page_tokens
    # tokens; the staging room is page_slots pages of page_bytes (and `slots` is 0).
    page_tokens: int = 0
    page_bytes: int = 0
    page_slots: int = 0
    # Note [Streamed weights] (reviva/weights/streamed.py): the decoder layers' weights live in
    # pinned host memory (weight_layers of them; 0: on the device, not planned); these stay on the
    # device, and the rest stream through weight_slots layers' room, weight_prefetch_layers ahead.
    weight_layers: int = 0
    weight_layer_bytes: int = 0  # the largest layer's weights, in arena granules
    weight_resident_layers: tuple[int, ...] = ()
    weight_slots: int = 0
    weight_prefetch_layers: int = 0
    # decode's room for streamed weights (Note [Layers in parts] in reviva/weights/packing.py: one
    # block at a time, two of the largest block), at most the weight slots' (0: theirs)
    weight_decode_slot_bytes: int = 0
    # Note [Routed experts] (reviva/weights/routed_experts.py): a streamed expert layer's decode
    # step copies its first block and the experts its tokens chose: one expert's bytes (0: not an
    # expert model, a step copies the whole layer), of how many, and how many each token chooses
    weight_expert_bytes: int = 0
    weight_experts: int = 0
    weight_experts_per_token: int = 0
    # Note [A returned cache] (cache/returned.py): tokens whose K/V a continued call starts
    # from; its prefill runs prompt_tokens more after them, attending all of them
    past_tokens: int = 0
    # Note [Window rings] (cache/window_rings.py): sliding layers kept as rings of ring_tokens
    # tokens (ring_kv_bytes each, in arena granules) instead of the call's capacity; () / 0: none
    ring_tokens: int = 0
    ring_layers: tuple[int, ...] = ()
    ring_kv_bytes: int = 0
    # Note [Spilled layers] (src/kv_store_disk.cpp): streamed layers whose K/V lives on disk
    # (RevivaConfig(offload_device="disk")), of which disk_staged_layers hold pinned host copies
    # at a time; () / 0: none spill
    disk_layers: tuple[int, ...] = ()
    disk_staged_layers: int = 0

    def kv_bytes(self, layer: int) -> int:
        """Layer `layer`'s K/V at its most, in arena granules: its ring's, or the call's."""
        return self.ring_kv_bytes if layer in self.ring_layers else self.layer_kv_bytes

    def kv_tokens(self, layer: int) -> int:
        """The tokens layer `layer` holds at most (its ring's, or the call's capacity)."""
        return self.ring_tokens if layer in self.ring_layers else self.capacity

    @property
    def streamed_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if i not in self.resident_layers)

    @property
    def slot_kv_bytes(self) -> int:
        """A slot's room: the largest streamed layer's K/V (a slot holds any of them)."""
        return max((self.kv_bytes(i) for i in self.streamed_layer_ids), default=self.layer_kv_bytes)

    @property
    def resident_kv_bytes(self) -> int:
        return sum(self.kv_bytes(i) for i in self.resident_layers)

    @property
    def streamed_weight_layers(self) -> int:
        return self.weight_layers - len(self.weight_resident_layers)

    @property
    def weight_device_bytes(self) -> int:
        """Device bytes of the weights that the call holds: resident layers and slots."""
        return (len(self.weight_resident_layers) + self.weight_slots) * self.weight_layer_bytes

    @property
    def weight_decode_device_bytes(self) -> int:
        """Device bytes of the weights in decode: resident layers and decode's room."""
        if self.streamed_weight_layers == 0 or self.weight_decode_slot_bytes == 0:
            return self.weight_device_bytes
        room = min(self.weight_decode_slot_bytes, self.weight_slots * self.weight_layer_bytes)
        return len(self.weight_resident_layers) * self.weight_layer_bytes + room

    @property
    def weight_decode_block_bytes(self) -> int:
        """One block of decode's room for streamed weights (half of weight_decode_slot_bytes)
        where layers are taken in blocks (Note [Layers in parts] in weights/packing.py), else 0."""
        if self.weight_decode_slot_bytes == 0 or self.weight_decode_slot_bytes >= (
            self.weight_layer_bytes
        ):
            return 0
        return self.weight_decode_slot_bytes // 2

    @property
    def residual_host_bytes(self) -> int:
        """Pinned bytes of the prompt's hidden states when they live on the host (else 0)."""
        if not self.residual_on_host:
            return 0
        return self.batch * self.prompt_tokens * self.hidden_bytes_per_token

    @property
    def pinned_host_bytes(self) -> int:
        """All the pinned host memory the call needs: streamed K/V and hidden states."""
        return self.host_bytes + self.residual_host_bytes

    @property
    def streamed_layers(self) -> int:
        return self.num_layers - len(self.resident_layers)

    @property
    def host_bytes(self) -> int:
        """Pinned bytes of the streamed layers' host copies (spilled layers: the staged ones')."""
        pinned = [i for i in self.streamed_layer_ids if i not in self.disk_layers]
        staged = min(self.disk_staged_layers, len(self.disk_layers)) * self.capacity
        return (sum(self.kv_tokens(i) for i in pinned) + staged) * self.kv_token_bytes

    @property
    def disk_bytes(self) -> int:
        """Bytes of K/V the spilled layers keep on disk at most (Note [Spilled layers])."""
        return len(self.disk_layers) * self.capacity * self.kv_token_bytes

    @property
    def weight_step_bytes(self) -> int:
        """The bytes of one streamed layer's weights a decode step copies: the whole layer, or
        (Note [Routed experts] in reviva/weights/routed_experts.py) all but the experts none of the
        batch's tokens can choose."""
        if self.weight_expert_bytes == 0:
            return self.weight_layer_bytes
        chosen = min(self.weight_experts, self.batch * self.weight_experts_per_token)
        return self.weight_layer_bytes - (self.weight_experts - chosen) * self.weight_expert_bytes

    def decode_room(self, host_attention: bool = False) -> int:
        """The bytes left in decode for promotions (may be < 0): the budget less the baseline,
        decode's working set, the resident layers' K/V, the K/V slots beyond the plan's
        decode_slots (all of them where decode attends streamed K/V on the host), the pages and
        the weights' decode room (with host_attention, a block more: Note [Decode rooms when the
        host attends] in reviva/weights/streamed.py)."""
        slots = 0 if host_attention else self.decode_slots
        held = self.resident_kv_bytes + slots * self.slot_kv_bytes
        held += self.page_slots * self.page_bytes + self.weight_decode_device_bytes
        if host_attention and self.streamed_weight_layers > 0:
            held += (HOST_DECODE_ROOMS - DECODE_ROOMS) * self.weight_decode_block_bytes
        return self.budget - self.baseline - self.decode_working_set - held

    def promotable_layers(self, host_attention: bool = False) -> int:
        """Streamed layers whose K/V fits in decode_room once prefill's working set is gone
        (full layers first, then rings: promotable_split)."""
        return sum(self.promotable_split(host_attention))

    def promotable_split(self, host_attention: bool = False, taken: int = 0) -> tuple[int, int]:
        """(full layers, rings) of the streamed ones that decode_room (less `taken` bytes)
        holds: full layers first (each saves the call's K/V a step), then rings (Note [Window
        rings] in cache/window_rings.py) in what is left."""
        room = max(self.decode_room(host_attention) - taken, 0)
        streamed = self.streamed_layer_ids
        rings = sum(1 for i in streamed if i in self.ring_layers)
        full = min(room // self.layer_kv_bytes, len(streamed) - rings)
        room -= full * self.layer_kv_bytes
        ring = min(room // self.ring_kv_bytes, rings) if rings else 0
        return int(full), int(ring)
