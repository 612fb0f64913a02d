"""A streamed fine-tuning step's layer inputs (its checkpoints) in pinned host memory, on a core
OffloadManager and PrefetchScheduler of their own (Note [Checkpoints on the host]): saved in each
layer's forward, brought back ahead of its backward, given up when its backward is done.

Note [Checkpoints on the host]
A layer's input is saved as a block of a core OffloadManager of its own (adopted: its device
memory becomes the block's, offloaded at once on the copy stream after an event on compute;
torch's allocator gets the memory back once the copy has read it), and the backward order is
declared to a PrefetchScheduler when the step's first checkpoint is needed: the last layer's
first, each brought back `prefetch_layers` ahead while the layer before computes. A checkpoint is
given up (its block unregistered) as soon as its layer's backward is done, and whatever else
ends it (an exception, a graph dropped without backward) ends it when autograd lets go of the
layer's context. At 64k tokens of the 8B shape a checkpoint is 512 MiB; the host holds the
step's 32 (16 GiB, pinned, pooled from step to step). Pinned memory cannot be paged out, so a
training step's start checks that the host can give them (train_plan.host_shortfall against
memory_state.host_state: MemAvailable less a reserve, plus the pool's unused pinned bytes) and
refuses before any work, naming the bytes and the longest sequence the host holds; `plan --train
--host-memory` says the same ahead of time.
"""

from __future__ import annotations

import weakref

import torch

from reviva._C import OffloadManager, PrefetchScheduler, RevivaOutOfMemoryError


class _Checkpoint:
    """One layer's input of a step in pinned host memory (Note [Checkpoints on the host])."""

    __slots__ = ("owner", "block", "dtype", "shape", "nbytes", "restored", "__weakref__")

    def __init__(
        self, owner: _Checkpoints, block: int, dtype: torch.dtype, shape: tuple[int, ...]
    ) -> None:
        self.owner = weakref.ref(owner)
        self.block: int | None = block
        self.dtype = dtype
        self.shape = shape
        self.nbytes = owner.manager.nbytes(block)
        self.restored: torch.Tensor | None = None  # the block on the device once brought back

    def __del__(self) -> None:
        self.restored = None
        owner = self.owner()
        if owner is not None:
            owner.retire(self)


class _Checkpoints:
    """The step's layer inputs on the core's OffloadManager and PrefetchScheduler (Note
    [Checkpoints on the host])."""

    def __init__(self, engine: object, prefetch_layers: int) -> None:
        self.manager = OffloadManager(
            engine, budget_bytes=1, allocator="torch_compute", timeline_capacity=1 << 12
        )
        self.prefetch_layers = prefetch_layers
        self.scheduler: PrefetchScheduler | None = None
        self._saved: list[weakref.ReferenceType[_Checkpoint]] = []  # this step's, saving order
        self._using: dict[int, int] = {}  # blocks handed to compute: their bytes
        self._dropping: list[int] = []  # given up while a view of them lived
        self._window = 0  # device bytes of checkpoints in flight (either way)

    def begin_step(self) -> None:
        if self.scheduler is not None:
            self.scheduler.end_step()
            self.scheduler = None
        self._saved = []
        dropping, self._dropping = self._dropping, []
        for block in dropping:
            self._unregister_or_keep(block)

    def save(self, x: torch.Tensor) -> _Checkpoint:
        t = x.detach()
        if not t.is_contiguous() or t.untyped_storage().nbytes() != t.nbytes:
            t = t.clone(memory_format=torch.contiguous_format)  # (a storage of its own)
        self._window = max(self._window, (self.prefetch_layers + 1) * t.nbytes)
        self._raise(sum(self._using.values()) + self._window)
        whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
        block = self.manager.adopt(whole)
        self.manager.offload(block)
        del whole
        record = _Checkpoint(self, block, t.dtype, tuple(t.shape))
        self._saved.append(weakref.ref(record))
        return record

    def restore(self, record: _Checkpoint) -> torch.Tensor:
        if record.block is None:
            raise RuntimeError("reviva.finetune: a layer's checkpoint was used after it ended")
        if record.restored is None:
            if self.scheduler is None:
                self._start_backward()
            assert self.scheduler is not None
            need = sum(self._using.values()) + record.nbytes
            self._raise(need + self._window)
            try:
                (t,) = self.scheduler.acquire_group([record.block], "read")
            except RevivaOutOfMemoryError:  # (a view of a used block still alive)
                self._raise(self.manager.device_bytes + record.nbytes)
                (t,) = self.scheduler.acquire_group([record.block], "read")
            record.restored = t
            self._using[record.block] = record.nbytes
            del t  # the lease lives in the record alone
            self.scheduler.release_group([record.block], False)
        return record.restored.view(record.dtype).view(record.shape)

    def _start_backward(self) -> None:
        live = [r for r in (ref() for ref in self._saved) if r is not None and r.block is not None]
        self.scheduler = PrefetchScheduler(
            self.manager,
            prefetch_groups=self.prefetch_layers,
            eager_offload=False,
            max_ahead_bytes=max(self._window, 1),
        )
        if live:
            self.scheduler.declare_order([[r.block] for r in reversed(live)])

    def retire(self, record: _Checkpoint) -> None:
        """The checkpoint's layer is done with it: its block goes (now, or when the last view
        of it goes), and the next ones of the order come back into its room."""
        block, record.block = record.block, None
        record.restored = None
        if block is None:
            return
        self._unregister_or_keep(block)
        if self.scheduler is not None:
            self.scheduler.release_group([], False)

    def _unregister_or_keep(self, block: int) -> None:
        try:
            self.manager.unregister(block)
        except ValueError:  # a view of it is alive: discarded when it goes
            if self.manager.discard_when_free(block):
                self._dropping.append(block)
                return
            self.manager.unregister(block)
        self._using.pop(block, None)

    def _raise(self, nbytes: int) -> None:
        if nbytes > self.manager.budget_bytes:
            self.manager.budget_bytes = int(nbytes)
