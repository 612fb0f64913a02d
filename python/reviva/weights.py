"""StreamedWeights: a decoder's layer weights in pinned host memory, brought to the device per use.

Each decoder layer's parameters are packed into its blocks (reviva._C.WeightStore: Note [Streamed
weights] in src/weight_store.cpp), whose pinned host copy becomes the parameters' storage: after
packing, `param.data` is a view of the host copy, and the memory they had (a CPU model's, or the
device's) is given back, layer by layer, so that loading never holds two copies of the model. A
layer whose parameters are on the meta device gets host views too, and `fill_layer(i, layer)`
writes their values there (from a checkpoint, or random).

Each layer is one block of the store, or two (its attention, then its MLP: Note [Layers in two
parts]). Around a layer's use the manager calls `acquire(i)` and `release(i)`: the parameters then
point at the layer's device copy, and back at the host copy after. Resident layers (set_residency,
from each call's plan) point at their device copy from their first acquire on (their fills are
issued as compute comes near them: Note [Resident fills as compute nears] in
src/weight_store.cpp; compute waits for a fill at the layer's acquire, not before), and their
addresses stay fixed, so the decode graphs of Note [Decode graphs] stay valid across calls;
streamed layers run eagerly (their device address changes with each use).

    weights = StreamedWeights(layout.layers, engine, arena, device)
    weights.set_residency([0, 5, 10], slots=2, prefetch_layers=1)
    weights.acquire(3); ...; weights.release(3)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from reviva import switches
from reviva._C import DeviceArena, RevivaOutOfMemoryError, TransferEngine, WeightStore

log = logging.getLogger(__name__)

# Parameters start at multiples of this in a layer's block (vectorized kernels' alignment).
_ALIGN = 256


@dataclass(frozen=True)
class _Slot:
    """Where one parameter (module._parameters[name]) lives in its layer's block."""

    module: nn.Module
    name: str
    offset: int
    nbytes: int

    @property
    def param(self) -> nn.Parameter:
        return self.module._parameters[self.name]


