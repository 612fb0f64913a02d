"""The layer boundaries of an activation offload's step (activations/offload.py) and its backward:
hooks at each layer's start and end (the region whose forward runs, the window's budget in forward),
backward's start at the first gradient of a layer's output (the step's order declared to a
PrefetchScheduler: the last region first, each region's blocks in reverse saving order), each
block acquired when autograd unpacks it, and blocks retired once autograd dropped them.

LayerBoundaries is a mixin of ActivationOffload. State it reads: the offload's manager,
prefetch_layers, _regions and _hooks_ctx. State it writes: _layer, _grad_layer, _in_backward,
_t_backward, scheduler, _using, _in_use, _dropping, _stored_of, and the manager's budget.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from reviva._C import PrefetchScheduler, RevivaOutOfMemoryError
from reviva.activations.saved_tensors import _Stored


class LayerBoundaries:
    """ActivationOffload's layer boundaries and backward (its mixin; see the module docstring)."""

    def _make_pre_hook(self, i: int) -> Any:
        def pre_hook(module: nn.Module, args: Any) -> None:
            self._layer = i
            if not self._in_backward:  # not a recomputation under checkpointing
                self._set_budget(self._window(i) + self._in_use)

        return pre_hook

    def _make_post_hook(self, i: int) -> Any:
        def post_hook(module: nn.Module, args: Any, output: Any) -> None:
            self._layer = i + 1  # what follows belongs to the next layer, or to the head
            out = output[0] if isinstance(output, tuple | list) else output
            if isinstance(out, torch.Tensor) and out.requires_grad:
                # The gradient of layer i's output arrives when layer i's backward starts.
                out.register_hook(lambda grad, i=i: self._backward_reached(i))

        return post_hook

    def _head_post_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        self._layer = self._regions  # the loss: what it saves is needed first in backward
        if isinstance(output, torch.Tensor) and output.requires_grad:
            # The gradient of the logits arrives after the loss's backward, the step's peak:
            # the head's storages come back from then on, not beside it.
            output.register_hook(lambda grad: self._backward_reached(self._regions - 1))

    def _backward_reached(self, i: int) -> None:
        """Layer i's backward starts (the gradient of its output arrived). The first time, the
        step's order goes to a new scheduler: one group per block, the last region first and
        each region's blocks in reverse saving order (needed first is saved last), its window
        the blocks of `prefetch_layers` regions; the block needed first is acquired at once,
        which starts the prefetch behind it."""
        self._grad_layer = min(self._grad_layer, i)
        if not self._in_backward:
            first = self._start_backward()
            if first is not None:
                self._acquire(first)

    def _start_backward(self) -> _Stored | None:
        """Declares the step's order to a new scheduler; returns the live storage record needed
        first (None without any)."""
        self._in_backward = True
        self._t_backward = time.perf_counter()
        # Blocks whose saved tensor autograd dropped before backward are gone (a graph the step
        # built and let go: TRL's SFTTrainer computes its entropy metric with grad and detaches
        # it): the order is the live ones alone.
        groups = {r: [b for b in blocks if self._live(b)] for r, blocks in self._groups.items()}
        order = [[b] for r in sorted(groups, reverse=True) for b in reversed(groups[r])]
        if not order:
            return None
        per_region = max(len(g) for g in groups.values())
        self.scheduler = PrefetchScheduler(
            self.manager,
            prefetch_groups=self.prefetch_layers * per_region,
            eager_offload=False,
            max_ahead_bytes=self._window(self._grad_layer),
        )
        self.scheduler.declare_order(order)
        ref = self._stored_of[order[0][0]]
        return ref()

    def _live(self, block: int) -> bool:
        """Whether the block's saved tensor is still held by autograd (its record lives)."""
        ref = self._stored_of.get(block)
        return ref is not None and ref() is not None

    def _acquire(self, stored: _Stored) -> None:
        """Acquires a block through the scheduler (which prefetches the next ones of the order
        into the room the budget leaves): its storage record gets a tensor on the block (its
        lease), and the caller's part of the acquire ends at once, so the block stays on the
        device while that tensor or a view of it lives. Compute waits for the block's copy."""
        block = stored.block
        window = self._window(self._grad_layer)
        self.scheduler.max_ahead_bytes = window  # budget mode: it grows as kept layers go
        self._raise_budget(window + self._in_use + stored.nbytes)
        try:
            (t,) = self.scheduler.acquire_group([block], "read")
        except RevivaOutOfMemoryError:
            # What compute still holds was undercounted (a view of a used block still alive):
            # room for this block beside everything the manager holds now.
            self._raise_budget(self.manager.device_bytes + stored.nbytes)
            (t,) = self.scheduler.acquire_group([block], "read")
        stored.restored = t
        self._hold(block, stored.nbytes)
        del t  # the lease now lives in the storage record alone
        self.scheduler.release_group([block], False)

    def _hold(self, block: int, nbytes: int) -> None:
        if block not in self._using:
            self._using[block] = nbytes
            self._in_use += nbytes

    def _set_budget(self, nbytes: int) -> None:
        """Forward: the window beside what compute holds (the caller adds self._in_use)."""
        nbytes = max(int(nbytes), 1)
        if nbytes != self.manager.budget_bytes:
            self.manager.budget_bytes = nbytes  # lowering it waits until the held bytes fit

    def _raise_budget(self, nbytes: int) -> None:
        """Backward: the budget only grows until the step ends (lowered as blocks go, it would
        push out blocks prefetched into the room they left, to be fetched again, or make the
        host wait for their memory). So at most the window plus the most compute held at once
        (a layer and what is left of the one before) is on the device for this offload."""
        if nbytes > self.manager.budget_bytes:
            self.manager.budget_bytes = int(nbytes)

    def _retire(self, block: int) -> None:
        """A block whose saved tensor autograd dropped (_Stored.__del__): unregistered now, so
        that its memory is room for the next prefetch at once (the scheduler is topped up in
        backward). If a view of it is still alive, the binding discards it when that view goes
        (discard_when_free) and the registration goes at a step boundary (_reap)."""
        try:
            self._unregister(block)
        except ValueError:
            if self.manager.discard_when_free(block):
                self._dropping.append(block)
            else:  # the view went meanwhile
                self._unregister(block)
        if self._hooks_ctx is not None and self._in_backward and self.scheduler is not None:
            self.scheduler.release_group([], False)

    def _unregister(self, block: int) -> None:
        self.manager.unregister(block)  # ValueError while a tensor of it is alive
        self._stored_of.pop(block, None)
        self._in_use -= self._using.pop(block, 0)

    def _reap(self) -> None:
        """Step boundaries: unregisters the dead blocks whose last view has gone."""
        dropping, self._dropping = self._dropping, []
        for block in dropping:
            try:
                self._unregister(block)
            except ValueError:  # still viewed: it is discarded when the view goes
                self._dropping.append(block)
