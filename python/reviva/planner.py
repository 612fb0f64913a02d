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
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from reviva import kv_fp8, switches
from reviva._C import RevivaOutOfMemoryError
from reviva.adapters import DecoderLayout
from reviva.config import RevivaConfig
from reviva.sizes import format_bytes as _fmt
from reviva.weights import DECODE_ROOMS, HOST_DECODE_ROOMS

log = logging.getLogger(__name__)

_MiB = 1 << 20


@dataclass(frozen=True)
class MemoryModel:
    """Coefficients of the working-set estimate (bytes, per prompt token of one chunk unless
    named otherwise). Measured against torch's peaks on the H200 (issue 4)."""

    hidden_fp32_copies: int = 8  # RMSNorm's fp32 input and output, per hidden unit
    head_temporaries: int = 5  # q with RoPE (2), attention output, o_proj input/output
    kv_head_temporaries: int = 4  # k with RoPE (2), v, their cache write
    mlp_wide_tensors: int = 3  # gate, up, their product
    # HF's grouped experts forward, per (token, chosen expert) pair (Note [The experts' working
    # set]): the gathered input and, of the expert's width, four (gate_up and its masked copy;
    # then that copy, the gate's activation and the gated product); at its end four hidden-sized
    # tensors (the gathered input, the down projection, weighted, unpermuted); the int64 sort
    # indices; fp32 router scores per expert.
    expert_wide_tensors: int = 4
    expert_hidden_tensors: int = 4
    expert_index_bytes: int = 4 * 8
    router_bytes_per_expert: int = 4 * 3
    residual_tensors: int = 3  # input, residual, output
    score_bytes_per_pair: int = 4 * 3  # unfused attention: fp32 scores with softmax temporaries
    logits_bytes_per_vocab: int = 12  # fp32 logits and the sampler's temporaries (+ dtype bytes)
    decode_fixed: int = 4 * _MiB  # decode's small tensors (positions, masks, sampler state)
    margin_fixed: int = 8 * _MiB  # allocator rounding ...
    margin_fraction: float = 1 / 50  # ... and fragmentation, as a part of the budget
    # Decode's working set is a token's tensors (small-pool blocks of torch's allocator): little
    # to fragment. The prefill margin kept through decode left a layer's K/V unused on a 24 GB card.
    decode_margin_fraction: float = 1 / 200
    # Staging slots kept in decode when layers still stream: the one in use and one being filled
    # keep the copy stream busy (a fill waits only for the release of the layer two streamed
    # layers back), so a third slot's memory makes one more layer resident instead.
    decode_slots: int = 2
    # ... and when the weights stream too: their copies keep the copy stream busy, so a streamed
    # layer's K/V can wait for the release of the one before it (its copy queues behind the
    # weights' blocks already in flight), and one slot less is a layer more resident.
    decode_slots_with_streamed_weights: int = 1
    chunk_target_fraction: float = 1 / 10  # a chunk's transients take this part of the room
    chunk_min_bytes: int = 32 * _MiB
    chunk_max_bytes: int = 4096 * _MiB
    chunk_multiple: int = 256
    kv_block_bytes: int = 128 * _MiB  # fp8 K/V: a block's dequantized K and V with temporaries
    # ... in a decode step, whose one query per sequence makes a block's attention cheap beside
    # its copy: smaller blocks free decode's working set for K/V kept resident (8B shape, 32k, 8 GB
    # card: 128 MiB of blocks was two layers' fp8 K/V streamed per step, at 045f1c0).
    kv_decode_block_bytes: int = 16 * _MiB
    # Streamed weights (Note [Streamed weights] in reviva/weights.py): room for at most this many
    # streamed layers' weights on the device beside the resident ones: the one compute uses and
    # the next being copied. Where a layer more can stay resident instead, the plan takes one
    # slot (the mix that holds more bytes: _residency): a decode step is copy-bound, and the
    # copy stream stays busy without prefetching weights (the K/V fetches and the next layer's
    # weights queue behind each other). Measured on the H200, 32B shape on a 24 GB card: one
    # weight slot, decode at 0.975 of the transfer roofline (bench_weights, ec413ed).
    weight_slots: int = 2
    # Note [Weights first when the host attends] (decode_placement.py): a decode step's copy
    # rate, and the rate at which the host's cores attend streamed K/V (bytes of rows a second,
    # 16 threads, bf16, while the weights' copies run: 134 MB of a 32k layer in 3.9 ms on the
    # H200's host at ace9acc) with a fixed cost per layer (the wait for compute, the query and
    # output copies): what decides how much room goes to weights rather than K/V.
    copy_bps: float = 55e9
    host_attention_bps: float = 34e9
    host_attention_layer_s: float = 3e-4
    # RevivaConfig(decode_attention="auto") attends on the host where a step planned so is this
    # much shorter than with the K/V fetched (host_attention_pays): the host's time varies with
    # what else runs on its cores (2.5-4.8 ms a 32k layer between calls on the H200's host).
    host_attention_margin: float = 0.9
    # Note [The host beside the copies]: the rate at which the host's cores attend fp8 rows
    # (bytes of rows a second, 16 threads, e4m3 values and their scales).
    host_fp8_attention_bps: float = 34e9


