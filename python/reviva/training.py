"""Activation offload for the backward pass: `reviva.offload_activations(model, ...)`.

Saved-tensor hooks move what autograd saves for backward into pinned host memory on the D2H
copy stream during forward (each copy starts after an event on the compute stream, so compute
never waits for it), and bring it back during backward in reverse order of saving, ahead of the
autograd node that needs it; compute waits on a tensor's copy only when autograd unpacks it.

Device memory is bounded in both directions by `window_bytes`:
- forward: a saved tensor's device memory returns to torch's allocator only when its D2H has read
  it, and D2H (~55 GB/s) is slower than forward compute; when more than `window_bytes` wait for
  their D2H, the Python thread waits for the oldest (the device still has queued work), so the
  activations do not pile up on the device behind the copy;
- backward: at most `window_bytes` are brought back ahead of their use, and no further ahead than
  `prefetch_layers` layers before the layer whose gradient is being computed (the gradient of
  layer i's output arriving, a tensor hook, starts layer i's backward). The window is topped up
  at every unpack, so the H2D stream stays busy.
A storage brought back is allocated on the compute stream without record_stream: compute waits
for its H2D at unpack, so the allocator may reuse its memory in stream order when autograd drops
it. With record_stream (train-2026-11-29-6f8d6c0.json) torch's reserved memory grew through
backward to 13.7 GB beside 5.6 GB allocated: a freed block waited for an event on the H2D stream,
recorded when the host (far ahead of the device) freed it, so it was not reused for as long as
the device lagged.
Budget mode widens both windows into what the budget leaves beside the kept layers (`_window`).

What is offloaded: tensors saved inside the layers and, when the layers were found (an HF
model), between the last layer and the output head's result (final norm, the head's input: one
more region, brought back from the logits' gradient on, after the loss's backward, which is the
step's peak); what is saved before the first layer (the embedding's indices) goes with layer
0. Only tensors on the model's device, of at least `min_bytes`, never parameters (nor views of
them): tiny tensors are not worth a copy (on the H200 bench the default 1 MiB kept the RMSNorms'
32 KB rsqrt outputs and attention's seeds, 1.1 MB above save_on_cpu's peak; min_bytes=0 met it
to the byte, train-2026-11-29-7464db5.json). What the loss saves stays: backward needs it
first. Nothing is offloaded once backward started (recomputation under checkpointing is
needed at once). A
storage saved several times (a tensor and its views, or the same tensor saved by two nodes) is
copied once and every saved view is rebuilt on it with its own size, stride and offset, so the
values autograd sees are bit-identical and gradients equal a run without Reviva. An fp32
storage that autograd records as a cast from bf16/fp16 (an RMSNorm's input in mixed precision)
moves as those 16-bit values and is widened back exactly (`_cast_from`).

Budget mode: the first step offloads everything eligible and records the bytes each layer saves
and (CUDA) the step's peak; later steps keep the last layers' activations on the device (needed
first in backward) while that peak plus what they saved fits the budget, and offload the first
layers (needed last, so their copies hide under the most backward compute).
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import logging
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from reviva._C import TransferEngine, overlap_ratio
from reviva.resources import device_resources
from reviva.sizes import format_bytes, parse_bytes

log = logging.getLogger(__name__)


@dataclass
class ActivationStats:
    """What offload_activations did, over all steps so far (peaks: of the last step)."""

    steps: int = 0
    saved_tensors: int = 0  # pack calls
    offloaded_tensors: int = 0  # saved tensors whose storage went to the host
    kept_tensors: int = 0  # parameters, small tensors, other devices, layers kept by the budget
    bytes_offloaded: int = 0  # D2H bytes (each storage once; narrowed ones at 16 bits)
    narrowed_tensors: int = 0  # fp32 storages moved as the 16-bit values they were cast from
    bytes_restored: int = 0  # H2D bytes
    prefetched: int = 0  # storages brought back ahead of their unpack
    demand_fetched: int = 0  # storages fetched at unpack (no prefetch reached them)
    offloaded_layers: list[int] = field(default_factory=list)  # last step (budget mode)
    layer_saved_bytes: dict[int, int] = field(default_factory=dict)  # recorded on step 1
    stall_ms: float = 0.0  # compute waiting at unpack for an H2D (the engine's stall meter)
    forward_wait_ms: float = 0.0  # the Python thread waiting for D2H copies (window full)
    overlap_ratio: float = 1.0  # Note [Overlap ratio] (reviva._C.overlap_ratio), all steps
    peak_device_bytes: int | None = None  # last step (CUDA)
    step_s: float | None = None  # wall time of the last step (enter to exit)


class _Stored:
    """One offloaded storage: its pinned copy, and the device copy while it is back."""

    __slots__ = (
        "handle",
        "nbytes",
        "layer",
        "restored",
        "transfer",
        "ahead",
        "widen",
        "__weakref__",
    )

    def __init__(self, handle: Any, nbytes: int, layer: int, widen: bool = False) -> None:
        self.handle = handle
        self.widen = widen  # moved at 16 bits: widened back to fp32 on the compute stream
        self.nbytes = nbytes
        self.layer = layer
        self.restored: torch.Tensor | None = None  # the storage on the device (1-D)
        self.transfer: Any = None  # its H2D, until compute was ordered after it
        self.ahead = False  # brought back by prefetch and not unpacked yet

    def __del__(self) -> None:
        # The device copy was allocated on the compute stream without record_stream: its memory
        # is reused in that stream's order, which is safe once compute waited for the H2D (at
        # unpack). Brought back but never unpacked (a node backward did not run): the H2D may
        # still write it, so wait before the memory goes back to torch's allocator.
        if self.transfer is not None and self.restored is not None:
            self.transfer.wait()


@dataclass(frozen=True)
class _Packed:
    stored: _Stored
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


class ActivationOffload:
    """The context manager behind `offload_activations`; one forward+backward per `with`."""

    def __init__(
        self,
        model: nn.Module,
        budget: int | str | None = None,
        prefetch_layers: int = 2,
        min_bytes: int = 1 << 20,
        layers: Sequence[nn.Module] | None = None,
        engine: TransferEngine | None = None,
        window_bytes: int | str = 512 << 20,
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
        self.layers = list(layers) if layers is not None else _decoder_layers(model)
        if not self.layers:
            raise ValueError(
                "offload_activations: no layer boundaries: the model has no decoder layers "
                "(model.model.layers); pass layers=[...] (modules in forward order)"
            )
        # Found with the decoder layers: the output head (get_output_embeddings()). What is saved
        # between the last layer and the head's output (final norm, the head's input) is one
        # more region, offloaded like a layer; what the loss saves after it stays.
        self.head = _output_head(model) if layers is None else None
        self._regions = len(self.layers) + (1 if self.head is not None else 0)
        param = next(model.parameters(), None)
        self.device = param.device if param is not None else torch.device("cpu")
        if engine is None:  # the process's engine and pinned pool (reviva.resources)
            engine = device_resources(self.device).engine
        self.engine = engine
        self._active = False  # inside `with`: a second entry is refused
        self.stats = ActivationStats()
        self._cuda = self.device.type == "cuda"
        self._param_ptrs: set[int] = set()
        # A storage saved again (a view, or saved by a second node) maps to its first copy. The
        # key is (data pointer, bytes); the storage's weak reference tells a live storage from a
        # new one that the caching allocator placed at the address of a freed one.
        self._by_storage: dict[tuple[int, int], tuple[StorageWeakRef, weakref.ReferenceType]] = {}
        self._order: list[weakref.ReferenceType[_Stored]] = []  # offloaded, in saving order
        self._order_layers: list[int] = []  # the layers with offloaded storages, ascending
        self._cursor = -1  # backward: the next entry of _order to bring back (downwards)
        self._grad_layer = 0  # backward: the layer whose gradient is being computed
        self._in_backward = False
        self._ahead = 0  # bytes brought back ahead and not unpacked yet
        self._pending: collections.deque[_Stored] = collections.deque()  # D2H not known done
        self._pending_bytes = 0
        self._layer = 0  # the region whose forward runs now
        self._offload_layers: set[int] | None = None  # None: all
        self._handles: list[Any] = []
        self._hooks_ctx: Any = None
        self._t0 = 0.0
        self._recorded: dict[tuple[int, int], StorageWeakRef] = {}  # counted on the first step
        self._engine_start: dict[str, Any] = {}  # the engine's stats when the step began
        self._copy_ms = 0.0  # copy-stream busy time of this offload's steps
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
        self._by_storage.clear()
        self._order.clear()
        self._order_layers.clear()
        self._cursor = -1
        self._grad_layer = self._regions
        self._in_backward = False
        self._ahead = 0
        self._pending.clear()
        self._pending_bytes = 0
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
        for i, layer in enumerate(self.layers):
            self._handles.append(layer.register_forward_pre_hook(self._make_pre_hook(i)))
            self._handles.append(layer.register_forward_hook(self._make_post_hook(i)))
        if self.head is not None:
            self._handles.append(self.head.register_forward_hook(self._head_post_hook))
        self._engine_start = self.engine.stats()
        self._hooks_ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks_ctx.__enter__()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self._end(exc)
        finally:
            self._active = False

    def _end(self, exc: tuple[object, ...]) -> None:
        if self._hooks_ctx is not None:
            self._hooks_ctx.__exit__(*exc)
            self._hooks_ctx = None
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._pending.clear()
        self._pending_bytes = 0
        if self._cuda:
            self.stats.peak_device_bytes = torch.cuda.max_memory_allocated(self.device)
            if self._offload_layers is None:  # everything offloaded: the floor of budget mode
                self._extra_all = self.stats.peak_device_bytes - self._held
            torch.cuda.synchronize(self.device)
        # The engine is the process's (shared with other users): this step's part of its stall
        # meter and copy time, and the one overlap ratio (Note [Overlap ratio]) over all steps.
        eng, start = self.engine.stats(), self._engine_start
        self.stats.stall_ms += max(eng["compute_stall_ms"] - start["compute_stall_ms"], 0.0)
        for d in ("d2h", "h2d"):
            self._copy_ms += max(eng[d]["busy_ms"] - start[d]["busy_ms"], 0.0)
        self.stats.overlap_ratio = overlap_ratio(self.stats.stall_ms, self._copy_ms)
        self.stats.step_s = time.perf_counter() - self._t0
        self.stats.steps += 1

    def _choose_layers(self) -> set[int] | None:
        """Budget mode: the layers to offload this step (None: all).

        The first step offloads all and measures what each layer saves and (CUDA) the step's
        peak above what the device held before it. A layer kept on the device adds what it saved
        to that floor, so layers are kept from the last one down (their activations are needed
        first in backward, where a copy could not hide) while the sum, plus a prefetch window,
        fits the budget; the first layers, needed last, are offloaded. On the CPU there is no
        peak to measure: the floor is what was saved outside the layers."""
        self._room = None
        self._kept_upto = []
        if self.budget is None or not self.stats.layer_saved_bytes:
            return None
        saved = self.stats.layer_saved_bytes
        n = self._regions
        kept = sum(b for i, b in saved.items() if i < n)
        floor = self._extra_all
        if floor is None:
            floor = sum(b for i, b in saved.items() if i >= n)
        room = self.budget - self._held - floor
        if room < 0:
            log.warning(
                "reviva: activation budget %s cannot be met: with every activation offloaded "
                "the step peaked at %s (%s held before it); offloading all",
                format_bytes(self.budget),
                format_bytes(self._held + floor),
                format_bytes(self._held),
            )
            return None
        # While kept layers run backward, the first offloaded layers' storages already come back
        # (up to window_bytes) beside the kept activations: room for that window too, or keep
        # nothing (measured on the H200: without it a halfway budget was exceeded by 65 MB).
        room_beside_window = room - min(self.window_bytes, sum(saved.values()))
        chosen: set[int] = set()
        for i in range(n):
            if kept <= room_beside_window:
                break
            chosen.add(i)
            kept -= saved.get(i, 0)
        self._room = room
        upto = 0
        for i in range(n):
            upto += 0 if i in chosen else saved.get(i, 0)
            self._kept_upto.append(upto)
        return chosen

    def _window(self, layer: int) -> int:
        """The device bytes that may wait for their D2H (forward) or be brought back ahead
        (backward) while `layer` runs: `window_bytes`, or in budget mode, if more, what the
        budget leaves beside the kept layers' activations on the device then (those of layers
        up to `layer`). The offloaded layers come first, so their copies may lag far behind
        forward compute before the kept layers fill the room, and in backward the first
        offloaded layers come back while the kept layers' activations are freed."""
        if self._room is None or not self._kept_upto:
            return self.window_bytes
        kept = self._kept_upto[min(max(layer, 0), len(self._kept_upto) - 1)]
        return max(self.window_bytes, self._room - kept)

    # --- layer boundaries ------------------------------------------------------------------------

    def _make_pre_hook(self, i: int) -> Any:
        def pre_hook(module: nn.Module, args: Any) -> None:
            self._layer = i

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
        self._in_backward = True
        self._grad_layer = min(self._grad_layer, i)
        self._prefetch()

    def _prefetch(self) -> None:
        """Brings storages back in reverse saving order while the window has room and they
        belong to the next `prefetch_layers` + 1 layers with offloaded storages, counted from the
        one in backward down (in budget mode the last layers keep theirs: the first offloaded
        layer's copies start while their backward runs)."""
        self._retire_copied(limit=None)  # forward's last copies
        if self._cursor < 0:
            self._cursor = len(self._order) - 1
        layers = self._order_layers
        k = bisect.bisect_right(layers, self._grad_layer) - 1
        if k < 0:
            return
        lowest = layers[max(k - self.prefetch_layers, 0)]
        window = self._window(self._grad_layer)
        while self._cursor >= 0 and self._ahead < window:
            stored = self._order[self._cursor]()
            if stored is not None and stored.restored is None:
                if stored.layer < lowest:
                    break
                self._bring_back(stored)
                stored.ahead = True
                self._ahead += stored.nbytes
                self.stats.prefetched += 1
            self._cursor -= 1

    def _bring_back(self, stored: _Stored) -> None:
        """Starts the H2D of a storage; compute is ordered after it when it is unpacked."""
        stored.restored, stored.transfer = self.engine.restore_async(
            stored.handle, record_stream=False
        )
        self.stats.bytes_restored += stored.nbytes

    # --- pack / unpack ---------------------------------------------------------------------------

    def _pack(self, t: torch.Tensor) -> Any:
        self.stats.saved_tensors += 1
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        if (
            t.device != self.device
            or nbytes == 0
            or nbytes < self.min_bytes
            or storage.data_ptr() in self._param_ptrs
            or isinstance(t, nn.Parameter)
            or not 0 <= self._layer < self._regions
            or self._in_backward  # recomputed in backward (checkpointing): needed at once
            or (self._offload_layers is not None and self._layer not in self._offload_layers)
        ):
            if self.stats.steps == 0 and t.device == self.device:
                self._record(storage)
            self.stats.kept_tensors += 1
            return t
        key = (storage.data_ptr(), nbytes)
        entry = self._by_storage.get(key)
        stored = entry[1]() if entry is not None and not entry[0].expired() else None
        if stored is None:
            narrow = _cast_from(t)
            if narrow is None:
                moved = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
            else:  # exact: every value came from `narrow`
                whole = torch.empty(0, dtype=t.dtype, device=t.device).set_(storage)
                moved = whole.to(narrow)
                self.stats.narrowed_tensors += 1
            # record_stream: torch's allocator reuses the memory once the D2H stream passed it.
            handle = self.engine.offload(moved, record_stream=True)
            stored = _Stored(handle, moved.nbytes, self._layer, widen=narrow is not None)
            self._by_storage[key] = (StorageWeakRef(storage), weakref.ref(stored))
            self._order.append(weakref.ref(stored))
            if self._layer not in self._order_layers:
                bisect.insort(self._order_layers, self._layer)
            self.stats.bytes_offloaded += stored.nbytes
            self._throttle(stored)
            if self.stats.steps == 0:
                self._record(storage)
        self.stats.offloaded_tensors += 1
        return _Packed(stored, t.dtype, tuple(t.size()), tuple(t.stride()), t.storage_offset())

    def _throttle(self, stored: _Stored) -> None:
        """Forward: at most a window (`_window`) of device memory waiting for D2H copies."""
        self._pending.append(stored)
        self._pending_bytes += stored.nbytes
        self._retire_copied(limit=self._window(self._layer))

    def _retire_copied(self, limit: int | None) -> None:
        """Drops pending storages whose D2H is done, oldest first, and (with `limit`) waits for
        the oldest while more than `limit` bytes are pending."""
        while self._pending and (
            (limit is not None and self._pending_bytes > limit) or self._pending[0].handle.ready()
        ):
            oldest = self._pending.popleft()
            if not oldest.handle.ready():
                t = time.perf_counter()
                oldest.handle.wait()
                self.stats.forward_wait_ms += (time.perf_counter() - t) * 1e3
            self._pending_bytes -= oldest.nbytes

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
        stored = packed.stored
        if stored.restored is None:
            self._bring_back(stored)
            self.stats.demand_fetched += 1
        elif stored.ahead:
            stored.ahead = False
            self._ahead -= stored.nbytes
        self._prefetch()  # the window has room again: keep the H2D stream busy
        if stored.transfer is not None:
            # Rule 3: compute after the H2D; the engine measures the wait (its stall meter).
            self.engine.wait_for(stored.transfer)
            stored.transfer = None
            if stored.widen:  # on the compute stream, after the H2D
                stored.restored = stored.restored.to(packed.dtype)
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
    min_bytes: int = 1 << 20,
    layers: Sequence[nn.Module] | None = None,
    offload: ActivationOffload | None = None,
    window_bytes: int | str = 512 << 20,
) -> Iterator[ActivationOffload]:
    """Offloads the activations autograd saves inside the block (one forward and its backward).

        offload = reviva.ActivationOffload(model, budget="8GB")   # reuse across steps
        for batch in data:
            with reviva.offload_activations(model, offload=offload):
                loss = model(**batch).loss
                loss.backward()

    Without `offload`, a new ActivationOffload is made (budget mode then measures every step).
    """
    if offload is None:
        offload = ActivationOffload(
            model,
            budget,
            prefetch_layers,
            min_bytes,
            layers,
            window_bytes=window_bytes,
        )
    with offload:
        yield offload