def _trim_host_heap() -> None:
    """Gives the C heap's free memory back to the system (glibc's malloc_trim): the CPU
    tensors just freed may sit in the heap (malloc's mmap threshold grows with large frees), and
    a model larger than half the host must not hold it twice. Nothing where there is no glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _round_up(n: int, unit: int) -> int:
    return (n + unit - 1) // unit * unit


# What a decoder layer runs from its MLP's start on (Gemma 2/3 normalize the MLP's output too).
_MLP_PART = ("mlp.", "post_feedforward_layernorm.")

# MLPs whose projections are used one after the other, in this order, each once per forward
# (HF's gated MLPs: down(act(gate(x)) * up(x)), Phi-3's gate_up then down): each projection is a
# block of its own (Note [Layers in parts]).
_MLP_PIECES = (("gate_proj", "up_proj", "down_proj"), ("gate_up_proj", "down_proj"))


def _mlp_pieces(layer: nn.Module) -> tuple[str, ...]:
    """The names of the layer's MLP projections that are blocks of their own, in the order the
    MLP uses them (Note [Layers in parts]); () when the MLP is one block (experts, or any other
    MLP: what it runs, and in which order, is not known here)."""
    mlp = getattr(layer, "mlp", None)
    if mlp is None or any(True for _ in mlp.parameters(recurse=False)):
        return ()
    owners = tuple(n for n, m in mlp.named_children() if any(True for _ in m.parameters()))
    if owners not in _MLP_PIECES:
        return ()
    if not all(type(getattr(mlp, n)) is nn.Linear for n in owners):
        return ()
    return owners


# What a decoder layer runs before its MLP (Note [Routed experts]: nothing of the layer may run
# after its experts, whose block's views are the last a decode step takes).
_BEFORE_MLP = frozenset({"self_attn", "input_layernorm", "post_attention_layernorm"})


def _owners(module: nn.Module) -> set[str]:
    return {n for n, m in module.named_children() if any(True for _ in m.parameters())}


def routed_experts(layer: nn.Module) -> nn.Module | None:
    """The layer's experts module where a decode step can take only the experts its router
    chooses (Note [Routed experts]): an MLP of a router (`gate`) and HF's experts module, whose
    parameters are gate_up_proj [E, 2I, H] and down_proj [E, H, I] (no bias, not transposed,
    gated), in a layer whose other parts all run before the MLP (Mixtral, Qwen3-MoE). None
    otherwise, and with REVIVA_ROUTED_EXPERTS=0 (a baseline for benchmarks): the MLP is then one
    block (and every expert moves)."""
    if not switches.routed_experts():
        return None
    mlp = getattr(layer, "mlp", None)
    experts = getattr(mlp, "experts", None)
    if experts is None or not _owners(layer) <= _BEFORE_MLP | {"mlp"}:
        return None
    if any(True for _ in mlp.parameters(recurse=False)) or _owners(mlp) != {"gate", "experts"}:
        return None
    params = dict(experts.named_parameters())
    if set(params) != {"gate_up_proj", "down_proj"}:
        return None
    gu, dn = params["gate_up_proj"], params["down_proj"]
    e = getattr(experts, "num_experts", None)
    if gu.dim() != 3 or dn.dim() != 3 or gu.dtype != dn.dtype or not e or gu.shape[0] != e:
        return None
    if dn.shape[0] != e or gu.shape[1] != 2 * dn.shape[2] or gu.shape[2] != dn.shape[1]:
        return None
    if getattr(experts, "is_transposed", False) or getattr(experts, "has_bias", False):
        return None
    if not getattr(experts, "has_gate", True) or not callable(
        getattr(experts, "_apply_gate", None)
    ):
        return None
    return experts


def _expert_bytes(experts: nn.Module) -> tuple[int, int]:
    """One expert's gate_up and down projections' bytes (routed_experts' module)."""
    e = experts.num_experts
    gate_up, down = (experts.gate_up_proj, experts.down_proj)
    return gate_up.numel() * gate_up.element_size() // e, down.numel() * down.element_size() // e


def routed_expert_sizes(layers: list[nn.Module]) -> tuple[int, int, int]:
    """(one expert's bytes, experts, experts each token chooses) of the first layer with routed
    experts (Note [Routed experts]), (0, 0, 0) where none has: what the planner forecasts a
    decode step's copies by."""
    for layer in layers:
        experts = routed_experts(layer)
        if experts is None:
            continue
        e = experts.num_experts
        k = getattr(layer.mlp.gate, "top_k", None) or getattr(layer.mlp, "top_k", None) or e
        return sum(_expert_bytes(experts)), e, int(k)
    return 0, 0, 0


def _part_of(name: str, pieces: tuple[str, ...]) -> int:
    """Note [Layers in parts]: the block of a parameter: 0 for the attention's (and the norms'),
    then the MLP's: one block, or one per projection in `pieces` (what runs after the MLP,
    _MLP_PART's norm, goes with the last)."""
    if not name.startswith(_MLP_PART):
        return 0
    for k, piece in enumerate(pieces):
        if name.startswith(f"mlp.{piece}."):
            return 1 + k
    return max(len(pieces), 1)


def _pack(
    layer: nn.Module, granularity: int = 1, frozen_only: bool = False
) -> list[list[tuple[str, _Slot]]]:
    """The layer's packing (Note [Layers in parts]): its parameters by block, the attention's
    (and the norms') then the MLP's, empty blocks left out; each (name, slot) at its offset in
    its block, aligned to _ALIGN, in module order. The MLP's projections are blocks of their own
    only where two of the largest block (each rounded to `granularity`, the arena's granule) are
    less than the whole layer; else the MLP is one block. `frozen_only`: the parameters that
    need no gradient alone (a fine-tune's base weights: Note [Streamed fine-tuning] in
    finetune.py), in two blocks (attention, MLP), none per expert or projection."""
    if frozen_only:
        return _pack_by(layer, (), frozen_only=True)
    if routed_experts(layer) is not None:  # Note [Routed experts]: the experts alone, then
        return _pack_by(layer, (), routed=True)
    pieces = _mlp_pieces(layer)
    parts = _pack_by(layer, pieces)
    if pieces:
        sizes = [_round_up(_block_bytes([slot for _, slot in p]), granularity) for p in parts]
        if 2 * max(sizes) >= sum(sizes):
            parts = _pack_by(layer, ())
    return parts


def _pack_by(
    layer: nn.Module, pieces: tuple[str, ...], routed: bool = False, frozen_only: bool = False
) -> list[list[tuple[str, _Slot]]]:
    parts: list[list[tuple[str, _Slot]]] = [[] for _ in range(1 + max(len(pieces), 1))]
    ends = [0] * len(parts)
    for prefix, module in layer.named_modules():
        for key, p in module._parameters.items():
            if p is None or (frozen_only and p.requires_grad):
                continue
            name = f"{prefix}.{key}" if prefix else key
            k = int(name.startswith("mlp.experts.")) if routed else _part_of(name, pieces)
            offset = _round_up(ends[k], _ALIGN)
            nbytes = p.numel() * p.element_size()
            parts[k].append((name, _Slot(module, key, offset, nbytes)))
            ends[k] = offset + nbytes
    return [part for part in parts if part]


def _block_bytes(slots: list[_Slot]) -> int:
    return slots[-1].offset + slots[-1].nbytes


def layer_weight_bytes(layer: nn.Module, granularity: int = 1) -> int:
    """Device bytes of a decoder layer's packed weights: its blocks (Note [Layers in parts]),
    parameters aligned as StreamedWeights packs them, each block rounded up to `granularity` (the
    arena's mapping granule: each block is a buffer of its own)."""
    return sum(
        _round_up(_block_bytes([slot for _, slot in part]), granularity)
        for part in _pack(layer, granularity)
    )


def _decode_blocks(layer: nn.Module, granularity: int = 1) -> list[int]:
    """The bytes of the blocks a decode step takes of a streamed layer, each rounded to
    `granularity`: its parts (Note [Layers in parts]), or, for routed experts, its first part
    and one expert's gate_up and down projections (Note [Routed experts])."""
    parts = _pack(layer, granularity)
    sizes = [_round_up(_block_bytes([slot for _, slot in p]), granularity) for p in parts]
    experts = routed_experts(layer)
    if experts is None:
        return sizes
    return [sizes[0], *(_round_up(b, granularity) for b in _expert_bytes(experts))]


def decode_slot_bytes(layers: list[nn.Module], granularity: int = 1) -> int:
    """The room streamed weights need in a decode step (Note [Layers in parts]): two of the
    largest block a step takes (rounded to `granularity`; Note [Routed experts]: an expert's
    projection, not all experts), or the largest whole layer where that is less."""
    blocks = [b for layer in layers for b in _decode_blocks(layer, granularity)]
    whole = max(layer_weight_bytes(layer, granularity) for layer in layers)
    return min(2 * max(blocks), whole)


# Note [Decode rooms when the host attends]
# A decode step with attention on the host (Note [Attention on the host] in
# src/host_attention.cpp) blocks the Python thread in each host-attended layer: it waits for the
# layer's queries, then attends on the host's cores (~2.5 ms a 32k bf16 layer on the H200), and
# only then reaches the MLP's first projection, whose pre-hook acquires its block, which is
# where the store issues the next block's copy (Note [Layers in parts]: a window of one block in a
# room of two). So with two rooms, each streamed layer's copies stop for about the host's time
# less one block's copy: the H200 at 6bd5b9d ran card8_8b at 4.83-4.93 tok/s, 0.84-0.86 of its
# 5.73 roofline, with the copy engine idle ~0.7 ms per streamed layer. HOST_DECODE_ROOMS blocks of
# room with a window of one less keep two blocks' copies queued while the host works (two of
# Llama-3-8B's 112 MiB projections take ~4.3 ms at 55 GB/s, the host ~2.5 ms); the third block
# is room a step does not keep resident (one block's copy a step), which the planner counts
# (planner.host_decode_mix).
DECODE_ROOMS = 2
HOST_DECODE_ROOMS = 3


# Note [Layers in parts]
# A decoder layer's weights are several blocks of the WeightStore: its attention (and norms),
# then its MLP, as one block, or, for the gated MLPs whose projections run one after the other
# (_MLP_PIECES: gate, up, down; Phi-3's gate_up, down), one block per projection (what runs after
# the MLP, Gemma's post-MLP norm, goes with the last). A prefill runs the MLP once per chunk, so
# it acquires every block at the layer's start, and the store's slot holds a whole layer; so
# does any call that is not a decode step. A decode step acquires the attention's block, and at
# each next block's first use (a forward pre-hook on layer.mlp, or on each projection) releases
# the one before and acquires it: the next block is copied into the memory just freed while
# this one computes. So decode needs room for two blocks, not a whole layer
# (StreamedWeights.enter_decode lowers the store's slot to two of the largest block, each
# streamed block's buffer of that one size: ArenaDeviceAllocator::set_min_bytes), and what that
# frees keeps more K/V resident: Llama-3-8B's layer is 416 MiB (attention 80, each projection
# 112), its decode room 224 MiB. With the layer whole in one block, one slot left the copy engine
# idle while each streamed layer computed (the next layer's copy waits for that memory): 0.97 of
# the roofline on the H200 at 067decd, the 3% being about the streamed layers' compute time.


# Note [Routed experts]
# A mixture-of-experts layer (Mixtral, Qwen3-MoE: routed_experts) runs, per token, only the top-k
# experts its router chooses, but its experts are one block, as HF keeps them ([E, ...] tensors
# that its experts forward indexes or hands to a grouped matmul), so a decode step that took the
# block moved every expert: Mixtral-8x7B's layer is 2.9 GB of which a token uses 0.8. So a
# streamed MoE layer is two blocks, its first (attention, norms and the router) and its
# experts', and each expert's gate_up and down projections are also views of the store (Note
# [Blocks within a block] in src/weight_store.cpp: ranges of the experts' host copy, no memory
# of their own). A prefill takes both blocks whole and runs HF's own experts forward (most
# experts see some of a long prompt's tokens). A decode step takes the first block, and HF's
# experts forward is replaced there (an instance attribute on the experts module, forwarding to
# HF's own everywhere else) by `_routed_forward`: it gives the first block back (the router
# ran), learns which experts were chosen (one synchronization: the host must know what to
# fetch), and takes each chosen expert's gate_up view, then its down view, one at a time, into
# decode's room of two blocks (the store fetches a view at its acquire and lets it go at its
# release). Its arithmetic is HF's grouped_mm experts forward (HF's default: rows sorted by
# expert, each expert's rows through its projections, weights applied, a sum over the top-k)
# done expert by expert. A step then moves the attention's bytes and the chosen experts' (2 of
# 8 experts: about a quarter of Mixtral's layer); the experts' whole block stays out of
# decode's cycle (WeightStore.set_on_demand), and decode's room is two of the largest of those
# blocks.


class StreamedWeights:
    """The parameters of `layers` in a WeightStore; see the module docstring."""

    def __init__(
        self,
        layers: list[nn.Module],
        engine: TransferEngine,
        arena: DeviceArena,
        device: torch.device,
        fill_layer: Callable[[int, nn.Module], None] | None = None,
        timeline_capacity: int = 0,
        frozen_only: bool = False,
    ) -> None:
        """frozen_only: only the parameters that need no gradient stream (a fine-tune's base
        weights); the others (LoRA's, a norm being trained) stay where they are."""
        self.device = device
        seen: dict[int, int] = {}
        self._slots: list[list[_Slot]] = []  # per block (a layer's parts, in order)
        self._parts: list[list[int]] = []  # per layer: its blocks
        for i, layer in enumerate(layers):
            parts = _pack(layer, int(arena.granularity), frozen_only)
            for name, slot in (entry for part in parts for entry in part):
                p = slot.param
                if id(p) in seen:
                    raise ValueError(
                        f"StreamedWeights: parameter {name} of decoder layer {i} is shared "
                        f"with layer {seen[id(p)]}; layers with shared weights cannot stream "
                        "them"
                    )
                seen[id(p)] = i
            if not parts:
                raise ValueError(f"StreamedWeights: decoder layer {i} has no parameters")
            self._parts.append(list(range(len(self._slots), len(self._slots) + len(parts))))
            self._slots.extend([slot for _, slot in part] for part in parts)
        if fill_layer is None:  # (before anything moves: a model is never left half packed)
            for i, blocks in enumerate(self._parts):
                if any(slot.param.is_meta for b in blocks for slot in self._slots[b]):
                    raise ValueError(
                        f"StreamedWeights: decoder layer {i} has parameters on the meta device: "
                        "pass fill_layer(index, layer) to write their values"
                    )
        block_bytes = [_block_bytes(slots) for slots in self._slots]
        granule = int(arena.granularity)
        # each layer's packed bytes (its parts'), and what its parts map on the device
        self.layer_bytes = [sum(block_bytes[b] for b in blocks) for blocks in self._parts]
        self.layer_device_bytes = [
            sum(_round_up(block_bytes[b], granule) for b in blocks) for blocks in self._parts
        ]
        # the parameters' own bytes (without the packing's alignment), as torch counts them
        self.param_bytes = sum(slot.nbytes for slots in self._slots for slot in slots)
        # Note [Routed experts]: per routed layer, its experts module, E, and its views' first
        # index in the store (expert e's gate_up at first + 2e, its down at first + 2e + 1)
        self._routed: dict[int, tuple[nn.Module, int, int]] = {}
        views: list[tuple[int, int, int]] = []
        for i, layer in enumerate(layers):
            experts = None if frozen_only else routed_experts(layer)
            if experts is None:
                continue
            b = self._parts[i][1]
            at = {slot.name: slot for slot in self._slots[b] if slot.module is experts}
            e = experts.num_experts
            self._routed[i] = (experts, e, len(self._slots) + len(views))
            gu, dn = at["gate_up_proj"], at["down_proj"]
            for k in range(e):
                views.append((b, gu.offset + k * (gu.nbytes // e), gu.nbytes // e))
                views.append((b, dn.offset + k * (dn.nbytes // e), dn.nbytes // e))
        self.store = WeightStore(
            engine,
            arena,
            block_bytes,
            timeline_capacity,
            slot_bytes=max(self.layer_device_bytes),
            views=views,
        )
        self.origin_host = time.perf_counter()  # (its timeline's origin: Note [Traces])
        self._host_views: list[list[torch.Tensor]] = []  # per block
        self._resident_blocks: set[int] = set()  # the blocks set_residency keeps on the device
        # resident blocks' device copies, from their first acquire (their fill's issue) on
        self._device_views: dict[int, torch.Tensor] = {}
        meta = []
        with torch.no_grad():
            for i, layer in enumerate(layers):
                was_meta = False
                for b in self._parts[i]:
                    host = self.store.host(b)
                    views = []
                    for slot in self._slots[b]:
                        p = slot.param
                        view = (
                            host[slot.offset : slot.offset + slot.nbytes]
                            .view(p.dtype)
                            .view(p.shape)
                        )
                        if p.is_meta:  # (a meta tensor's data cannot be set: a new parameter)
                            was_meta = True
                            slot.module._parameters[slot.name] = nn.Parameter(
                                view, requires_grad=p.requires_grad
                            )
                        else:
                            view.copy_(p.data)  # (from the device: synchronous)
                            p.data = view  # the memory p held goes back once nothing refers to it
                        views.append(view)
                    self._host_views.append(views)
                if not was_meta:
                    _trim_host_heap()  # (layer by layer: the peak is the model and one layer)
                for module in layer.modules():  # buffers are small: they live on the device
                    for key, buf in module._buffers.items():
                        if buf is not None:
                            if buf.is_meta:
                                raise ValueError(
                                    f"StreamedWeights: a buffer ({key}) of decoder layer {i} is on "
                                    "the meta device; only parameters are filled by fill_layer"
                                )
                            module._buffers[key] = buf.to(device)
                if was_meta:
                    meta.append(i)
                    assert fill_layer is not None  # (checked above)
                    fill_layer(i, layer)
        if meta:
            log.info("reviva: %d decoder layers filled by fill_layer", len(meta))
        self._acquired: dict[int, torch.Tensor] = {}  # streamed blocks acquired, by block
        self._held: dict[int, list[int]] = {}  # acquired layers: their blocks acquired now
        # layers taken one block at a time in this use (a decode step): the blocks still to come
        self._next_parts: dict[int, list[int]] = {}
        self.in_call = False  # RevivaManager's wrappers are installed: they acquire each layer
        # A layer run outside RevivaManager's calls (model(...) or model.generate without the
        # manager) while its parameters are views of the host copy would fail inside its first
        # matmul with a device mismatch; this says why, by name.
        self._hooks = [
            layer.register_forward_pre_hook(self._outside_a_call(i))
            for i, layer in enumerate(layers)
        ]
        self._views_held: dict[int, int] = {}  # routed layers: the view acquired now, by layer
        self._routing: set[int] = set()  # routed layers taken in blocks now (a decode step)
        for i, (experts, _, _) in self._routed.items():
            experts.forward = self._experts_forward(i, experts.forward)
        for i, layer in enumerate(layers):  # Note [Layers in parts]: where each block starts
            parts = self._parts[i]
            if len(parts) < 2 or i in self._routed:
                continue
            pieces = _mlp_pieces(layer) if len(parts) > 2 else ()
            starts = [getattr(layer.mlp, n) for n in pieces] if pieces else [layer.mlp]
            for b, module in zip(parts[1:], starts, strict=True):
                self._hooks.append(module.register_forward_pre_hook(self._block_starts(i, b)))
        granule = int(arena.granularity)
        # Note [Layers in parts]: decode's room for streamed weights, and each block's buffer there
        self.decode_slot_bytes = decode_slot_bytes(layers, granule)
        largest = max(b for layer in layers for b in _decode_blocks(layer, granule))
        self._decode_block_bytes = largest if self.decode_slot_bytes == 2 * largest else 0
        self._decode_rooms = 0  # blocks of decode's room (enter_decode; 0: not in decode)

    def _outside_a_call(self, i: int) -> Callable[..., None]:
        ref = weakref.ref(self)  # (the model's hooks must not keep the weights' owner alive)

        def hook(module: nn.Module, args: object) -> None:
            weights = ref()
            if weights is None or weights.in_call or weights.device.type == "cpu":
                return
            if i not in weights._held and weights.on_host(i):
                raise RuntimeError(
                    f"decoder layer {i}'s weights live in pinned host memory (RevivaConfig("
                    "stream_weights)): run the model through RevivaManager.generate, which "
                    "brings them to the device as each layer runs"
                )

        return hook

    def _block_starts(self, i: int, b: int) -> Callable[..., None]:
        ref = weakref.ref(self)

        def hook(module: nn.Module, args: object) -> None:
            weights = ref()
            if weights is not None and i in weights._next_parts:
                weights._switch(i, b)

        return hook

    def _experts_forward(
        self, i: int, hf: Callable[..., torch.Tensor]
    ) -> Callable[..., torch.Tensor]:
        ref = weakref.ref(self)

        def forward(
            hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
        ) -> torch.Tensor:
            weights = ref()
            if weights is not None and i in weights._routing:
                return weights._routed_forward(i, hidden_states, top_k_index, top_k_weights)
            return hf(hidden_states, top_k_index, top_k_weights)

        return forward

    def _routed_forward(
        self, i: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """Note [Routed experts]: layer i's experts in a decode step, each chosen expert's
        projections brought in one at a time (HF's grouped_mm experts forward, expert by
        expert)."""
        experts, e, first = self._routed[i]
        self._routing.discard(i)  # (once per use of the layer)
        for b in self._held.get(i, []):  # the router ran: the first block's work is queued
            self._release_block(b)
        self._held[i] = []
        gu_shape = experts.gate_up_proj.shape[1:]
        dn_shape = experts.down_proj.shape[1:]
        dtype = experts.gate_up_proj.dtype
        k = top_k_index.size(-1)
        ids, order = torch.sort(top_k_index.reshape(-1))
        rows = hidden[order // k].to(dtype)
        counts = torch.bincount(ids, minlength=e).tolist()  # (the host fetches what was chosen)
        out = torch.empty(rows.shape[0], hidden.shape[-1], dtype=dtype, device=hidden.device)
        start = 0
        for expert, n in enumerate(counts):
            if n == 0:
                continue
            end = start + n
            gate_up = self._take_view(i, first + 2 * expert).view(dtype).view(gu_shape)
            h = torch.mm(rows[start:end], gate_up.t())
            self._drop_view(i)
            h = experts._apply_gate(h)
            down = self._take_view(i, first + 2 * expert + 1).view(dtype).view(dn_shape)
            out[start:end] = torch.mm(h, down.t())
            self._drop_view(i)
            start = end
        weighted = out * top_k_weights.reshape(-1)[order].unsqueeze(-1)
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=order.device)
        tokens = hidden.shape[0]
        return weighted[back].view(tokens, k, -1).sum(dim=1).to(hidden.dtype)

    def _take_view(self, i: int, v: int) -> torch.Tensor:
        block = self.store.acquire(v)
        self._views_held[i] = v
        return block

    def _drop_view(self, i: int) -> None:
        self.store.release(self._views_held.pop(i))

    def _switch(self, i: int, b: int) -> None:
        """Block b of layer i starts (Note [Layers in parts]): the block before it goes, b comes."""
        coming = self._next_parts[i]
        if not coming or coming[0] != b:
            raise RuntimeError(
                f"decoder layer {i}: block {b} of its weights started out of the order a decode "
                f"step streams them in (expected {coming[0] if coming else 'none'}): its MLP "
                "runs its projections in another order than Note [Layers in parts] assumes"
            )
        coming.pop(0)
        if not coming:
            del self._next_parts[i]
        for held in self._held[i]:
            self._release_block(held)
        self._held[i] = []
        self._acquire_block(b)
        self._held[i] = [b]

    @property
    def num_layers(self) -> int:
        return len(self._parts)

    @property
    def parts(self) -> list[list[int]]:
        """Each layer's blocks in the store (Note [Layers in parts])."""
        return self._parts

    @property
    def total_bytes(self) -> int:
        return sum(self.layer_bytes)

    def resident(self, i: int) -> bool:
        """Whether layer i's weights stay on the device (set_residency), filled yet or not."""
        return all(b in self._resident_blocks for b in self._parts[i])

    def on_host(self, i: int) -> bool:
        """Whether layer i's parameters are views of its pinned host copy now."""
        return all(
            slot.param.data_ptr() == host.data_ptr()
            for b in self._parts[i]
            for slot, host in zip(self._slots[b], self._host_views[b], strict=True)
        )

    def _point(self, b: int, block: torch.Tensor | None) -> None:
        """Block b's parameters become views of `block` (its device copy), or of its host copy."""
        for slot, host in zip(self._slots[b], self._host_views[b], strict=True):
            p = slot.param
            if block is None:
                p.data = host
            else:
                p.data = block[slot.offset : slot.offset + slot.nbytes].view(p.dtype).view(p.shape)

    def set_residency(self, resident: list[int], slots: int, prefetch_layers: int) -> None:
        """Which layers' weights stay on the device from now on, and the streamed ones' room (in
        layers) and window (WeightStore.set_residency, in blocks: a layer's parts). Layers that
        stop being resident point at their host copy again; new resident layers point at their
        device copy from their first acquire on (the store issues their fills as compute comes
        near them, and compute waits for a fill only when it acquires the layer). A call starts
        with a prefill: the slots hold whole layers again (Note [Layers in parts]; enter_decode
        lowers them)."""
        if self._decode_rooms:
            # (decode's one-block slots, HOST_DECODE_ROOMS of them: one first, at a block's
            # bytes, so that raising the slot to a whole layer maps one layer's room, not that
            # many layers': on the H200 at 5ce5c4c the 32B shape's call after a host-attended one
            # prefetched three whole layers there and ran out of memory on a 24 GB card)
            self.store.set_residency(sorted(self._resident_blocks), 1, 1)
            self._decode_rooms = 0
        self.store.set_on_demand([])  # (a prefill takes the experts' whole blocks in the cycle)
        self.store.set_slot_bytes(max(self.layer_device_bytes), 0)
        wanted = {b for i in resident for b in self._parts[i]}
        for b in list(self._device_views):
            if b not in wanted:
                self._point(b, None)
                del self._device_views[b]
        most = max(len(p) for p in self._parts)
        window = min(prefetch_layers * most, slots)
        self._resident_blocks = set()  # (set_residency may raise: then nothing stays)
        self.store.set_residency(sorted(wanted), slots, window if slots else 0)
        self._resident_blocks = wanted

    def set_order(self, layers: list[int]) -> None:
        """The layers one step uses, in use order, each as often as used (a training step:
        0..n-1 then n-1..0), each whole (its blocks in order): the store's prefetch cycle (Note
        [Declared orders] in src/weight_store.cpp); [] for every layer once in index order."""
        for i in layers:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.num_layers:
                raise ValueError(
                    f"StreamedWeights.set_order: layer {i!r} out of range [0, {self.num_layers})"
                )
        self.store.set_order([b for i in layers for b in self._parts[i]])

    def decode_room_bytes(self, rooms: int = DECODE_ROOMS) -> int:
        """Decode's room for streamed weights with `rooms` blocks (Note [Layers in parts]; Note
        [Decode rooms when the host attends]); the largest whole layer where the layer is not
        taken in blocks."""
        if self._decode_block_bytes == 0 or self.decode_slot_bytes >= max(self.layer_device_bytes):
            return self.decode_slot_bytes
        return rooms * self._decode_block_bytes

    def enter_decode(self, rooms: int = DECODE_ROOMS) -> int:
        """The call's prefill is over: from here on each streamed layer is taken one block at a
        time, so the slots are lowered to decode's room of `rooms` blocks (>= 2) with a window of
        one less (Note [Layers in parts]; Note [Decode rooms when the host attends]); streamed
        blocks on the device leave and the cycle starts again. Returns the device bytes given
        back (0 when nothing streams or a layer is not taken in blocks). Not while a layer is
        held."""
        if isinstance(rooms, bool) or not isinstance(rooms, int) or rooms < 2:
            raise ValueError(
                f"StreamedWeights.enter_decode: rooms must be an int >= 2, got {rooms!r}"
            )
        whole = max(self.layer_device_bytes)
        # Note [Routed experts]: the experts' whole blocks leave decode's cycle
        self.store.set_on_demand([self._parts[i][1] for i in self._routed])
        st = self.store.stats()
        if st["streamed_layers"] == 0 or self.decode_slot_bytes >= whole:
            return 0
        block = self._decode_block_bytes
        if rooms == DECODE_ROOMS:  # one slot of two blocks, a window of one block
            self.store.set_slot_bytes(self.decode_slot_bytes, block)
            if st["slots"] > 1:
                self.store.set_residency(sorted(self._resident_blocks), 1, 1)
        else:  # slots of one block each: the store's window counts slots (at most as many)
            self.store.set_slot_bytes(block, block)
            self.store.set_residency(sorted(self._resident_blocks), rooms, rooms - 1)
            self._decode_rooms = rooms
        return int(st["slots"]) * whole - rooms * block

    def promote(self, layers: list[int]) -> bool:
        """In decode (after enter_decode): `layers`, streamed now, stay on the device from here on
        beside the resident ones (their fills issued as compute nears them, one H2D each), the
        rest streaming through decode's room as before. False, with the residency as it was,
        when the arena cannot map them (WeightStore.set_residency). Not while a layer is held."""
        before = set(self._resident_blocks)
        wanted = before | {b for i in layers for b in self._parts[i]}
        if wanted == before:
            return True
        streams = len(wanted) < len(self._slots)  # (blocks)
        rooms, window = self._decode_slots()
        try:
            self.store.set_residency(
                sorted(wanted), rooms if streams else 0, window if streams else 0
            )
        except RevivaOutOfMemoryError:
            self.store.set_residency(sorted(before), rooms, window)
            self._resident_blocks = before
            return False
        self._resident_blocks = wanted
        return True

    def _decode_slots(self) -> tuple[int, int]:
        """The store's slots and window in this call's decode (enter_decode's: one slot (of two
        blocks, or a whole layer where the layer is not taken in blocks) and a window of one,
        or `rooms` slots of one block and a window of one less)."""
        return (self._decode_rooms, self._decode_rooms - 1) if self._decode_rooms else (1, 1)

    def _acquire_block(self, b: int) -> None:
        block = self.store.acquire(b)
        if b in self._resident_blocks:
            if b not in self._device_views:  # (its first acquire: its address is fixed now)
                view = self.store.resident_view(b)
                self._device_views[b] = view
                self._point(b, view)
        else:
            self._acquired[b] = block
            self._point(b, block)

    def _release_block(self, b: int) -> None:
        if b in self._acquired:
            self._point(b, None)
            del self._acquired[b]  # (the device block's memory is reused after compute's use)
        self.store.release(b)

    def acquire(self, i: int, whole: bool = True) -> None:
        """Layer i's parameters are on the device for compute on the current stream, until
        release(i). `whole=False` (a decode step, whose layer runs its MLP once): the attention's
        block now, each of the MLP's when it starts, the one before it then given back (Note
        [Layers in parts])."""
        parts = self._parts[i]
        split = not whole and len(parts) > 1 and not self.resident(i)
        take = parts[:1] if split else parts
        self._routing.discard(i)
        held: list[int] = []
        try:
            for b in take:
                self._acquire_block(b)
                held.append(b)
        except BaseException:
            for b in held:
                self._release_block(b)
            raise
        self._held[i] = held
        if split and i in self._routed:
            self._routing.add(i)  # (Note [Routed experts]: its experts come as views)
        elif split:
            self._next_parts[i] = list(parts[1:])

    def release(self, i: int) -> None:
        self._next_parts.pop(i, None)
        self._routing.discard(i)
        if i in self._views_held:  # (an expert's forward raised between its acquire and release)
            self._drop_view(i)
        for b in self._held.pop(i, []):
            self._release_block(b)

    def __del__(self) -> None:
        for h in getattr(self, "_hooks", ()):
            h.remove()
        for experts, _, _ in getattr(self, "_routed", {}).values():
            experts.__dict__.pop("forward", None)  # (HF's own forward again)

    def trim(self) -> None:
        """Between calls: the streamed layers' device memory goes back (resident layers stay)."""
        for i in list(self._held):
            self.release(i)
        self.store.trim()

    def stats(self) -> dict[str, object]:
        """The store's figures with layers counted as layers (the store counts blocks: a layer's
        parts); fills and bytes are the store's (a split layer comes in as two fills)."""
        st = dict(self.store.stats())
        resident = sum(1 for i in range(self.num_layers) if self.resident(i))
        st["resident_layers"] = resident
        st["streamed_layers"] = self.num_layers - resident
        st["prefetch_blocks"] = st.pop("prefetch_layers")
        st["routed_expert_layers"] = len(self._routed)
        return st


# Note [Embedding on the host]
# A decoder's input embedding is a table of vocab x hidden (1.56 GB for the 32B shape, 1.05 GB
# for the 8B one) of which a decode step reads one row per sequence. When the layers' weights
# stream, every byte of device memory is a byte a step need not copy, so the table moves to pinned
# host memory, from which the device reads the rows it needs in place (Backend::gather_rows_async:
# one kernel, the prompt's rows once, then a row per step; no host work and no synchronization in
# a step). At 067decd the rows were gathered on the host and copied, and the 32B shape's first
# 32k-token call spent 1.4 s more before its first layer than with the table on the device.
# The module's `weight` stays a parameter on the device, of the table's shape, over one element
# (an expanded view): `model.device` (HF reads the first parameter's) stays the compute device,
# and anything that would write into it fails loudly (an expanded tensor refuses in-place
# copies). Its state_dict entry is the host table. Only for an input embedding that is not tied
# to the output head (tied, the head reads the table every step: it stays on the device).


class HostEmbedding:
    """An nn.Embedding whose table lives in pinned host memory (Note [Embedding on the host])."""

    def __init__(
        self, embed: nn.Embedding, pool: object, runtime: object, device: torch.device
    ) -> None:
        if type(embed) is not nn.Embedding or embed.max_norm is not None:
            raise ValueError(
                f"HostEmbedding: a plain nn.Embedding without max_norm is needed, got "
                f"{type(embed).__name__}"
            )
        w = embed.weight
        self.embed = embed
        self.device = device
        self.runtime = runtime
        self.table = pool.tensor(list(w.shape), w.dtype)  # pinned
        with torch.no_grad():
            self.table.copy_(w.data)
        self.nbytes = w.numel() * w.element_size()
        w.data = torch.zeros((), dtype=w.dtype, device=device).expand(w.shape)
        self._state_hook = embed._register_state_dict_hook(self._state_dict_hook)
        embed.forward = self.forward  # (an instance attribute: the class's forward is shadowed)
        _trim_host_heap()
        if device.type == "cuda":
            # The table's device memory goes back to the driver, not to torch's cache: the arena
            # maps its own memory and cannot take what torch keeps cached (the H200 at 7657206:
            # 8-16 of an 8 GB card's promotions refused by the device, 1 GB of budget unused).
            torch.cuda.empty_cache()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows, width = self.table.shape
        ids = input_ids.to(self.device, torch.long).reshape(-1).contiguous()
        if input_ids.shape[-1] > 1 and ids.numel() > 0:
            # A prompt (or candidates): ids that did not come from this model's own sampling are
            # checked as nn.Embedding checks them (one synchronization per prompt; the kernel
            # would give zeros for them).
            lo, hi = torch.stack(torch.aminmax(ids)).tolist()  # (one synchronization)
            if lo < 0 or hi >= rows:
                raise IndexError(
                    f"token id {lo if lo < 0 else hi} is outside the input embedding's {rows} rows"
                )
        out = torch.empty((ids.numel(), width), dtype=self.table.dtype, device=self.device)
        # The device reads the rows from the pinned table in place, in stream order: no host
        # gather, no copy to stage, no synchronization in a decode step.
        self.runtime.gather_rows(self.table, ids, out)
        return out.view(*input_ids.shape, width)

    def _state_dict_hook(self, module: nn.Module, state: dict, prefix: str, meta: object) -> None:
        state[prefix + "weight"] = self.table
