"""The saved-tensor hooks of an activation offload (training.py): `_pack` adopts each eligible
storage saved for backward as a block of the offload's OffloadManager and offloads it at once
(a storage saved several times is copied once; an fp32 cast from 16 bits moves at 16 bits:
_cast_from), `_unpack` brings its block back and rebuilds the saved view on it; saved tensors'
versions are checked as autograd checks them (Note [Saved tensors' versions]).

SavedTensorHooks is a mixin of ActivationOffload. State it reads: the offload's device,
min_bytes, _param_ptrs, _input_ptrs, _layer, _regions, _in_backward, _offload_layers, _in_use
and manager. State it writes: stats (saved, kept, offloaded and narrowed tensors, bytes to
host, layers' saved bytes on the first step), _by_storage, _stored_of, _groups, _recorded.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

if TYPE_CHECKING:
    from reviva.training import ActivationOffload


class _Stored:
    """One offloaded storage: its block, and while it is back, a tensor viewing the block."""

    __slots__ = ("block", "nbytes", "layer", "restored", "widen", "owner", "changed", "__weakref__")

    def __init__(
        self, owner: ActivationOffload, block: int, nbytes: int, layer: int, widen: bool
    ) -> None:
        self.owner = weakref.ref(owner)
        self.block = block
        self.nbytes = nbytes
        self.layer = layer
        self.widen = widen  # moved at 16 bits: widened back to fp32 on the compute stream
        # A tensor on the block's device memory (a lease: the block stays there while it lives),
        # or after widening, torch's fp32 copy of it.
        self.restored: torch.Tensor | None = None
        # Note [Saved tensors' versions]: the storage was saved again at another version after
        # this copy: changed in place since the saves this copy serves
        self.changed = False

    def __del__(self) -> None:
        # Autograd dropped the saved tensor: the block is dead. Its tensor goes first (ending
        # the lease unless a view of it lives on), then the block (its memory and host copy).
        self.restored = None
        owner = self.owner()
        if owner is not None and self.block is not None:  # None: retired when widened
            owner._retire(self.block)


@dataclass(frozen=True)
class _Packed:
    stored: _Stored
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    # Note [Saved tensors' versions]: the saved tensor (weakly) and its version when saved
    source: weakref.ref
    version: int


# Note [Saved tensors' versions]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Autograd keeps a saved tensor's version (its view family's count of in-place changes) and
# refuses backward if it changed: the values saved are gone. With pack hooks it keeps the hook's
# object instead and checks nothing; offload copies the values when they are saved, and shares
# one copy among the saves of a storage (views, a tensor saved by several ops). Both need the
# version: a storage changed in place between two saves is copied again at the second (sharing
# the first copy gave the second save the old values: a wrong gradient, silently), and a saved
# tensor whose version moved after its save is refused at unpack as autograd refuses it (its
# copy holds the values of the save, but what autograd would raise on, offload raises on too).
# The version is read at unpack where the saved tensor still lives (a weak reference), and a
# copy is marked changed where its storage is saved again at another version; a tensor changed
# after its save that dies before backward without a later save goes unseen: its copy holds
# the values the graph used.


class SavedTensorHooks:
    """ActivationOffload's pack and unpack hooks (its mixin; see the module docstring)."""

    def _pack(self, t: torch.Tensor) -> Any:
        self.stats.saved_tensors += 1
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        if (
            t.device != self.device
            or nbytes == 0
            or nbytes < self.min_bytes
            or storage.data_ptr() in self._param_ptrs
            or storage.data_ptr() in self._input_ptrs
            or isinstance(t, nn.Parameter)
            or not 0 <= self._layer < self._regions
            or self._in_backward  # recomputed in backward (checkpointing): needed at once
            or (self._offload_layers is not None and self._layer not in self._offload_layers)
        ):
            if self.stats.steps == 0 and t.device == self.device:
                self._record(storage)
            self.stats.kept_tensors += 1
            # Detached (same storage and version counter): returned as is, a tensor an op saved
            # as its own output would hold its node through the hook's object, a cycle through
            # C++ that Python's collector cannot see; a graph never run backward (stopped part
            # way, or dropped) then stayed alive for good with every block it held.
            return t.detach()
        key = (storage.data_ptr(), nbytes)
        entry = self._by_storage.get(key)
        stored = entry[1]() if entry is not None and not entry[0].expired() else None
        if stored is not None and entry[2] != t._version:
            # (Note [Saved tensors' versions]: changed in place since its copy: copied again,
            # and the saves of the old copy refused at unpack)
            stored.changed = True
            stored = None
        if stored is None:
            narrow = _cast_from(t)
            if narrow is None:
                moved = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
            else:  # exact: every value came from `narrow`
                whole = torch.empty(0, dtype=t.dtype, device=t.device).set_(storage)
                moved = whole.to(narrow)
                self.stats.narrowed_tensors += 1
            # A storage larger than the window still goes (alone), beside what compute holds
            # (blocks brought back for a graph that is still alive: a backward that stopped
            # part way, retain_graph).
            if moved.nbytes + self._in_use > self.manager.budget_bytes:
                self._set_budget(moved.nbytes + self._in_use)
            # The block holds `moved` until its D2H has read it; then torch's allocator reuses
            # the memory after the copy stream's work (record_stream).
            block = self.manager.adopt(moved)
            self.manager.offload(block)
            del moved
            widen = narrow is not None
            stored = _Stored(self, block, self.manager.nbytes(block), self._layer, widen)
            self._by_storage[key] = (StorageWeakRef(storage), weakref.ref(stored), t._version)
            self._stored_of[block] = weakref.ref(stored)
            self._groups.setdefault(self._layer, []).append(block)
            self.stats.bytes_to_host += stored.nbytes
            if self.stats.steps == 0:
                self._record(storage)
        self.stats.offloaded_tensors += 1
        return _Packed(
            stored,
            t.dtype,
            tuple(t.size()),
            tuple(t.stride()),
            t.storage_offset(),
            weakref.ref(t),
            t._version,
        )

    def _record(self, storage: torch.UntypedStorage) -> None:
        # Step 1 records each layer's saved bytes (each storage once) for the budget plan.
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if ptr in self._param_ptrs or nbytes < self.min_bytes:
            return
        seen = self._recorded.get((ptr, nbytes))
        if seen is not None and not seen.expired():
            return
        self._recorded[(ptr, nbytes)] = StorageWeakRef(storage)
        saved = self.stats.layer_saved_bytes
        saved[self._layer] = saved.get(self._layer, 0) + nbytes

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Packed):
            return packed
        source = packed.source()  # (Note [Saved tensors' versions])
        now = None if source is None else source._version
        if packed.stored.changed or (now is not None and now != packed.version):
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: [{packed.dtype} {list(packed.size)}] saved at version "
                f"{packed.version}, changed in place since"
                + (f" (version {now})" if now is not None else "")
                + " (reviva's activation offload checks saved tensors' versions as autograd does)"
            )
        stored = packed.stored
        if stored.restored is None:
            if not self._in_backward:  # no layer boundary seen yet (no hook fired)
                self._start_backward()
            self._acquire(stored)
        if stored.widen and stored.restored.dtype != packed.dtype:
            # On the compute stream, which waited for the H2D when the block was acquired. The
            # 16-bit block is of no further use (every view of this storage reads the widened
            # copy): it goes now, not when autograd drops the saved tensor, so that the device
            # does not hold both copies until then (its memory returns in compute order).
            stored.restored = stored.restored.to(packed.dtype)
            block, stored.block = stored.block, None
            self._retire(block)
        out = torch.empty(0, dtype=packed.dtype, device=self.device)
        out.set_(stored.restored.untyped_storage(), packed.offset, packed.size, packed.stride)
        return out


def _cast_from(t: torch.Tensor) -> torch.dtype | None:
    """The 16-bit float dtype that autograd records `t` (fp32, its whole storage) was cast
    from, or None. Its values are then exact in that dtype, so it moves at half the bytes and is
    widened back bit for bit (mixed precision saves such casts: an RMSNorm's fp32 input)."""
    fn = t.grad_fn
    if (
        t.dtype != torch.float32
        or fn is None
        or type(fn).__name__ != "ToCopyBackward0"
        or t.storage_offset() != 0
        or t.untyped_storage().nbytes() != t.numel() * t.element_size()
    ):
        return None
    try:
        source, index = fn.next_functions[0]
        dtype = source._input_metadata[index].dtype
    except (AttributeError, IndexError, TypeError, RuntimeError):
        return None
    return dtype if dtype in (torch.bfloat16, torch.float16) else None