MODEL = MemoryModel()


# Note [The experts' working set]
# A mixture-of-experts layer's prefill runs HF's own experts forward (Note [Routed experts] in
# routed_experts.py), by default its grouped one (transformers.integrations.moe): each token's input
# is gathered once per chosen expert, sorted by expert, and each (token, expert) pair goes through
# that expert's gate_up, gate and down projections; the pairs' outputs are weighted, put back in
# token order and summed over the k experts. So a chunk of T tokens holds T*k rows at once: of the
# expert's width while it computes, of the hidden size (four of them) at its end. Qwen3-MoE (k = 8,
# width 768, hidden 2048) holds 128 KiB a token there, where a dense MLP of its config's
# intermediate_size (6144, run by none of its layers) is 36 KiB: planned as dense, a 4k-token chunk
# on a 6 GB card ran out of memory in `weighted_out[inv_perm]` (bench_experts --model qwen3-30b-a3b
# on the H200 at cb4c235). Measured on the CPU with torch's profiler
# (test_the_experts_working_set_covers_hfs_grouped_forward): the estimate is within 2% above the
# forward's peak.


def _experts_per_token(lay: DecoderLayout, model: MemoryModel) -> int:
    """Bytes a prompt token holds in HF's experts forward at its peak (Note [The experts'
    working set]); 0 for a model without experts."""
    k, width, e = lay.experts_per_token, lay.expert_intermediate_size, lay.dtype.itemsize
    if not k:
        return 0
    rows = max(
        lay.hidden_size + width * model.expert_wide_tensors,
        lay.hidden_size * model.expert_hidden_tensors,
    )
    return (
        k * (rows * e + model.expert_index_bytes) + lay.num_experts * model.router_bytes_per_expert
    )


@dataclass(frozen=True)
class DeviceState:
    """What the device holds and can give, read just before planning (bytes)."""

    total: int  # the device's memory
    baseline: int  # held by torch's tensors now (weights, buffers)
    available: int  # free + torch's cached but unused blocks + Reviva's arena mapped now
    granularity: int  # the arena's mapping unit

    @property
    def limit(self) -> int:
        """The most a call can hold in all: what is held plus what can still be had."""
        return self.baseline + self.available


def device_state(layout: DecoderLayout, arena: object, streamed_bytes: int = 0) -> DeviceState:
    """Reads the device now. On CUDA: torch's allocated and reserved bytes, cudaMemGetInfo and
    the arena; on the CPU (host backend) the simulated device and the model's bytes, less the
    `streamed_bytes` of parameters that live in a WeightStore (its host copies, or the arena)."""
    st = arena.stats()
    granularity = int(st["granularity"])
    ours = int(st["mapped_bytes"]) + int(st["retiring_bytes"])
    if layout.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(layout.device)
        allocated = torch.cuda.memory_allocated(layout.device)
        cached = torch.cuda.memory_reserved(layout.device) - allocated
        return DeviceState(total, allocated, free + cached + ours, granularity)
    model = layout.model
    held = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    held -= streamed_bytes
    total = 16 << 30  # the host backend's simulated device
    return DeviceState(total, held, max(total - held, 0), granularity)


