"""The decode steps' CUDA graphs (Note [Decode graphs]): DecodeGraphs captures each layer's
decode compute, on the capture stream (generate/graph_capture.py), and replays it a step at a time;
with fp8 K/V the attention is inside the graph (Note [fp8 attention in the decode graphs]), and the
compute around it on the row operations where the layer fits them (generate/decode_ops.py)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from reviva import switches
from reviva.cache.kv_cache import RevivaCache
from reviva.generate.decode_ops import RowOpsStep, unsupported
from reviva.generate.graph_capture import (
    capture_stream,
    collection_paused,
    param_ptrs,
    param_shapes,
    uncapturable,
)
from reviva.generate.layer_attention import write_and_attend

if TYPE_CHECKING:
    from reviva.generate.llama_layer import LlamaLayerPath

log = logging.getLogger("reviva.decode_graphs")  # (the name users filter on)

# Note [Decode graphs]
# ~~~~~~~~~~~~~~~~~~~~
# A decode step is tens of small kernels per layer, each issued by Python: on the H200's host
# 1.05-1.15 ms per layer (benchmarks/diagnostics/diag_host.py; plain HF 0.94-1.34), about as
# long as a streamed layer's K/V takes over PCIe at 64k. The host, not the copies, then set the
# pace, and any noise on it showed as slower decode. So the compute before attention (input norm,
# projections, q/k norms, RoPE) and after it (o_proj, residual, MLP) is captured as two CUDA
# graphs per layer and replayed (0.20-0.26 ms per layer on the same host); what changes from
# step to step stays outside them: the K/V write into the store and the attention over a length
# that grows (eager, on torch's stream, between the two replays). The graphs read and write
# static buffers shared by all layers (the hidden state, cos/sin, the attention output), and
# their temporaries come from one graph memory pool; replays run one after another on one
# stream, so the pool's reuse across graphs is safe. The kernels are the eager path's, in the
# same order (the projections' GEMMs are cuBLAS's in both).
#
# When: before decode, when at least 8 decode steps are to come (capture_ahead). From prefill's
# middle layer on (once the helper thread's pinning is done), as each layer's prefill is about
# to be issued the host captures layers while the device still works through what is queued (an
# event recorded then; the host runs about one layer, ~120 ms at 64k, ahead of the device), so
# that the captures hide under prefill's compute; at the end of prefill (the final norm) it
# captures every layer still without graphs. A layer left out (an
# out-of-memory there) runs its decode steps eagerly and is captured at the end of a step: all
# waiting layers when at least CAPTURE_ALL_STEPS steps are to come, else while the step still
# runs on the device, at least one per step and for at most CAPTURE_MS_MAX (capture_pending).
# A layer is warmed up on
# a side stream (kernels loaded, cuBLAS initialised for the stream) before its capture only if
# no layer of the same parameter shapes was since the static buffers were made; captures run
# in "thread_local" mode so that the core's threads may keep polling their events. History,
# call 1 of 64k on a 24 GB card (H200): a fixed 10 ms per step (f9e5872) left it at 19.0-19.5
# tok/s against 21.6-21.7 later (163-194 eager layer steps); capturing only while the step ran
# on the device (99852c0-0620178) gave 21.0 tok/s on a warm machine (147 eager layer steps) but
# 18.1 on a freshly started one, whose host had no slack in decode: about one capture a step,
# 464 eager layer steps at ~0.33 ms over a replay each. Capturing every layer at the end of
# prefill (5c3b5e3) gave call 1 21.4 tok/s (1.062x the roofline) with no eager step, and took
# 202 ms there against ~116 ms of prefill left on the device (diag_phases: ~90 ms past the last
# layer). Capturing there only while prefill still ran on the device (0a8d6d4) captured one
# layer (the process's first capture loads the decode-shaped kernels) and left 31 to the end of
# decode step 1: call 1 20.2 tok/s, 1.125x. The first call's prefill has the room (1.08x plain
# HF's there, limit 1.15x), its decode does not (limit 1.1x). Capturing right after each layer's
# prefill, from layer 0 and whatever the device's state (1659665, 612b104), cost the first
# call's prefill 1.1-2.0 s. Capturing all at the end of prefill (c29e16d, a fresh machine) gave
# call 1 21.4 tok/s (1.064x) and prefill 1.058x plain HF's call 1, but 1.174x Reviva's own call 2
# (plain HF: 1.146x): 159 ms after the last layer against 7 in call 2, the captures' 234 ms less
# what the device still had queued. Hence the captures while prefill's later layers are issued.
# Graphs last as long as the manager; they are dropped when a layer's parameters move (data
# pointers change) or the batch changes, and a capture that fails turns graphs off for the
# manager, logged and in the stats (an out-of-memory while capturing leaves that layer eager for
# the call). A layer is captured only when each part the path calls is a plain module whose
# forward is its kernels (uncapturable(): nn.Linear itself or transformers' own norms, MLPs and
# activations; no forward hooks on them, no global module hooks, no accelerate hook, not
# training): a replay skips any Python, so an adapter whose state changes between calls (a LoRA
# merged, disabled or switched) or a hook would silently not take effect. Under autocast the
# eager path runs (the graphs were captured without it).

# Note [fp8 attention in the decode graphs]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# With fp8 K/V a layer's decode step is one graph: its compute before attention, the fused fp8
# attention call (Note [fp8 decode attention] in src/fp8_attention.cpp: the new token's rows
# written, the rows read in place) and its compute after. What changes from step to step is
# read by the kernels when they run: the step's length from a device scalar the host fills once
# a step (shared by every layer), the rows' addresses from two device words per layer, filled
# when the layer's buffer moved (a new call's cache, a streamed layer's staging slot). The
# splits are fixed at capture by the layer's capacity and each replay cuts its keys among
# them; so a layer's graph serves the calls whose cache gives the layer the capacity it was
# captured for, and is captured again in a call that gives it another (replayed over another
# capacity it gave NaN logits from the second decode step on: H100, fp8, 1B widths, a 4096-token
# call then a 4166- or a 4103-token one in one manager; graphs off, or a fresh manager, finite).
# Around each replay the host still reserves the new row and reports it written (the
# store's bookkeeping, and a streamed layer's copy to its host row). Measured on the H200 (64k, 8B
# shape, every layer resident on a 24 GB card): 87.1-88.7 tok/s in one graph per layer (c27175f)
# against 87.4-90.5 with the attention eager between two replays as bf16's is (33e5ea4): the step
# is bound by the device (busy ~10.8 ms of ~11.3, diag_decode_profile.py), not by the host, so
# the graph saves host time but not step time; the attention kernel's rate is what is left.
# The "busy" figure above summed the kernels' durations; the device's idle time between kernels
# inside the graph (a launch latency each, ~1500 kernels a step) is not in it. The compute around
# attention runs on Reviva's row operations where the layer computes what they compute (Note
# [Decode row ops] in src/row_ops.cpp; generate/decode_ops.py), ~20 kernels a layer instead of ~47.
CAPTURE_MS_MAX = 200.0
# With this many decode steps to come, capture_pending captures every waiting layer at once: a
# capture costs the host ~3-6 ms, an eager layer step ~0.33 ms over a replay (H200, 64k on a
# 24 GB card: 464 eager layer steps cost call 1 ~150 ms, 0620178), so it pays for itself in
# ~10-18 steps.
CAPTURE_ALL_STEPS = 16


class DecodeGraphs:
    """CUDA graphs of the per-layer decode compute around attention (Note [Decode graphs])."""

    def __init__(self, path: LlamaLayerPath) -> None:
        self.path = path
        self.layers: dict[int, tuple[Any, Any, tuple[torch.Tensor, ...], tuple[int, ...]]] = {}
        self.failed: str | None = None  # why graphs were turned off, if they were
        self.capture_ms = 0.0
        self.replays = 0
        self.captured = 0  # layers captured in this call
        self.captured_ahead = 0  # of which before decode (capture_ahead)
        self.captured_in_layers = 0  # of which while prefill's layers were issued
        self.eager_steps = 0  # layer steps of this call run eagerly, before their capture
        self._pending: dict[int, tuple[nn.Module, torch.Tensor, torch.Tensor]] = {}
        # Called with a layer's index on the capture stream before its warm-up and capture: it
        # orders that stream after whatever the layer's parameters wait for (a resident layer's
        # weights still being filled: RevivaManager._weights_ready).
        self.before_capture: Callable[[int], None] | None = None
        # Layers left eager in this call, and why (uncapturable(), or a failed capture).
        self.uncaptured: dict[int, str] = {}
        self._static: dict[str, torch.Tensor] = {}
        self._pool: Any = None
        self._cos: torch.Tensor | None = None
        # Parameter shapes (and dtypes) of layers warmed up since the static buffers were made.
        self._warm: set[tuple[tuple[Any, ...], ...]] = set()
        # Note [fp8 attention in the decode graphs]: the call's cache (set by the manager), the
        # layers whose one graph holds their attention, each layer's rows' addresses on the
        # device and on the host (as last written), and the step length last written.
        self.cache: RevivaCache | None = None
        self.fused: set[int] = set()
        self._rows_dev: dict[int, torch.Tensor] = {}
        self._rows_at: dict[int, tuple[int, int]] = {}
        self._length_at: int | None = None
        # the layer's capacity in the cache its one graph was captured for: the fused call's
        # splits and workspace were set by it (Note [fp8 attention in the decode graphs])
        self._fused_capacity: dict[int, int] = {}
        # Note [Decode row ops]: the fused layers whose graph runs them, why layers of each
        # parameter shape may not (None: they may), and the step that runs them.
        self.row_ops: set[int] = set()
        self._row_ops_why: dict[tuple[tuple[Any, ...], ...], str | None] = {}
        self._row_step: RowOpsStep | None = None

    def begin_call(self, layers: list[nn.Module]) -> None:
        """Drops the graphs of layers whose parameters moved since their capture."""
        self.replays = 0
        self.capture_ms = 0.0
        self.captured = 0
        self.captured_ahead = 0
        self.captured_in_layers = 0
        self.eager_steps = 0
        self._pending.clear()
        self.uncaptured.clear()
        for i in list(self.layers):
            if self.layers[i][3] != param_ptrs(layers[i]) or uncapturable(layers[i]) is not None:
                del self.layers[i]
                self.fused.discard(i)
                self.row_ops.discard(i)

    def ready(self, i: int, h: torch.Tensor) -> bool:
        """Layer i has graphs for decode steps of h's batch and dtype ([batch, 1, hidden])."""
        if self.failed is not None or i not in self.layers or h.shape[1] != 1:
            return False
        if torch.is_autocast_enabled(h.device.type):  # the capture ran without autocast
            return False
        st = self._static.get("h")
        if st is None or st.shape[0] != h.shape[0] or st.dtype != h.dtype:
            return False
        if i in self.fused and (
            self.cache is None
            or not self.cache.fp8_graphable(i)
            or self.cache.store.capacity(i) != self._fused_capacity.get(i)
        ):
            # (this call's cache attends it otherwise, or holds another capacity than the one
            # its graph's launch was set up for: captured again. Replayed over another
            # capacity, the graph of a 4096-token call gave NaN from the second decode step of
            # a 4166-token one on the H100, in calls of one manager; see the Note.)
            del self.layers[i]
            self.fused.discard(i)
            self.row_ops.discard(i)
            return False
        return True

    def step(
        self,
        cache: RevivaCache,
        i: int,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        past: int,
    ) -> torch.Tensor:
        front, back, (q, k, v), _ = self.layers[i]
        st = self._static
        if h.data_ptr() != st["h"].data_ptr():
            st["h"].copy_(h)
        if cos is not self._cos:  # a new step's position
            st["cos"].copy_(cos)
            st["sin"].copy_(sin)
            self._cos = cos
        if back is None:  # Note [fp8 attention in the decode graphs]: one graph, the whole layer
            if self._length_at != past + 1:
                st["length"].fill_(past + 1)
                self._length_at = past + 1
            at = cache.store.rows_address(i)
            if self._rows_at.get(i) != at:
                self._rows_dev[i][0].fill_(at[0])
                self._rows_dev[i][1].fill_(at[1])
                self._rows_at[i] = at
            cache.reserve(i, past + 1)
            front.replay()
            cache.store.wrote(i, past, 1)
            self.replays += 1
            return st["h"]
        front.replay()
        attn = self.path.layout.layers[i].self_attn
        window = self.path.layout.windows[i]
        if cache.attends_fp8_in_place(i, q, None):  # straight into the static buffer
            att = st["att"].transpose(1, 2)
            cache.attend_fp8_decode(i, past, q, k, v, attn.scaling, window, out=att)
        else:
            out = write_and_attend(cache, i, q, k, v, past, past + 1, attn.scaling, None, window)
            st["att"].copy_(out.transpose(1, 2))
        back.replay()
        self.replays += 1
        return st["h"]

    def defer(self, i: int, layer: nn.Module, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Layer i ran a decode step eagerly: it waits for capture at the end of a step, unless
        something in it must run in Python at every step (uncapturable())."""
        self.eager_steps += 1
        if self.failed is not None or i in self.uncaptured:
            return
        why = uncapturable(layer)
        if why is not None:
            self.uncaptured[i] = why
            log.info("reviva: decode layer %d stays eager (%s)", i, why)
            return
        self._pending[i] = (layer, cos, sin)

    def capture_pending(self, h: torch.Tensor, steps_left: int) -> None:
        """At the end of a decode step (h: its hidden state, [batch, 1, hidden]; steps_left:
        decode steps still to come): captures the waiting layers, lowest first, all of them when
        at least CAPTURE_ALL_STEPS steps are to come, else while the device still works through
        the step (at least one per step, at most CAPTURE_MS_MAX of host time)."""
        if not self._pending or h.shape[1] != 1 or torch.is_autocast_enabled(h.device.type):
            return
        t = time.perf_counter()
        step_done = torch.cuda.Event()
        step_done.record(torch.cuda.current_stream(h.device))
        for i in sorted(self._pending):
            layer, cos, sin = self._pending.pop(i)
            self.capture(i, layer, h, cos, sin)
            if steps_left >= CAPTURE_ALL_STEPS:
                continue
            if step_done.query() or (time.perf_counter() - t) * 1e3 >= CAPTURE_MS_MAX:
                break

    def capture_ahead(
        self,
        layers: list[nn.Module],
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        busy: torch.cuda.Event | None = None,
    ) -> None:
        """Before decode: captures the layers that have no graphs yet, lowest first, for decode
        steps shaped like h ([batch, 1, hidden]) and cos/sin ([., 1, rotary dim]). With busy (an
        event just recorded on the compute stream, while prefill's later layers are issued),
        only while the device has not reached it and for at most CAPTURE_MS_MAX; without (the
        end of prefill), all of them. After an out-of-memory here the rest are left to decode's
        captures (capture_pending). A layer that cannot be captured (uncapturable()) is left to
        decode, which keeps it eager."""
        if torch.is_autocast_enabled(h.device.type):  # decode runs eagerly then (ready())
            return
        t = time.perf_counter()
        for i, layer in enumerate(layers):
            if self.failed is not None:
                return
            if i in self.uncaptured or (i in self.layers and self.ready(i, h)):
                continue  # (graphs of another batch or dtype are replaced: capture())
            why = uncapturable(layer)
            if why is not None:
                self.uncaptured[i] = why
                log.info("reviva: decode layer %d stays eager (%s)", i, why)
                continue
            if busy is not None and (
                busy.query() or (time.perf_counter() - t) * 1e3 >= CAPTURE_MS_MAX
            ):
                return
            self.capture(i, layer, h, cos, sin)
            if self.uncaptured.get(i, "").startswith("out of memory"):
                del self.uncaptured[i]  # (decode tries again, when prefill's memory is free)
                return
            self.captured_ahead += i in self.layers
            self.captured_in_layers += busy is not None and i in self.layers

    def capture(
        self,
        i: int,
        layer: nn.Module,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> None:
        """Captures layer i's two graphs for decode steps of h's batch and dtype (cos/sin: a
        step's position embeddings, for their shapes). On failure turns graphs off for the
        manager."""
        if self.failed is not None:
            return
        path = self.path
        t = time.perf_counter()
        try:
            st = self._static
            batch, hidden = h.shape[0], h.shape[2]
            fresh = st.get("h") is None or st["h"].shape[0] != batch or st["h"].dtype != h.dtype
            if fresh:  # (another batch: new static buffers, new graphs)
                self.layers.clear()
                lay = path.layout
                kw = dict(dtype=h.dtype, device=h.device)
                cos_shape = (batch, 1, cos.shape[-1])
                new = {
                    "length": torch.ones(1, dtype=torch.int64, device=h.device),
                    "h": torch.zeros(batch, 1, hidden, **kw),
                    "cos": torch.zeros(cos_shape, dtype=cos.dtype, device=h.device),
                    "sin": torch.zeros(cos_shape, dtype=sin.dtype, device=h.device),
                    "att": torch.zeros(batch, 1, lay.num_heads, lay.head_dim, **kw),
                }
                pool = torch.cuda.graph_pool_handle()
                st.clear()  # all or nothing: a step never sees one batch's h with another's att
                st.update(new)
                self._pool = pool
                self._cos = None
                self._warm.clear()
                self.fused.clear()
                self._length_at = None
            stream = capture_stream(h.device)
            compute = torch.cuda.current_stream(h.device)
            stream.wait_stream(compute)
            shapes = param_shapes(layer)
            with torch.cuda.stream(stream):
                if self.before_capture is not None:
                    self.before_capture(i)
                if shapes not in self._warm:
                    # Warm-up on this stream (kernels loaded, cuBLAS's workspace for the
                    # stream), on a copy of the hidden state: the static one may hold a step in
                    # progress. Layers of the same shapes run the same kernels.
                    path._qkv(layer, st["h"], 0, 1, st["cos"], st["sin"])
                    path._finish(layer, st["h"].clone(), 0, 1, st["att"])
                    self._warm.add(shapes)
                ops = None
                if self.cache is not None and self.cache.fp8_graphable(i):
                    ops = self._row_ops_for(i, layer, shapes, cos, sin)
                    graphs = self._capture_fused(i, layer, ops)
                else:
                    graphs = self._capture_two(layer)
            compute.wait_stream(stream)
            self.layers[i] = (*graphs, param_ptrs(layer))
            self.fused.discard(i)
            self.row_ops.discard(i)
            if graphs[1] is None:
                self.fused.add(i)
                self._fused_capacity[i] = self.cache.store.capacity(i)
            if ops is not None:
                self.row_ops.add(i)
            self.captured += 1
        except torch.OutOfMemoryError as e:  # this layer stays eager in this call
            self.uncaptured[i] = f"out of memory while capturing: {e}"[:200]
            log.info("reviva: decode layer %d stays eager (%s)", i, self.uncaptured[i])
        except Exception as e:  # noqa: BLE001 (any other capture failure: decode goes on eagerly)
            self.failed = f"{type(e).__name__}: {e}"
            self.layers.clear()
            self.fused.clear()
            self._pending.clear()
            log.warning("reviva: CUDA graphs for decode turned off (%s)", self.failed)
        finally:
            self.capture_ms += (time.perf_counter() - t) * 1e3

    def _capture_two(self, layer: nn.Module) -> tuple[Any, Any, tuple[torch.Tensor, ...]]:
        """The layer's compute before attention and after it as two graphs (Note [Decode
        graphs]), and the queries, keys and values the first leaves in the graphs' pool."""
        st, path = self._static, self.path
        front = torch.cuda.CUDAGraph()
        with collection_paused():
            front.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                qkv = path._qkv(layer, st["h"], 0, 1, st["cos"], st["sin"])
            finally:
                front.capture_end()
        back = torch.cuda.CUDAGraph()
        with collection_paused():
            back.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                path._finish(layer, st["h"], 0, 1, st["att"])
            finally:
                back.capture_end()
        return front, back, qkv

    def _row_ops_for(
        self,
        i: int,
        layer: nn.Module,
        shapes: tuple[tuple[Any, ...], ...],
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> RowOpsStep | None:
        """Note [Decode row ops]: the step on the row operations for layer i's one graph, where
        the layer computes what they compute (decided once per parameter shapes: the modules'
        kinds, then both ways on random input against HF's modules), else None."""
        if not switches.decode_row_ops():
            return None
        st = self._static
        if shapes not in self._row_ops_why:
            why = unsupported(layer, self.path.layout, st["h"].dtype, cos)
            if why is None:
                if self._row_step is None:
                    self._row_step = RowOpsStep(self.path.layout, st["h"].device)
                # (a generator of its own: the user's random stream is left as it was)
                gen = torch.Generator(device=st["h"].device).manual_seed(0)
                h, att = (
                    torch.randn(t.shape, generator=gen, device=t.device).to(t.dtype)
                    for t in (st["h"], st["att"])
                )
                why = self._row_step.agrees(self.path, layer, h, cos, sin, att)
            self._row_ops_why[shapes] = why
            if why is not None:
                log.info("reviva: decode layer %d keeps HF's modules (%s)", i, why)
        return self._row_step if self._row_ops_why[shapes] is None else None

    def _capture_fused(
        self, i: int, layer: nn.Module, ops: RowOpsStep | None = None
    ) -> tuple[Any, None, tuple[Any, ...]]:
        """Note [fp8 attention in the decode graphs]: layer i's step as one graph with its fp8
        attention inside (None in place of the second graph); with `ops`, the compute around
        attention on the row operations (Note [Decode row ops])."""
        st, path, cache = self._static, self.path, self.cache
        assert cache is not None
        rows = self._rows_dev.get(i)
        if rows is None:
            rows = self._rows_dev[i] = torch.zeros(2, dtype=torch.int64, device=st["h"].device)
        self._rows_at.pop(i, None)  # (written at the first replay)
        attn = path.layout.layers[i].self_attn
        window = path.layout.windows[i] or 0
        graph = torch.cuda.CUDAGraph()
        with collection_paused():
            graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                if ops is not None:
                    q, k, v = ops.qkv(layer, st["h"], st["cos"], st["sin"])
                else:
                    q, k, v = path._qkv(layer, st["h"], 0, 1, st["cos"], st["sin"])
                out = st["att"].transpose(1, 2)
                cache.store.attend_fp8_decode_graphed(
                    i, q, k, v, attn.scaling, window, st["length"], rows, out
                )
                if ops is not None:
                    ops.finish(layer, st["h"], st["att"])
                else:
                    path._finish(layer, st["h"], 0, 1, st["att"])
            finally:
                graph.capture_end()
        return graph, None, (q, k, v)
