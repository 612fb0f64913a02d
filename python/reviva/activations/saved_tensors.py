"""The saved-tensor hooks of an activation offload (activations/offload.py): `_pack` adopts each
eligible storage saved for backward as a block of the offload's OffloadManager and offloads it at
once (a storage saved several times is copied once; an fp32 cast from 16 bits moves at 16 bits:
_cast_from), `_unpack` brings its block back and rebuilds the saved view on it; every saved
tensor, offloaded or kept, carries its version counter to unpack, where it is checked as
autograd checks it (Note [Saved tensors' versions]).

SavedTensorHooks is a mixin of ActivationOffload. State it reads: the offload's device,
min_bytes, _param_ptrs, _input_ptrs, _layer, _regions, _in_backward, _offload_layers, _in_use
and manager. State it writes: stats (saved, kept, offloaded and narrowed tensors, bytes to
host, layers' saved bytes on the first step), _by_storage, _stored_of, _groups, _recorded.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef


class _Owner(Protocol):
    """What a stored block needs of its activation offload (ActivationOffload, offload.py)."""

    def _retire(self, block: int) -> None: ...


class _Stored:
    """One offloaded storage: its block, and while it is back, a tensor viewing the block."""

    __slots__ = ("block", "nbytes", "layer", "restored", "widen", "owner", "__weakref__")

    def __init__(self, owner: _Owner, block: int, nbytes: int, layer: int, widen: bool) -> None:
        self.owner = weakref.ref(owner)
        self.block = block
        self.nbytes = nbytes
        self.layer = layer
        self.widen = widen  # moved at 16 bits: widened back to fp32 on the compute stream
        # A tensor on the block's device memory (a lease: the block stays there while it lives),
        # or after widening, torch's fp32 copy of it.
        self.restored: torch.Tensor | None = None

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
    # Note [Saved tensors' versions]: a tensor of no storage sharing the saved tensor's version
    # counter, and the version when saved
    counter: torch.Tensor
    version: int


@dataclass(frozen=True)
class _Kept:
    """A saved tensor left where it is (a parameter, an input, a small tensor...), detached (its
    storage and version counter), with its version when saved (Note [Saved tensors' versions])."""

    tensor: torch.Tensor
    version: int


# Note [Saved tensors' versions]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Autograd keeps a saved tensor's version (its view family's count of in-place changes) and
# refuses backward if it changed: the values saved are gone. With pack hooks it keeps the hook's
# object instead and checks nothing (saved_variable.cpp: "Only check version counter in the case
# without hooks"), so the hooks check for it: every pack returns the saved tensor's version
# counter beside the version it had, and unpack raises autograd's error (RuntimeError, its
# words) where the counter moved, whatever the tensor is:
# - kept (a parameter changed under torch.no_grad(), the caller's input_ids changed, a small
#   tensor...): the detached tensor returned shares the counter;
# - offloaded: `_counter_of` makes a tensor of no storage that shares the counter (a detached
#   tensor set_ to an empty storage; its own set_ is not counted), so the check holds after the
#   saved tensor and its views died, without holding the storage the offload freed.
# Offload copies the values when they are saved and shares one copy among the saves of a
# storage (views, a tensor saved by several ops): a storage saved again at another version is
# copied again (sharing the first copy gave the second save the old values: a wrong gradient,
# silently), and the saves of the first copy are refused by their own counter, as autograd
# refuses them. A storage changed through a tensor of another counter (`.data`, `set_`) is
# unseen, as it is by autograd.


def _counter_of(t: torch.Tensor) -> torch.Tensor:
    """A tensor that shares `t`'s version counter and holds none of its storage."""
    stub = t.detach()  # (shares the storage and the version counter)
    with torch.autograd._unsafe_preserve_version_counter(stub):
        stub.set_()  # an empty storage of its own; the version this bumped is put back
    return stub


def _refuse(dtype: torch.dtype, size: tuple[int, ...], saved: int, now: int) -> None:
    """Autograd's version error (torch/csrc/autograd/saved_variable.cpp), raised the same way."""
    raise RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace "
        f"operation: [{dtype} {list(size)}] is at version {now}; expected version {saved} "
        "instead (autograd's version check, made by reviva's activation offload on the saved "
        "tensors its hooks hold: Note [Saved tensors' versions])"
    )


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
            return _Kept(t.detach(), t._version)
        key = (storage.data_ptr(), nbytes)
        entry = self._by_storage.get(key)
        stored = entry[1]() if entry is not None and not entry[0].expired() else None
        if stored is not None and entry[2] != t._version:
            # (Note [Saved tensors' versions]: changed in place since its copy: copied again;
            # the saves of the old copy are refused at unpack by their counter)
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
            _counter_of(t),
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
        if isinstance(packed, _Kept):  # (Note [Saved tensors' versions])
            now = packed.tensor._version
            if now != packed.version:
                _refuse(packed.tensor.dtype, tuple(packed.tensor.size()), packed.version, now)
            return packed.tensor
        now = packed.counter._version
        if now != packed.version:
            _refuse(packed.dtype, packed.size, packed.version, now)
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