@dataclass(frozen=True)
class HostState:
    """Pinned host memory a call can still take (bytes): what the system can give without
    swapping (MemAvailable, less a reserve for the rest of the process) plus what Reviva's pool
    holds pinned and unused. Pinned memory cannot be paged out: a plan past this would push the
    machine into swap or the OOM killer instead of failing with the numbers."""

    available: int
    system_available: int  # MemAvailable
    reserve: int  # kept for the process's other host memory
    pool_cached: int  # pinned by the pool, unused


def host_state(pool: object) -> HostState | None:
    """The host's side, now; None where /proc/meminfo is not there (no check then)."""
    system = _mem_available()
    if system is None:
        return None
    st = pool.stats()
    cached = max(int(st["bytes_reserved"]) - int(st["bytes_in_use"]), 0)
    reserve = max(1 << 30, system // 20)
    return HostState(max(system - reserve, 0) + cached, system, reserve, cached)


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


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
    # Note [Residual stream on the host] (llama_layer.py): the prompt's hidden states live in
    # pinned host memory through prefill and stream through each layer by chunks.
    residual_on_host: bool = False
    hidden_bytes_per_token: int = 0  # one token's hidden state (hidden_size x dtype bytes)
    # Note [fp8 K/V rows] (kv_fp8.py): K/V as e4m3 rows, attended by blocks of this many tokens.
    kv_fp8: bool = False
    kv_block_tokens: int = 0
    kv_decode_block_tokens: int = 0  # the same in decode steps (MemoryModel.kv_decode_block_bytes)
    # Note [fp8 prefill shadow] (kv_cache.py): bytes of the layer's 16-bit K/V that prefill
    # keeps beside its fp8 rows while it runs, or 0 (attended by blocks)
    kv_fp8_shadow_bytes: int = 0
    # Note [Paged layers] (src/kv_store.cpp): streamed layers' K/V in pages of page_tokens
    # tokens; the staging room is page_slots pages of page_bytes (and `slots` is 0).
    page_tokens: int = 0
    page_bytes: int = 0
    page_slots: int = 0
    # Note [Streamed weights] (reviva/weights.py): the decoder layers' weights live in pinned host
    # memory (weight_layers of them; 0: on the device, not planned); these stay on the device,
    # and the rest stream through weight_slots layers' room, weight_prefetch_layers ahead.
    weight_layers: int = 0
    weight_layer_bytes: int = 0  # the largest layer's weights, in arena granules
    weight_resident_layers: tuple[int, ...] = ()
    weight_slots: int = 0
    weight_prefetch_layers: int = 0
    # decode's room for streamed weights (Note [Layers in parts] in reviva/layer_packing.py: one
    # block at a time, two of the largest block), at most the weight slots' (0: theirs)
    weight_decode_slot_bytes: int = 0
    # Note [Routed experts] (reviva/routed_experts.py): a streamed expert layer's decode step
    # copies its first block and the experts its tokens chose: one expert's bytes (0: not an
    # expert model, a step copies the whole layer), of how many, and how many each token chooses
    weight_expert_bytes: int = 0
    weight_experts: int = 0
    weight_experts_per_token: int = 0
    # Note [A returned cache] (kv_cache.py): tokens whose K/V a continued call starts from; its
    # prefill runs prompt_tokens more after them, attending all of them
    past_tokens: int = 0
    # Note [Window rings] (kv_cache.py): sliding layers kept as rings of ring_tokens tokens
    # (ring_kv_bytes each, in arena granules) instead of the call's capacity; () / 0: none
    ring_tokens: int = 0
    ring_layers: tuple[int, ...] = ()
    ring_kv_bytes: int = 0

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
        where layers are taken in blocks (Note [Layers in parts] in layer_packing.py), else 0."""
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
        """Pinned bytes of the streamed layers' host copies."""
        return sum(self.kv_tokens(i) for i in self.streamed_layer_ids) * self.kv_token_bytes

    @property
    def weight_step_bytes(self) -> int:
        """The bytes of one streamed layer's weights a decode step copies: the whole layer, or
        (Note [Routed experts] in reviva/routed_experts.py) all but the experts none of the batch's
        tokens can choose."""
        if self.weight_expert_bytes == 0:
            return self.weight_layer_bytes
        chosen = min(self.weight_experts, self.batch * self.weight_experts_per_token)
        return self.weight_layer_bytes - (self.weight_experts - chosen) * self.weight_expert_bytes

    def decode_room(self, host_attention: bool = False) -> int:
        """The bytes left in decode for promotions (may be < 0): the budget less the baseline,
        decode's working set, the resident layers' K/V, the K/V slots beyond the plan's
        decode_slots (all of them where decode attends streamed K/V on the host), the pages and
        the weights' decode room (with host_attention, a block more: Note [Decode rooms when the
        host attends] in reviva/weights.py)."""
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
        rings] in kv_cache.py) in what is left."""
        room = max(self.decode_room(host_attention) - taken, 0)
        streamed = self.streamed_layer_ids
        rings = sum(1 for i in streamed if i in self.ring_layers)
        full = min(room // self.layer_kv_bytes, len(streamed) - rings)
        room -= full * self.layer_kv_bytes
        ring = min(room // self.ring_kv_bytes, rings) if rings else 0
        return int(full), int(ring)


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
    pinned host memory (Note [Streamed weights] in reviva/weights.py), and the plan splits the
    room left beside the working set between resident weights, resident K/V and the staging
    room of each, keeping resident the mix that moves the fewest bytes per decode step: a byte
    of either kept on the device is a byte a step does not copy, so the mix that holds the most
    bytes resident (the streaming rooms taken off) wins, and of mixes that hold as much, the one
    with more weights (they stay across calls, and their layers' decode steps run as graphs).

    The prompt's hidden states stay on the device (the measured path) unless they do not fit
    there: then, with config.prefill_residual "auto" (or always, with "host"), they live in
    pinned host memory through prefill (Note [Residual stream on the host] in llama_layer.py),
    which takes them and the whole prompt's rotary tables out of the working set.

    past_tokens: a call continued from a returned cache (Note [A returned cache] in kv_cache.py)
    holds that many tokens' K/V before its prefill of prompt_tokens: the K/V is planned for all of
    them, the working set for the prompt_tokens' queries over every key.

    rings: sliding-window layers whose window leaves keys out keep a ring of their window (Note
    [Window rings] in kv_cache.py): each is planned by its ring's bytes, not the call's.

    weight_experts: (one expert's bytes, experts, experts per token) of a model whose streamed
    layers' decode steps copy only the routed experts (Note [Routed experts] in
    reviva/routed_experts.py), (0, 0, 0) otherwise: what a step's copies are forecast by."""
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


