"""What the user's parameters are while their values live in a WeightStore (Note [The user's
streamed parameters]): each write found and taken to the host copy the store fills from, and
close() giving every parameter back where it was. WeightWrites is a mixin of StreamedWeights
(weights/streamed.py)."""

from __future__ import annotations

import torch
from torch import nn

# Note [The user's streamed parameters]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A streamed layer's parameters stay the user's Parameter objects; their `.data` is a view of
# the layer's pinned host copy in the WeightStore (the bytes every fill copies from), or, while
# the layer runs and for a resident layer from its first use on, of its device copy. Either way
# reading one gives its values. Writing one:
# - `p.copy_(t)` (load_state_dict's, or any in-place op on p, under no_grad) writes the tensor p
#   views; it bumps p's version counter;
# - `p.data = t`, or a new Parameter under the name (load_state_dict(assign=True)), makes p
#   another tensor.
# sync() finds both (each parameter's object, data pointer and version as _point left them) at
# the points where the user may have run code since Reviva last pointed them: a generate call's
# start (RevivaManager), each forward of a fine-tune (Finetune's step begins), close(). The new
# values are copied into the host copy (a tensor of another shape or dtype is refused by name),
# the resident device copy is written from it, and streamed device copies the store keeps are
# dropped (WeightStore.trim), so the next use fills from the new values. A write through
# `p.data` (`p.data.copy_(t)`: a tensor of its own version counter) is not seen by the counter:
# where p views the host copy it lands there directly (outside a call, every streamed layer's
# parameters do, and a resident layer's between fine-tuning steps too after sync), so only a
# device copy kept across calls could keep older values; use p.copy_ under no_grad.
# close() gives each parameter back where it was when it was packed: a device tensor of its own
# (copied from the host copy) for a parameter that was on a device; on the CPU the host view
# itself (the same values, device and dtype, pinned: no second copy of the model); a parameter
# that was on the meta device (reviva.from_pretrained) keeps its host view, the values it has.


class WeightWrites:
    """Writes to streamed parameters, and close() (StreamedWeights' mixin; Note [The user's
    streamed parameters]). State it reads: _slots, _host_views, _device_views, _resident_blocks,
    _held, _parts, store. State it writes: _seen, the parameters' .data."""

    _slots: list
    _host_views: list[list[torch.Tensor]]
    _device_views: dict[int, torch.Tensor]
    _resident_blocks: set[int]
    _held: dict[int, list[int]]
    _parts: list[list[int]]
    _slot_names: list[list[str]]
    _origins: list[list[torch.device]]
    # per block, per slot: the Parameter, its data pointer and version as _point left them
    _seen: list[list[tuple[nn.Parameter, int, int]]]

    def _mark(self, b: int) -> None:
        self._seen[b] = [
            (p, p.data_ptr(), p._version) for p in (slot.param for slot in self._slots[b])
        ]

    def sync(self) -> None:
        """Writes to the parameters since they were last pointed reach the host copy and the
        device copies (Note [The user's streamed parameters]). Not while a layer is held."""
        if self._held:
            raise RuntimeError(
                f"StreamedWeights.sync: layers {sorted(self._held)} are held (inside a call)"
            )
        dropped = False
        refill: set[int] = set()
        for b, slots in enumerate(self._slots):
            changed = False
            for k, slot in enumerate(slots):
                p = slot.module._parameters.get(slot.name)
                was, ptr, version = self._seen[b][k]
                if p is was and p.data_ptr() == ptr and p._version == version:
                    continue
                host = self._host_views[b][k]
                if p is None or p.is_meta or p.shape != host.shape or p.dtype != host.dtype:
                    got = "None" if p is None else f"{tuple(p.shape)} {p.dtype} on {p.device}"
                    raise ValueError(
                        f"parameter {self._slot_names[b][k]} was replaced by a {got} tensor; its "
                        f"values live in Reviva's pinned host copy, {tuple(host.shape)} "
                        f"{host.dtype} "
                        "(Note [The user's streamed parameters]): write values of that shape and "
                        "dtype (p.copy_ under torch.no_grad(), or load_state_dict)"
                    )
                if p.data_ptr() != host.data_ptr():
                    with torch.no_grad():
                        host.copy_(p.data)
                changed = True
            if not changed:
                continue
            device = self._device_views.get(b)
            if device is not None:  # (resident: its device copy takes the new values)
                with torch.no_grad():
                    for slot, host in zip(slots, self._host_views[b], strict=True):
                        at = device[slot.offset : slot.offset + slot.nbytes]
                        at.view(host.dtype).view(host.shape).copy_(host)
            elif b in self._resident_blocks:
                refill.add(b)  # (its fill may have read the old values)
            else:
                dropped = True
            self._point(b, device)
        if dropped:
            self.store.trim()  # (streamed device copies fill again from the host copy)
        if refill:
            st = self.store.stats()
            slots, window = max(int(st["slots"]), 1), int(st["prefetch_layers"])
            self.store.set_residency(sorted(self._resident_blocks - refill), slots, window)
            self.store.set_residency(sorted(self._resident_blocks), slots, window)

    def unmap_unused(self) -> None:
        """The device memory no layer uses now (streamed layers' slots, layers no longer
        resident) goes back to the device, unmapped once its streams are past it: torch's
        allocator can take it."""
        self.store.trim()  # type: ignore[attr-defined]
        self.arena.reclaim(True)  # type: ignore[attr-defined]

    def close(self) -> None:
        """Every parameter back where it was when packed (Note [The user's streamed
        parameters]), with the values it has now; the layers' hooks removed and the store's
        device copies given back. The store is of no use after."""
        for i in list(self._held):
            self.release(i)  # type: ignore[attr-defined]
        self.sync()
        for b in range(len(self._slots)):
            self._point(b, None)
        # The store's device copies go back, and are unmapped, before any parameter is copied
        # back: on a card the model's own weights just fit, both at once do not (the H100 at
        # d5ad330, the 8B shape on a 24 GB card: out of memory in close() with 8 resident layers)
        self._device_views.clear()
        self._resident_blocks = set()
        self.store.set_residency([], 1, 0)  # type: ignore[attr-defined]
        self.unmap_unused()  # type: ignore[attr-defined]
        for b, slots in enumerate(self._slots):
            origins = self._origins[b]
            for slot, host, origin in zip(slots, self._host_views[b], origins, strict=True):
                if origin.type not in ("cpu", "meta"):
                    slot.param.data = host.to(origin)
            self._mark(b)
        self.remove_hooks()  # type: ignore[attr-defined]
