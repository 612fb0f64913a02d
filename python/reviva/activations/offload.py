"""Activation offload for the backward pass: `reviva.offload_activations(model, ...)`.

The saved tensors are blocks of the core's OffloadManager under its PrefetchScheduler, the same
engine that moves everything else (reviva._C; one pinned pool and one transfer engine per
process, reviva.resources):
- forward: a saved-tensor hook adopts each storage as a block (the block holds the storage) and
  offloads it at once: the D2H starts on the copy stream after an event on the compute stream,
  so compute never waits for it, and the storage goes back to torch's allocator when the copy
  has read it. The manager's budget bounds the device bytes still waiting for their D2H: when it
  is full, adopting the next storage waits (on the host) for the oldest copy to land, so that
  activations do not pile up on the device behind the copy (~55 GB/s D2H is slower than forward
  compute).
- backward: when backward starts (the first gradient of a layer's output), the step's order
  goes to a scheduler: one group per block, the last region first and each region's blocks in
  reverse saving order (needed first is saved last). Each block is acquired when autograd
  unpacks it (compute waits for that copy alone), and every acquire and every block dropped tops
  the prefetch up: the next blocks of the order come back while their lead (resident or on their
  way, not yet acquired) stays within the window (max_ahead_bytes) and within `prefetch_layers`
  regions' worth of blocks. A block is unregistered (its device memory and host copy freed) once
  autograd dropped the saved tensor and every tensor viewing it is gone (the binding's leases,
  Note [Leases] in python/csrc/manager.cpp; discard_when_free when a view outlives it).
The manager's budget is the window beside what compute holds (a block larger than the window
still runs: what compute needs is never refused); in backward it only grows until the step ends
(lowered, it would push out blocks prefetched into room just freed). Budget mode widens the
window into what the budget leaves beside the kept layers (`_window`).
Stalls, copy times and host waits are the manager's metrics; the overlap ratio is the core's one
definition (Note [Overlap ratio], reviva._C.overlap_ratio).

What is offloaded: tensors saved inside the layers and, when the layers were found (an HF
model), between the last layer and the output head's result (final norm, the head's input: one
more region, brought back from the logits' gradient on, after the loss's backward, which is the
step's peak); what is saved before the first layer (the embedding's indices) goes with layer
0. Only tensors on the model's device, of at least `min_bytes` (default 0: everything), never
parameters (nor views of them). A larger min_bytes keeps small tensors on the device: on the
H200 bench 1 MiB kept the RMSNorms' 32 KB rsqrt outputs and attention's seeds, 1.1 MB above
save_on_cpu's peak at no gain in time (0.4924 s against min_bytes=0's 0.4920 s,
train-card-2026-12-01-f6cc859.json), so the default offloads them too. What the loss saves
stays: backward needs it first. Nothing is offloaded once backward started (recomputation
under checkpointing is needed at once). A storage saved several times (a tensor and its
views, or the same tensor saved by two nodes) is copied once and every saved view is rebuilt on
it with its own size, stride and offset, so the values autograd sees are bit-identical and
gradients equal a run without Reviva. An fp32 storage that autograd records as a cast from
bf16/fp16 (an RMSNorm's input in mixed precision) moves as those 16-bit values and is widened
back exactly (`_cast_from`).

Budget mode: the first step offloads everything eligible and records the bytes each layer saves
and (CUDA) the step's peak; later steps keep the last layers' activations on the device (needed
first in backward) while that peak plus what they saved fits the budget, and offload the first
layers (needed last, so their copies hide under the most backward compute).

The saved-tensor hooks are activations/saved_tensors.py's (Note [Saved tensors' versions]), the
layer boundaries and backward's prefetch activations/backward.py's, budget mode's choice of layers
activations/budget.py's.
"""

from __future__ import annotations