def _make_plan(
    layout: DecoderLayout,
    config: RevivaConfig,
    state: DeviceState,
    batch: int,
    prompt_tokens: int,
    new_tokens: int,
    padded: bool,
    model: MemoryModel,
    host: HostState | None,
    weights: tuple[int, int, int],
    past_tokens: int,
    rings: bool,
    host_residual: bool,
) -> Plan:
    lay = layout
    e = lay.dtype.itemsize
    requested = config.budget_bytes(state.total)
    budget = min(requested, state.limit)
    baseline = state.baseline
    keys = past_tokens + prompt_tokens  # what prefill's queries attend
    capacity = keys + new_tokens
    fp8 = config.kv_dtype == "fp8"
    if fp8:  # uint8 rows: head_dim e4m3 values and a 4-byte scale per token and head
        kv_token = 2 * batch * lay.num_kv_heads * kv_fp8.row_bytes(lay.head_dim)
    else:
        kv_token = 2 * batch * lay.num_kv_heads * lay.head_dim * e
    layer_kv = _round_up(capacity * kv_token, state.granularity)
    per_token = batch * (
        lay.hidden_size * model.hidden_fp32_copies
        + lay.num_heads * lay.head_dim * e * model.head_temporaries
        + lay.num_kv_heads * lay.head_dim * e * model.kv_head_temporaries
        + max(lay.intermediate_size * e * model.mlp_wide_tensors, _experts_per_token(lay, model))
        + lay.hidden_size * e * model.residual_tensors
    )
    # Without a fused attention kernel, attention materializes its scores: fp32, with softmax
    # temporaries, for every (query, key) pair of a call. Fused: CUDA in half precision
    # (flash, cuDNN), and the CPU's flash kernel, unless a padding mask forces the math path.
    fused = (lay.device.type == "cuda" and lay.dtype in (torch.float16, torch.bfloat16)) or (
        lay.device.type == "cpu" and not padded
    )
    score = 0 if fused else batch * lay.num_heads * model.score_bytes_per_pair
    free_for_work = max(budget - baseline, 0)
    if config.chunk_tokens is not None:
        chunk = config.chunk_tokens
    else:
        target = min(
            max(int(free_for_work * model.chunk_target_fraction), model.chunk_min_bytes),
            model.chunk_max_bytes,
        )
        m = model.chunk_multiple
        chunk = max(m, target // (per_token + score * keys) // m * m)
    chunk = min(chunk, prompt_tokens)
    # The prompt's hidden states and rotary tables: on the device for the whole prompt, or (the
    # residual on the host) a chunk's at a time, already in per_token's residual tensors.
    rows = chunk if host_residual else prompt_tokens
    hidden = 0 if host_residual else batch * prompt_tokens * lay.hidden_size * e
    rotary = batch * rows * lay.head_dim * (2 * e + 8)
    mask = batch * prompt_tokens * capacity if padded else 0
    logits = batch * lay.vocab_size * (e + model.logits_bytes_per_vocab)
    # Whole-prompt attention needs the queries and the output of all tokens at once (and,
    # without a fused kernel, the scores); one call over the prompt runs the fastest kernel,
    # while a chunk's queries need a bottom-right causal mask (measured ~30% slower on the
    # H200). It is chosen when it fits beside a full set of staging slots: layers it keeps
    # off the device during prefill are promoted back after it.
    # Three tensors of the queries' size: the queries, the attention's output, and the copy of
    # it that HF's sdpa_attention_forward returns (attn_output.transpose(1, 2).contiguous()):
    # counting two, a paged plan at 64k on a 24 GB card ran out of memory in that copy (50eb01c).
    q_and_out = 3 * batch * prompt_tokens * lay.num_heads * lay.head_dim * e
    q_and_out += score * prompt_tokens * keys
    # ... and a contiguous copy of the layer's keys and values (LlamaLayerPath._attend_hf).
    kv_copy = 2 * batch * keys * lay.num_kv_heads * lay.head_dim * e
    q_and_out += kv_copy
    # fp8 K/V: one block of K and V dequantized at a time, and the merge's fp32 accumulators for
    # a chunk's queries. In 16 bits the core's kernel writes the block and nothing else
    # (kv_fp8.dequantize); otherwise torch's ops hold an fp32 copy beside it.
    block_tokens = decode_block_tokens = 0
    blocks = 0
    if fp8:
        sixteen = lay.dtype in (torch.bfloat16, torch.float16)
        per_block_token = 2 * batch * lay.num_kv_heads * lay.head_dim * (e if sixteen else 4 + e)
        block_tokens = config.kv_block_tokens or min(
            capacity, max(256, model.kv_block_bytes // per_block_token)
        )
        accumulators = 3 * batch * lay.num_heads * lay.head_dim * 4
        blocks = block_tokens * per_block_token + chunk * accumulators
        decode_block_tokens = config.kv_block_tokens or min(
            block_tokens, max(256, model.kv_decode_block_bytes // per_block_token)
        )
    paged = config.kv_page_tokens > 0
    page_bytes = _round_up(min(config.kv_page_tokens, capacity) * kv_token, state.granularity)
    if paged and not fp8:  # the merge's fp32 accumulators of a chunk's queries across pages
        blocks += chunk * 3 * batch * lay.num_heads * lay.head_dim * 4
    base = hidden + rotary + mask + chunk * per_token + logits + blocks
    margin = model.margin_fixed + int(budget * model.margin_fraction)
    n = lay.num_layers
    window = min(config.prefetch_layers, n)
    weight_layers, weight_bytes, weight_decode_slot = weights
    # the least room streamed weights need beside the K/V: their slots (or all of them resident)
    weight_least = min(weight_layers, model.weight_slots) * weight_bytes
    # after a returned cache's tokens, each chunk attends the cache's buffer in place
    # (LlamaLayerPath.prefill); fp8 K/V attends whole only through a shadow (below)
    if host_residual or past_tokens:
        whole_attention = False
    elif chunk >= prompt_tokens or config.prefill_attention == "whole":
        whole_attention = True
    elif config.prefill_attention == "chunked":
        whole_attention = False
    else:
        # (paged layers attend by chunks, page by page; whole layers may still attend whole)
        fits = base + q_and_out + margin + (window + 1) * (page_bytes if paged else layer_kv)
        fits += weight_least
        whole_attention = fits <= budget - baseline

    def prefill_bytes(whole: bool) -> int:
        if whole and chunk < prompt_tokens:
            return base + q_and_out  # whole queries and output, and the scores
        if whole:  # q and out are in per_token
            return base + score * prompt_tokens * keys + kv_copy
        return base + score * chunk * keys

    decode = logits + batch * capacity * 8 + per_token + model.decode_fixed
    if fp8:
        decode += decode_block_tokens * per_block_token + accumulators
    decode_margin = model.margin_fixed + int(budget * model.decode_margin_fraction)
    prefill = prefill_bytes(whole_attention)
    shadow = 0
    if fp8:
        # Note [fp8 prefill shadow] (kv_cache.py): with 16-bit compute, prefill may keep the
        # layer's K/V dequantized beside its rows (no blocks then) and attend it as a bf16
        # layer's, whole where the rules above allow; taken where it costs no residency against
        # the blocks by chunks, whole attention first.
        blocks_only = prefill_bytes(False)
        args = (n, layer_kv, layer_kv, window, weight_layers, weight_bytes)  # (fp8: no rings)
        rest = (model.weight_slots, 0, 0)

        def residency(p: int) -> object:
            room = budget - baseline - max(p + margin, decode + decode_margin)
            return _residency(room, *args, *rest)

        choices = []
        if not paged and e == 2:
            sh = 2 * batch * keys * lay.num_kv_heads * lay.head_dim * e
            swap = sh - block_tokens * per_block_token  # (the shadow instead of the blocks)
            if whole_attention:
                choices.append((True, prefill_bytes(True) + swap, sh))
            choices.append((False, blocks_only + swap, sh))
        reference = residency(blocks_only)
        whole_attention, prefill = False, blocks_only
        for whole, bytes_, sh in choices:
            if residency(bytes_) == reference:
                whole_attention, prefill, shadow = whole, bytes_, sh
                break
    working = max(prefill + margin, decode + decode_margin)
    avail = budget - baseline - working
    unit = page_bytes if paged else layer_kv
    # Note [Window rings] (kv_cache.py): sliding layers as rings of ring_tokens, planned apart
    ring_tokens = window_ring_tokens(lay, capacity, chunk) if rings and not (fp8 or paged) else 0
    ring_ids = tuple(i for i, w in enumerate(lay.windows) if ring_tokens and w is not None)
    ring_kv = _round_up(ring_tokens * kv_token, state.granularity) if ring_ids else 0
    mix = _residency(
        avail,
        n - len(ring_ids),
        layer_kv,
        unit,
        window,
        weight_layers,
        weight_bytes,
        model.weight_slots,
        len(ring_ids),
        ring_kv,
    )
    if mix is None:
        capped = (
            f" (vram_budget {_fmt(requested)} capped to the {_fmt(state.limit)} the device "
            f"can give: {_fmt(state.available)} free beside {_fmt(baseline)} held)"
            if budget < requested
            else ""
        )
        where = ", its hidden states on the host" if host_residual else ""
        what = (
            f"one page of K/V ({_fmt(unit)} for {config.kv_page_tokens} tokens"
            if paged
            else f"one layer's K/V ({_fmt(unit)} for {capacity} tokens"
        )
        streamed = (
            f" plus one layer's weights streamed ({_fmt(weight_bytes)})" if weight_layers else ""
        )
        raise RevivaOutOfMemoryError(
            f"RevivaManager: the budget of {_fmt(budget)}{capped} cannot hold what is "
            f"already on the device ({_fmt(baseline)}: weights and buffers) plus the working "
            f"set of a {prompt_tokens}-token prompt ({_fmt(working)} at {chunk}-token "
            f"chunks{where}) plus {what}, batch {batch}){streamed}: "
            f"{_fmt(baseline + working + unit + (weight_bytes if weight_layers else 0))} needed. "
            "Raise vram_budget, "
            + ("lower kv_page_tokens or chunk_tokens" if paged else "lower chunk_tokens")
            + ", or shorten the prompt."
        )
    resident_full, resident_rings, staged, weight_resident, weight_slots = mix
    resident = resident_full + resident_rings
    full_ids = [i for i in range(n) if i not in ring_ids]
    resident_ids = tuple(
        sorted(
            [full_ids[k] for k in spread(resident_full, len(full_ids))]
            + [ring_ids[k] for k in spread(resident_rings, len(ring_ids))]
        )
    )
    if resident >= n:
        slots, page_slots, prefetch = 0, 0, window
    else:
        slots, page_slots = (0, staged) if paged else (staged, 0)
        prefetch = min(window, staged - 1)
    plan = Plan(
        budget=budget,
        requested_budget=requested,
        device_limit=state.limit,
        baseline=baseline,
        batch=batch,
        prompt_tokens=prompt_tokens,
        capacity=capacity,
        chunk_tokens=int(chunk),
        whole_attention=whole_attention,
        kv_token_bytes=kv_token,
        layer_kv_bytes=layer_kv,
        working_set=working,
        decode_working_set=decode + decode_margin,
        margin=margin,
        decode_slots=min(
            slots,
            model.decode_slots_with_streamed_weights
            if weight_layers > weight_resident
            else model.decode_slots,
        ),
        resident_layers=resident_ids,
        slots=slots,
        prefetch_layers=prefetch,
        num_layers=n,
        residual_on_host=host_residual,
        kv_fp8=fp8,
        kv_block_tokens=block_tokens,
        kv_decode_block_tokens=decode_block_tokens,
        kv_fp8_shadow_bytes=shadow,
        hidden_bytes_per_token=lay.hidden_size * e,
        page_tokens=config.kv_page_tokens if page_slots else 0,
        page_bytes=page_bytes if page_slots else 0,
        page_slots=page_slots,
        weight_layers=weight_layers,
        weight_layer_bytes=weight_bytes if weight_layers else 0,
        weight_resident_layers=spread(weight_resident, weight_layers) if weight_layers else (),
        weight_slots=weight_slots,
        weight_decode_slot_bytes=weight_decode_slot if weight_layers else 0,
        # as wide as the slots: the last of the window comes in as a layer is released (Note
        # [Streamed weights] in src/weight_store.cpp)
        weight_prefetch_layers=min(window, weight_slots),
        past_tokens=past_tokens,
        ring_tokens=ring_tokens,
        ring_layers=ring_ids,
        ring_kv_bytes=ring_kv,
    )
    host_cap = config.host_memory_bytes()
    pinned = plan.pinned_host_bytes
    if host_cap and pinned > host_cap:
        residual = (
            f" and the prompt's hidden states {_fmt(plan.residual_host_bytes)}"
            if host_residual
            else ""
        )
        raise RevivaOutOfMemoryError(
            f"RevivaManager: {plan.streamed_layers} streamed layers need {_fmt(plan.host_bytes)}"
            f"{residual} of pinned host memory for {capacity} tokens, over host_memory="
            f"{_fmt(host_cap)}. Raise host_memory or vram_budget, or shorten the prompt."
        )
    if host is not None and pinned > host.available:
        raise RevivaOutOfMemoryError(
            f"RevivaManager: {plan.streamed_layers} streamed layers' K/V "
            + ("and the prompt's hidden states " if host_residual else "")
            + f"need {_fmt(pinned)} of pinned host memory for {capacity} tokens, batch {batch}; "
            f"the host can give {_fmt(host.available)} ({_fmt(host.system_available)} available "
            f"to the system less {_fmt(host.reserve)} kept for the process, plus "
            f"{_fmt(host.pool_cached)} pinned and unused in Reviva's pool). Raise vram_budget, "
            "or shorten the prompt or the batch."
        )
    return plan


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


def _residency(
    avail: int,
    n: int,
    layer_kv: int,
    unit: int,
    window: int,
    weight_layers: int,
    weight_bytes: int,
    weight_slots: int,
    rings: int = 0,
    ring_kv: int = 0,
) -> tuple[int, int, int, int, int] | None:
    """How `avail` bytes are shared: (resident full K/V layers, resident rings, K/V staging
    units, resident weight layers, weight slots), or None when not even the least of each fits.
    K/V streams through up to window + 1 units (pages, or whole layers: the largest that
    streams) of staging room, narrowed before failing; streamed weights through weight_slots
    layers' room, narrowed to one where the rest does not fit. `n` full layers of layer_kv,
    `rings` ring layers of ring_kv (Note [Window rings] in kv_cache.py): rings are kept first
    (a byte kept saves a byte a step either way, and a ring is a whole layer fewer streamed
    for fewer bytes), and where every full layer stays the slots are a ring's. Of the mixes,
    the one with the most bytes resident, then the most weights (make_plan's docstring says
    why): so a second weight slot is given up where a layer more stays resident with one
    (MemoryModel.weight_slots)."""

    def staged_for(room: int, size: int) -> int | None:
        staged = window + 1
        while staged > 1 and room < staged * size:
            staged -= 1  # a narrower window before failing: still correct, less overlap
        return staged if room >= staged * size else None

    best: tuple[tuple[int, int, int], tuple[int, int, int, int, int]] | None = None
    for w in range(weight_layers, -1, -1):
        room = avail - w * weight_bytes
        wslots = 0
        if w < weight_layers:
            wslots = weight_slots
            while wslots > 1 and room - wslots * weight_bytes < min(unit, ring_kv or unit):
                wslots -= 1
            room -= wslots * weight_bytes
        if room < 0:
            continue
        options: list[tuple[int, int, int]] = []  # (full, rings, staged)
        if room >= n * layer_kv + rings * ring_kv:
            options.append((n, rings, 0))
        else:
            if rings and room >= n * layer_kv:  # every full layer kept: ring-sized slots
                staged = staged_for(room - n * layer_kv, ring_kv)
                if staged is not None:
                    left = room - n * layer_kv - staged * ring_kv
                    options.append((n, min(rings, left // ring_kv), staged))
            if n:  # full layers stream: slots of a full layer's, rings kept first
                staged = staged_for(room, unit)
                if staged is not None:
                    left = room - staged * unit
                    kept_rings = min(rings, left // ring_kv) if rings else 0
                    left -= kept_rings * ring_kv
                    options.append((min(n, left // layer_kv), kept_rings, staged))
        for full, kept_rings, staged in options:
            held = w * weight_bytes + full * layer_kv + kept_rings * ring_kv
            key = (held, w, full + kept_rings)  # (as much held: more weights, then more layers)
            if best is None or key > best[0]:
                best = (key, (full, kept_rings, staged, w, wslots))
    return None if best is None else best[1]


@dataclass(frozen=True)
class HostDecodeMix:
    """Note [Weights first when the host attends] (decode_placement.py): decode's room shared with
    decode's streamed K/V attended on the host."""

    weights_promoted: int  # weight layers made resident for decode
    kv_promoted: int  # K/V layers made resident with the rest (weight-resident layers first)
    host_exposed_layers: int  # weight-resident layers whose K/V is attended on the host
    step_s: float  # the step's copies and the host's time not under them (the model's estimate)
    host_s: float  # all the host's attention time of a step


def host_decode_mix(plan: Plan, model: MemoryModel = MODEL) -> HostDecodeMix:
    """Note [Weights first when the host attends] (decode_placement.py): how the room prefill
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


# Note [Window rings] (kv_cache.py): a ring holds a window and room for the most tokens written
# at once after it (a prefill chunk, or assisted decoding's candidates: RING_SLACK_TOKENS at least)
RING_SLACK_TOKENS = 256


def rings_wanted() -> bool:
    """Note [Window rings] (kv_cache.py): whether calls keep sliding layers as rings
    (REVIVA_WINDOW_RINGS=0 keeps every token, to compare)."""
    return switches.window_rings()


def window_ring_tokens(layout: DecoderLayout, capacity: int, chunk: int) -> int:
    """The tokens of each sliding layer's ring for a call of `capacity` tokens in `chunk`-token
    prefill chunks (Note [Window rings] in kv_cache.py), or 0 where no layer gains from one: no
    sliding layer, windows of more than one length (HF's masks take one per call), or a ring
    no shorter than the call."""
    windows = {w for w in layout.windows if w is not None}
    if len(windows) != 1:
        return 0
    (w,) = windows
    ring = w - 1 + max(chunk, RING_SLACK_TOKENS)
    return ring if ring < capacity else 0


def spread(count: int, total: int) -> tuple[int, ...]:
    """`count` layer indices out of `total`, evenly spread, so that streamed layers' copies
    overlap the compute of resident layers between them."""
    if count >= total:
        return tuple(range(total))
    if count <= 0:
        return ()
    return tuple(sorted({math.floor((k + 0.5) * total / count) for k in range(count)}))


def _round_up(n: int, unit: int) -> int:
    return (n + unit - 1) // unit * unit if unit > 0 else n
