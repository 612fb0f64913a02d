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
src/weight_store_residency.cpp; compute waits for a fill at the layer's acquire, not before), and
their addresses stay fixed, so the decode graphs of Note [Decode graphs] stay valid across calls;
streamed layers run eagerly (their device address changes with each use).

    weights = StreamedWeights(layout.layers, engine, arena, device)
    weights.set_residency([0, 5, 10], slots=2, prefetch_layers=1)
    weights.acquire(3); ...; weights.release(3)

Packing a layer into blocks is weights/packing.py's (Note [Layers in parts]), the routed experts'
decode forward weights/routed_experts.py's (Note [Routed experts]), the embedding on the host
weights/host_embedding.py's (Note [Embedding on the host]).
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable

import torch
from torch import nn

from reviva._C import DeviceArena, RevivaOutOfMemoryError, TransferEngine, WeightStore
from reviva.weights.host_heap import _trim_host_heap
from reviva.weights.packing import (
    _block_bytes,
    _decode_blocks,
    _mlp_pieces,
    _pack,
    _round_up,
    _Slot,
    decode_slot_bytes,
)
from reviva.weights.routed_experts import (
    RoutedExpertsForward,
    routed_experts,
)
from reviva.weights.writes import WeightWrites

log = logging.getLogger("reviva.weights")  # (the name users filter on)

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


class StreamedWeights(RoutedExpertsForward, WeightWrites):
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
        self.arena = arena  # (close() unmaps the store's memory before parameters go back)
        seen: dict[int, int] = {}
        self._slots: list[list[_Slot]] = []  # per block (a layer's parts, in order)
        self._slot_names: list[list[str]] = []  # per block: its parameters' names, for errors
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
            self._slot_names.extend(
                [f"{name} of decoder layer {i}" for name, _ in part] for part in parts
            )
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
        # per block, per slot: where the parameter was when packed (close() puts it back there)
        self._origins = [[slot.param.device for slot in slots] for slots in self._slots]
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
        # Note [The user's streamed parameters]: each parameter as pointed, to find writes by
        self._seen: list[list[tuple[nn.Parameter, int, int]]] = [[] for _ in self._slots]
        for b in range(len(self._slots)):
            self._mark(b)
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
        self._mark(b)

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
        self.remove_hooks()

    def remove_hooks(self) -> None:
        """The layers' hooks and the experts' forwards gone: HF's own modules again."""
        for h in getattr(self, "_hooks", ()):
            h.remove()
        self._hooks = []
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