import contextlib
import os
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from reviva._C import (
    DeviceArena,
    OffloadManager,
    PrefetchScheduler,
    TransferEngine,
    overlap_ratio,
)
from reviva.activations.backward import LayerBoundaries
from reviva.activations.budget import BudgetMode
from reviva.activations.saved_tensors import SavedTensorHooks, _Stored
from reviva.adapters import base_model_of
from reviva.resources import device_resources
from reviva.sizes import parse_bytes
from reviva.trace import chrome_trace, span, store_spans, write_trace


@dataclass
class ActivationStats:
    """What offload_activations did, over all steps so far (peaks: of the last step); names as
    GenerateStats's (Note [One naming scheme] in reviva/stats.py): bytes, seconds, to_host and
    to_device."""

    steps: int = 0
    saved_tensors: int = 0  # pack calls
    offloaded_tensors: int = 0  # saved tensors whose storage went to the host
    kept_tensors: int = 0  # parameters, small tensors, other devices, layers kept by the budget
    bytes_to_host: int = 0  # D2H bytes (each storage once; narrowed ones at 16 bits)
    narrowed_tensors: int = 0  # fp32 storages moved as the 16-bit values they were cast from
    bytes_to_device: int = 0  # H2D bytes (the manager's)
    prefetched: int = 0  # blocks the scheduler started bringing back ahead of their use
    demand_fetched: int = 0  # blocks fetched when needed (no prefetch reached them)
    offloaded_layers: list[int] = field(default_factory=list)  # last step (budget mode)
    layer_saved_bytes: dict[int, int] = field(default_factory=dict)  # recorded on step 1
    stall_s: float = 0.0  # compute waiting for an H2D (the manager's stall meter)
    host_wait_s: float = 0.0  # the Python thread waiting for copies to land (budget full)
    overlap_ratio: float = 1.0  # Note [Overlap ratio] (reviva._C.overlap_ratio), all steps
    peak_device_bytes: int | None = None  # last step (CUDA)
    step_s: float | None = None  # wall time of the last step (enter to exit)


