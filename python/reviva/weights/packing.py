"""A decoder layer's parameters packed into blocks of the WeightStore (Note [Layers in parts]):
which block each parameter goes to, at which offset, and the device bytes the blocks take (a
whole layer's, and decode's room of two blocks). StreamedWeights (weights/streamed.py) packs by
these; the planner sizes streamed weights by layer_weight_bytes and decode_slot_bytes."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from reviva.weights.routed_experts import _expert_bytes, routed_experts

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
    train/finetune.py), in two blocks (attention, MLP), none per expert or projection."""
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