class ActivationOffload(SavedTensorHooks, LayerBoundaries, BudgetMode):
    """The context manager behind `offload_activations`; one forward+backward per `with`.

    budget: the step's device peak to stay under (budget mode; None: offload everything
    eligible). prefetch_layers: how many layers' blocks backward may bring back ahead (within
    window_bytes). min_bytes: smaller saved tensors stay. window_bytes: device bytes that may
    wait for their D2H in forward, and be brought back ahead in backward. memory: where the
    blocks brought back live: "torch" (torch's pool on the compute stream, the default) or
    "arena" (Reviva's device arena). `manager` and `scheduler` are the core's objects doing it.
    """

    def __init__(
        self,
        model: nn.Module,
        budget: int | str | None = None,
        prefetch_layers: int = 2,
        min_bytes: int = 0,
        layers: Sequence[nn.Module] | None = None,
        engine: TransferEngine | None = None,
        window_bytes: int | str = 512 << 20,
        memory: str = "torch",
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"offload_activations wraps an nn.Module, got {type(model).__name__}")
        self.window_bytes = parse_bytes(window_bytes)
        if self.window_bytes <= 0:
            raise ValueError(f"window_bytes must be > 0 bytes, got {window_bytes!r}")
        for name, value in (("prefetch_layers", prefetch_layers), ("min_bytes", min_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        self.budget = None if budget is None else parse_bytes(budget)
        if self.budget is not None and self.budget <= 0:
            raise ValueError(f"budget must be > 0 bytes, got {budget!r}")
        self.model = model
        self.prefetch_layers = prefetch_layers
        self.min_bytes = min_bytes
        base = base_model_of(model)  # (PEFT's or torch.compile's wrapper: the model under it)
        self.layers = list(layers) if layers is not None else _decoder_layers(base)
        if not self.layers:
            raise ValueError(
                "offload_activations: no layer boundaries: the model has no decoder layers "
                "(model.model.layers); pass layers=[...] (modules in forward order)"
            )
        # Found with the decoder layers: the output head (get_output_embeddings()). What is saved
        # between the last layer and the head's output (final norm, the head's input) is one
        # more region, offloaded like a layer; what the loss saves after it stays.
        self.head = _output_head(base) if layers is None else None
        self._regions = len(self.layers) + (1 if self.head is not None else 0)
        param = next(model.parameters(), None)
        self.device = param.device if param is not None else torch.device("cpu")
        if memory not in ("torch", "arena"):
            raise ValueError(f"memory must be 'torch' or 'arena', got {memory!r}")
        self.memory = memory
        arena = None
        if engine is None:  # the process's engine, pinned pool and arena (reviva.resources)
            shared = device_resources(self.device)
            engine = shared.engine
            if memory == "arena":
                arena = shared.arena
        elif memory == "arena":  # the blocks' device memory on the given engine's runtime
            arena = DeviceArena(engine.runtime)
        self.engine = engine
        self.arena = arena  # memory="arena": where the blocks brought back in backward live
        self._active = False  # inside `with`: a second entry is refused
        self.stats = ActivationStats()
        self._cuda = self.device.type == "cuda"
        self._param_ptrs: set[int] = set()
        # Storages of the tensors the caller passed to the model this step (_note_inputs).
        self._input_ptrs: set[int] = set()
        # A storage saved again (a view, or saved by a second node) maps to its first copy. The
        # key is (data pointer, bytes); the storage's weak reference tells a live storage from a
        # new one that the caching allocator placed at the address of a freed one.
        # (storage, its copy, the version copied: Note [Saved tensors' versions])
        self._by_storage: dict[
            tuple[int, int], tuple[StorageWeakRef, weakref.ReferenceType, int]
        ] = {}
        # The step's blocks: each region's in saving order, and each block's storage record.
        self._groups: dict[int, list[int]] = {}
        self._stored_of: dict[int, weakref.ReferenceType[_Stored]] = {}
        # Dead blocks (autograd dropped their saved tensors) that a view still held when they
        # died: the binding discards them when the view goes; unregistered at a step boundary.
        self._dropping: list[int] = []
        # Blocks compute holds (a tensor on them was handed out) until they are unregistered:
        # the budget in backward is the window beside these.
        self._using: dict[int, int] = {}
        self._in_use = 0
        self._grad_layer = 0  # backward: the layer whose gradient is being computed
        self._in_backward = False
        self._layer = 0  # the region whose forward runs now
        self._offload_layers: set[int] | None = None  # None: all
        self._handles: list[Any] = []
        self._hooks_ctx: Any = None
        self._t0 = 0.0
        # The core's manager (the budget, the blocks' states and copies, the metrics) and its
        # scheduler (the backward order, the prefetch window); the offload's for its lifetime.
        # The blocks brought back live in torch's pool on the compute stream (memory="torch":
        # Note [Compute-ordered torch memory] in python/csrc/manager.cpp), or in the arena,
        # Reviva's device memory outside torch's allocator. Both reuse freed memory in stream
        # order: the manager counts a used block's bytes as free as soon as it is dropped, and
        # the next copy into that memory waits on the device (Note [Stream-ordered frees] in
        # src/offload_manager_impl.h), so the H2D stream stays fed while the host runs ahead of the
        # device in backward. torch's pool is the default: memory torch frees after the loss's
        # backward (the step's peak) is reused for the activations coming back, where the
        # arena's is memory of its own beside torch's cache (H200, 35c0d1e: the card peaked
        # 1.7 GB higher with the arena).
        self.manager = OffloadManager(
            engine,
            budget_bytes=self.window_bytes,
            allocator="arena" if memory == "arena" else "torch_compute",
            arena=arena,
            timeline_capacity=1 << 16,  # (each step's copies and stalls: trace(), Note [Traces])
        )
        self._origin_host = time.perf_counter()  # (the timeline's origin, on the host's clock)
        self._last_trace: dict[str, Any] | None = None
        self._t_backward: float | None = None
        # Made when backward starts, over that step's order (its window counts blocks).
        self.scheduler: PrefetchScheduler | None = None
        self._metrics_start: dict[str, Any] = {}  # the manager's metrics when the step began
        self._recorded: dict[tuple[int, int], StorageWeakRef] = {}  # counted on the first step
        self._copy_s = 0.0  # copy-stream busy time of this offload's steps
        self._held = 0  # device bytes allocated when the step began (CUDA)
        self._extra_all: int | None = None  # CUDA: the offload-all step's peak above _held
        # Budget mode: the bytes the budget leaves above the offload-all floor, and what the
        # kept layers 0..i save (prefix sums); both windows grow into what kept layers leave.
        self._room: int | None = None
        self._kept_upto: list[int] = []

    # --- the step --------------------------------------------------------------------------------

    def __enter__(self) -> ActivationOffload:
        if self._active:
            raise RuntimeError(
                "ActivationOffload: already active (entered and not exited); one forward and "
                "backward per `with`, and no nesting: a second entry would install its "
                "saved-tensor hooks twice"
            )
        self._active = True
        try:
            return self._begin()
        except BaseException:
            self._active = False
            raise

    def _begin(self) -> ActivationOffload:
        self._param_ptrs = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
        self._input_ptrs = set()
        self._by_storage.clear()
        self._reap()  # dead blocks whose last view has gone since
        self._groups = {}
        self._stored_of = {}
        self._grad_layer = self._regions
        self._in_backward = False
        self._recorded.clear()
        # What is saved before the first layer (the embedding's indices) is needed last, with
        # layer 0's activations: it belongs to region 0.
        self._layer = 0
        self._held = torch.cuda.memory_allocated(self.device) if self._cuda else 0
        self._offload_layers = self._choose_layers()
        self.stats.offloaded_layers = (
            sorted(self._offload_layers)
            if self._offload_layers is not None
            else list(range(self._regions))
        )
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        self._handles.append(
            self.model.register_forward_pre_hook(self._note_inputs, with_kwargs=True)
        )
        for i, layer in enumerate(self.layers):
            self._handles.append(layer.register_forward_pre_hook(self._make_pre_hook(i)))
            self._handles.append(layer.register_forward_hook(self._make_post_hook(i)))
        if self.head is not None:
            self._handles.append(self.head.register_forward_hook(self._head_post_hook))
        self._set_budget(self._window(0) + self._in_use)
        self._metrics_start = self.manager.metrics()
        self.manager.take_timeline()  # (the step's own events from here)
        self._t_backward = None
        self._hooks_ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks_ctx.__enter__()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self._end(exc)
        finally:
            self._active = False

    def _note_inputs(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        """The model's tensor inputs are the caller's and stay alive through the step: one
        saved for backward (the embedding saves input_ids) is kept, not offloaded, since moving
        it would free nothing and bring a second copy back (H200: 64 KiB over checkpointing's
        peak for a [4, 2048] batch, benchmarks/diagnostics/diag_ckpt_peak.py)."""
        for t in (*args, *kwargs.values()):
            if isinstance(t, torch.Tensor):
                self._input_ptrs.add(t.untyped_storage().data_ptr())

    def _end(self, exc: tuple[object, ...]) -> None:
        if self._hooks_ctx is not None:
            self._hooks_ctx.__exit__(*exc)
            self._hooks_ctx = None
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self.scheduler is not None and self._in_backward:
            self.scheduler.end_step()
        self._reap()
        self.manager.synchronize()  # every copy landed: the step's metrics are complete
        if self._cuda:
            self.stats.peak_device_bytes = torch.cuda.max_memory_allocated(self.device)
            if self._offload_layers is None:  # everything offloaded: the floor of budget mode
                self._extra_all = self.stats.peak_device_bytes - self._held
            torch.cuda.synchronize(self.device)
        # This step's part of the manager's metrics, and the one overlap ratio (Note [Overlap
        # ratio]) over all steps.
        now, start = self.manager.metrics(), self._metrics_start
        st = self.stats

        def delta(key: str) -> Any:
            return max(now[key] - start[key], 0)

        st.bytes_to_device += delta("bytes_to_device")
        st.prefetched += delta("prefetches")
        st.demand_fetched += delta("prefetch_misses")
        st.stall_s += delta("compute_stall_s")
        st.host_wait_s += delta("host_wait_s")
        self._copy_s += delta("to_host_busy_s") + delta("to_device_busy_s")
        st.overlap_ratio = overlap_ratio(st.stall_s, self._copy_s)
        st.step_s = time.perf_counter() - self._t0
        st.steps += 1
        self._last_trace = self._trace(st.step_s)

    def _trace(self, step_s: float) -> dict[str, Any]:
        """The step as a Chrome trace (Note [Traces]): forward and backward on the host's clock
        (where the step's compute was issued), each activation's copy each way and compute's
        stalls from the manager's timeline."""
        ms = 1e3
        spans = [span("step", "compute", 0.0, step_s * ms)]
        back = self._t_backward
        if back is not None:
            spans.append(span("forward", "compute", 0.0, (back - self._t0) * ms))
            spans.append(span("backward", "compute", (back - self._t0) * ms, step_s * ms))
        offset = (self._origin_host - self._t0) * ms
        spans += store_spans(self.manager.take_timeline(), "activations", offset)
        return chrome_trace(
            spans, {"device": str(self.device), "clock": "host", "stats": asdict(self.stats)}
        )

    def trace(self, path: str | os.PathLike[str]) -> str:
        """Writes the last step as a Chrome/Perfetto trace (JSON) at `path`: forward, backward,
        each activation copy each way and compute's stalls (Note [Traces] in reviva/trace.py).
        Returns the path."""
        return write_trace(path, self._last_trace, "ActivationOffload")


def _output_head(model: nn.Module) -> nn.Module | None:
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    return head if isinstance(head, nn.Module) else None


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if isinstance(layers, nn.ModuleList) and len(layers) > 0:
        return list(layers)
    return []


@contextlib.contextmanager
def offload_activations(
    model: nn.Module,
    budget: int | str | None = None,
    prefetch_layers: int = 2,
    min_bytes: int = 0,
    layers: Sequence[nn.Module] | None = None,
    offload: ActivationOffload | None = None,
    window_bytes: int | str = 512 << 20,
    memory: str = "torch",
) -> Iterator[ActivationOffload]:
    """Offloads the activations autograd saves inside the block (one forward and its backward).

        offload = reviva.ActivationOffload(model, budget="8GB")   # reuse across steps
        for batch in data:
            with reviva.offload_activations(model, offload=offload):
                loss = model(**batch).loss
                loss.backward()

    Without `offload`, a new ActivationOffload is made (budget mode then measures every step).
    With it, the settings are the offload's own: passing any of them too raises, naming it.
    """
    if offload is not None:
        given = [
            name
            for name, value, default in (
                ("budget", budget, None),
                ("prefetch_layers", prefetch_layers, 2),
                ("min_bytes", min_bytes, 0),
                ("layers", layers, None),
                ("window_bytes", window_bytes, 512 << 20),
                ("memory", memory, "torch"),
            )
            if value != default
        ]
        if given:
            raise ValueError(
                f"offload_activations: {', '.join(given)} given with offload=: an "
                "ActivationOffload keeps the settings it was made with; pass them to "
                "ActivationOffload(...) instead"
            )
        if offload.model is not model:
            raise ValueError(
                "offload_activations: offload= was made for another model "
                f"({type(offload.model).__name__}), not the {type(model).__name__} given"
            )
    else:
        offload = ActivationOffload(
            model,
            budget,
            prefetch_layers,
            min_bytes,
            layers,
            window_bytes=window_bytes,
            memory=memory,
        )
    with offload:
        yield offload
