"""One generate call, step by step: its arguments read (generate/inputs.py), its plan made against
what the device can give now (reviva.plan.planner), the call started (the phase record, the pinned
host copies, the attention kernel), its weights placed and its cache built, the model's own
generate run with that cache under the wrappers (generate/hf_surface.py), and, whatever happens, the
call ended: every byte of device memory it took given back, its statistics collected
(generate/call_stats.py), a returned cache parked.

GenerateCall is a mixin of RevivaManager. State it reads: the manager's layout, config, engine,
arena, pool, runtime, weights, _graphs, _device_kernel, _own_decode, _timeline_capacity. State
it writes, for the call's length: _phase, _cache, _plan, _share, _prefix, _copy_hidden,
_call_kernel, _in_own_call, _ranges, _progress (and _residual, _placeholder and _positions,
cleared at the end); after it: _last_stats, _last_timeline, _last_trace.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import tempfile
import time
import traceback
from typing import Any

import torch

from reviva import switches
from reviva._C import RevivaOutOfMemoryError
from reviva.cache.block_attention import call_kernel
from reviva.cache.kv_cache import RevivaCache
from reviva.cache.returned import without_cache
from reviva.cache.window_rings import rings_wanted
from reviva.generate.call_stats import call_trace, collect
from reviva.generate.host_copies import pin_host_copies
from reviva.generate.inputs import CallRequest, read_call, refuse_for_plan, share_rows
from reviva.generate.stop_check import deferring, defers
from reviva.hf_versions import cache_argument
from reviva.plan.call_plan import Plan
from reviva.sizes import format_bytes
from reviva.trace import PrefillProgress

# (the manager's logger: what a user filters on stays RevivaManager's)
log = logging.getLogger("reviva.manager")

_MiB = 1 << 20


class CallOutOfMemoryError(RevivaOutOfMemoryError, torch.OutOfMemoryError):
    """The device ran out of memory inside a call whose plan fitted (Note [Out of memory
    beyond the plan]): a RevivaOutOfMemoryError and a torch.OutOfMemoryError at once, so code
    catching either (HF's and accelerate's retries catch torch's) still catches it; its message
    ends with torch's."""


# Note [Out of memory beyond the plan]
# A call starts only when its plan fits the budget (plan/planner.py); what the plan cannot see is
# the working set's estimate missing a model's real peak (HF's experts forward was one: Note [The
# experts' working set]) or other memory taken on the device during the call. torch then
# raises its OutOfMemoryError from deep inside a layer, where the user cannot tell that Reviva
# planned the call or what to change. generate re-raises it, after the call's own clean-up, as a
# CallOutOfMemoryError naming where it happened (prefill's layer and chunk size, or the decode
# step) and what the plan held, with the two settings that leave room: smaller prefill chunks
# (RevivaConfig(chunk_tokens=...)) and a smaller vram_budget (free memory outside Reviva's).
# Nothing is retried: a silent retry would hide a wrong estimate. The finished frames of torch's
# exception are cleared first (their lines stay in the traceback): their locals held tensors of
# the call (in Reviva's arena too) for as long as the caller held the exception, so memory the
# call gave back stayed mapped inside a user's `except` block, where a retry would run.


def _beyond_the_plan(error: torch.OutOfMemoryError, plan: Plan, phase: dict[str, Any]) -> str:
    """CallOutOfMemoryError's message for `error`, raised in the call `plan` planned."""
    if "prefill_end" not in phase:
        layers = len(phase.get("layer_events", ()))
        at = f"layer {layers - 1} of {plan.num_layers}" if layers else "before its first layer"
        where = f"in prefill ({at}, chunks of {plan.chunk_tokens} tokens)"
    else:
        where = f"in decode step {phase.get('decode_steps', 0)}"
    return (
        f"RevivaManager.generate ran out of device memory {where}, beyond its plan: budget "
        f"{plan.budget / 1e9:.2f} GB, {len(plan.resident_layers)} of {plan.num_layers} layers' "
        f"K/V resident, an estimated working set of {plan.working_set / 1e9:.2f} GB. Leave more "
        f"room: RevivaConfig(chunk_tokens={max(plan.chunk_tokens // 2, 1)}) (smaller prefill "
        "chunks) or a smaller vram_budget (more of the device left outside Reviva's plan). "
        f"torch: {error}"
    )


class GenerateCall:
    """RevivaManager's generate call, from its arguments to its statistics (see the module)."""

    def _generate(self, inputs: Any, kwargs: dict[str, Any]) -> Any:
        switches.check_all()  # (a bad value refused whichever of them the call's path reads)
        request = read_call(self.layout, inputs, kwargs)
        self.arena.reclaim(True)  # memory a previous call gave back is free before planning
        plan, share, past_tokens = self._plan_call(request)
        cache: RevivaCache | None = None
        returned = False  # (set once generate returned: only then is its cache parked)
        plan = self._start_call(request, plan, share, past_tokens)
        try:
            self._place_weights(plan)
            cache = self._new_cache(plan, request.batch, share)
            self._ready_cache(cache, plan, request, share)
            out = self._run_model_generate(request, cache, plan)
            # (a call that raised returns none; one without a cache, as HF's, none either)
            returned = bool(request.gen.return_dict_in_generate) and request.returns_cache
        finally:
            self._end_call(cache, plan, returned)
        if request.gen.return_dict_in_generate and not request.returns_cache:
            out = without_cache(out)
        return out

    def _plan_call(self, request: CallRequest) -> tuple[Plan, int, int]:
        """The call's plan, the rows sharing each prompt's K/V (Note [Shared prompt K/V] in
        cache/sequence_rows.py) and the tokens of the cache it continues from; raises naming what
        the plan cannot give (call_inputs.refuse_for_plan)."""
        continued, rows, padded = request.continued, request.rows, request.padded
        batch, tokens, new_tokens = request.batch, request.tokens, request.new_tokens
        if continued is not None and rows > 1:
            raise ValueError(
                "RevivaManager.generate: continuing from a returned cache (past_key_values) "
                f"with {rows} sequences per prompt (num_beams / num_return_sequences) is not "
                "supported yet (nor by transformers' own caches): continue with one sequence "
                "per prompt"
            )
        share = 1
        if continued is None:
            share = share_rows(
                self.layout, rows, tokens + new_tokens, padded, request.gen, request.kwargs
            )
        # (a continued call's prefill runs the tokens after the returned cache's alone)
        past_tokens = 0 if continued is None else continued[2]
        # Note [Window rings] (cache/window_rings.py): not for a padded batch continuing a returned
        # cache (HF's mask of its new tokens would start at the ring's first token)
        rings = rings_wanted() and not (continued is not None and padded)
        plan = self.plan(
            batch // share, tokens - past_tokens, new_tokens, padded, past_tokens, rings
        )
        if share > 1 and (plan.kv_fp8 or plan.page_tokens or plan.residual_on_host):
            share = 1  # (K/V attended by blocks or pages, or a prefill from the host: per row)
            plan = self.plan(batch, tokens, new_tokens, padded=padded, rings=rings)
        if continued is not None and plan.residual_on_host:
            raise ValueError(
                "RevivaManager.generate: continuing from a returned cache (past_key_values) with "
                "a plan that keeps the new tokens' hidden states on the host is not supported "
                "yet: raise vram_budget, or use prefill_residual='device'"
            )
        log.info(
            "reviva plan: %d of %d layers resident, %d slots, chunk %d tokens, K/V %.1f MB/layer",
            len(plan.resident_layers),
            plan.num_layers,
            plan.slots,
            plan.chunk_tokens,
            plan.layer_kv_bytes / _MiB,
        )
        refuse_for_plan(self.layout, self.config, plan, request)
        return plan, share, past_tokens

    def _start_call(self, request: CallRequest, plan: Plan, share: int, past_tokens: int) -> Plan:
        """The call's counters reset and its phase record begun; where its decode attends
        (plan/decode_placement.py: the plan made again without rings when the host attends); its
        ranges, progress, pinned host copies (generate/host_copies.py) and attention kernel. Returns
        the plan the call runs."""
        padded = request.padded
        if self.layout.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.layout.device)
        self.arena.reset_peak()
        self.engine.reset_stats()
        self._phase = {"start": self._event(), "map_s": self.arena.stats()["map_s"]}
        self._phase["t0"] = time.perf_counter()  # (the call's start on the host: Note [Traces])
        self._phase["padded"] = padded
        self._phase["host_attention"] = self._decode_attention_on_host(
            plan, request.beams, padded, share
        )
        if self._phase["host_attention"] and plan.ring_layers:
            # (the host attends whole layers: its K/V is in host memory, where a ring saves
            # little; Note [Window rings] in cache/window_rings.py)
            plan = self.plan(
                request.batch // share,
                request.tokens - past_tokens,
                request.new_tokens,
                padded,
                past_tokens,
                False,
            )
        self._ranges.close()
        self._ranges.push("reviva.generate")
        self._ranges.push("reviva.prefill")
        if PrefillProgress.wanted(self.config.progress, plan.prompt_tokens * plan.batch):
            self._progress = PrefillProgress(plan.num_layers, plan.prompt_tokens * plan.batch)
        if self.weights is not None:
            self.weights.store.take_timeline()  # (the call's own events from here)
        # the host's time from the call's start to each step of its set-up (ms): where a first
        # call's time before its first layer goes (prefill_before_first_layer_ms is the device's)
        setup = self._phase["setup_host_ms"] = {}
        t_setup = self._phase["t_setup"] = time.perf_counter()
        self._phase["pin_s"] = pin_host_copies(self.pool, plan, self._phase)
        setup["pinned"] = (time.perf_counter() - t_setup) * 1e3
        self._copy_hidden = bool(request.gen.output_hidden_states)
        self._call_kernel = call_kernel(
            self._device_kernel,
            self.config.attention_kernel,
            plan.prompt_tokens,
            chunked=not plan.whole_attention,
        )
        return plan

    def _place_weights(self, plan: Plan) -> None:
        """Note [Streamed weights]: the plan's resident layers and slots for the call's weights
        (their counters before, for the call's stats); the decode graphs told which layers'
        weights move."""
        weights_before = None
        if self.weights is not None:
            # (writes to the parameters since the last call reach the host copy and the device
            # copies: Note [The user's streamed parameters] in weights/writes.py)
            self.weights.sync()
            # (before set_residency: the call's bytes include the resident layers' first
            # fills and the first streamed layers it starts bringing in)
            weights_before = self.weights.stats()
            self.weights.set_residency(
                list(plan.weight_resident_layers),
                plan.weight_slots,
                plan.weight_prefetch_layers,
            )
            t_setup = self._phase["t_setup"]
            self._phase["setup_host_ms"]["weights_placed"] = (time.perf_counter() - t_setup) * 1e3
        self._phase["weights_before"] = weights_before
        if self._graphs is not None:
            self._graphs.begin_call(self.layout.layers)
            for i in range(plan.weight_layers):
                if i not in plan.weight_resident_layers:  # (their addresses change per use)
                    self._graphs.uncaptured[i] = "its weights stream from pinned host memory"

    def _new_cache(self, plan: Plan, batch: int, share: int) -> RevivaCache:
        """The call's cache, as its plan lays out its K/V."""
        if plan.disk_layers:  # Note [Spilled layers] (src/kv_store_disk.cpp)
            folder = self.config.disk_path or tempfile.gettempdir()
            free = shutil.disk_usage(folder).free
            if free < plan.disk_bytes:
                raise RevivaOutOfMemoryError(
                    f"RevivaManager: {len(plan.disk_layers)} layers' K/V spill to disk, "
                    f"{format_bytes(plan.disk_bytes)} for {plan.capacity} tokens, but {folder} "
                    f"has {format_bytes(free)} free. Set disk_path to a larger disk, or raise "
                    "host_memory."
                )
        return RevivaCache(
            self.engine,
            self.arena,
            plan.num_layers,
            batch,
            self.layout.num_kv_heads,
            self.layout.head_dim,
            self.layout.dtype,
            plan.capacity,
            list(plan.resident_layers),
            plan.slots,
            plan.prefetch_layers,
            self._timeline_capacity,
            kv_fp8=plan.kv_fp8,
            block_tokens=plan.kv_block_tokens,
            runtime=self.runtime,
            page_tokens=plan.page_tokens,
            attention_kernel=self._call_kernel,
            share=share,
            device=self.layout.device,
            rings={i: (self.layout.windows[i], plan.ring_tokens) for i in plan.ring_layers},
            disk_layers=plan.disk_layers,
            disk_staged_layers=plan.disk_staged_layers,
            disk_path=self.config.disk_path,
        )

    def _ready_cache(
        self, cache: RevivaCache, plan: Plan, request: CallRequest, share: int
    ) -> None:
        """The cache set up for the call (its fp8 shadow, masks, page slots, the K/V of a cache
        it continues from, fetch windows) and made the call's, where the wrappers find it."""
        padded, continued = request.padded, request.continued
        cache.fp8_shadow = plan.kv_fp8_shadow_bytes > 0  # Note [fp8 prefill shadow]
        # Note [Prefill masks left to Reviva] (cache/layer.py)
        cache.skip_prefill_masks = (
            not padded
            and continued is None
            and bool(self.layout.windows_shorter_than(plan.prompt_tokens))
        )
        self._phase["store_host"] = time.perf_counter()  # (its timeline's origin)
        if plan.page_slots:
            cache.store.set_page_slots(plan.page_slots)
        if continued is not None:
            cache.load_parked(continued[0], continued[1], continued[2])
            self._prefix = continued[2]
        if (
            self._own_decode
            and request.rows == 1
            and not padded
            and switches.fetch_windows()  # (off: to compare)
        ):
            # Note [Fetch tails] (src/append_blocks.cpp): a sliding layer's reads are all
            # Reviva's own window-sliced calls here, so its fetches copy its window alone
            # (a ring is fetched whole: it is its window already)
            windows = self.layout.windows_shorter_than(plan.capacity)
            cache.set_fetch_windows({i: w for i, w in windows.items() if i not in plan.ring_layers})
        t_setup = self._phase["t_setup"]
        self._phase["setup_host_ms"]["cache_made"] = (time.perf_counter() - t_setup) * 1e3
        self._cache, self._plan = cache, plan
        if self._graphs is not None:  # Note [fp8 attention in the decode graphs]
            self._graphs.cache = cache
        self._share = share

    def _run_model_generate(self, request: CallRequest, cache: RevivaCache, plan: Plan) -> Any:
        """The model's own generate with the call's cache, under the wrappers; torch's out of
        memory re-raised as CallOutOfMemoryError (Note [Out of memory beyond the plan])."""
        # Note [A stop decided a step late] (generate/stop_check.py)
        cache.defers_stop = defers(self.layout.device, request.gen)
        with self, deferring(cache, cache.defers_stop):
            self._in_own_call = True
            try:
                return self.layout.model.generate(
                    request.inputs, **{cache_argument(): cache}, **request.kwargs
                )
            except torch.OutOfMemoryError as e:
                if isinstance(e, RevivaOutOfMemoryError):
                    raise
                # (the finished frames' locals let go: their tensors would keep the call's
                # device memory for as long as the caller holds the exception)
                traceback.clear_frames(e.__traceback__)
                oom = CallOutOfMemoryError(_beyond_the_plan(e, plan, self._phase))
                raise oom from e
            finally:
                self._in_own_call = False

    def _end_call(self, cache: RevivaCache | None, plan: Plan, returned: bool) -> None:
        """The call ends, on success or on any exception: the pinning helper joined, the
        phase's end event, the call's state cleared, the cache finished (_finish_call), the
        host residual's copies waited for, streamed weights' device memory given back."""
        thread = self._phase.get("pin_thread")
        if thread is not None:
            # (a prefill that raised before layer 2: the helper ends without pinning)
            self._phase["pin_cancel"] = not self._phase["pin_go"].is_set()
            self._phase["pin_go"].set()
            thread.join()  # no helper thread outlives its call
        self._phase["end"] = self._event()
        self._ranges.close()
        if self._progress is not None:
            self._progress.close()
            self._progress = None
        self._copy_hidden = False
        self._share = 1
        prefix, self._prefix = self._prefix, 0
        self._cache, self._plan = None, None
        if self._graphs is not None:
            self._graphs.cache = None
        try:
            if cache is not None:
                # (a cache generate returns is parked: Note [A returned cache])
                self._finish_call(cache, plan, park=returned, prefix=prefix)
        finally:
            if self._residual is not None and self.layout.device.type == "cuda":
                torch.cuda.synchronize(self.layout.device)  # its copies end before it goes back
            self._residual, self._placeholder, self._positions = None, None, None
            if self.weights is not None:
                self.weights.trim()  # streamed layers' device memory back; resident stay
        self.arena.reclaim(True)

    def _finish_call(
        self, cache: RevivaCache, plan: Plan, park: bool = False, prefix: int = 0
    ) -> None:
        """Waits for the call's work, collects its statistics, and closes the cache: its device
        memory goes back to the arena (and from there to the device). With `park` (a call that
        returns its cache) the cache's K/V is first parked in pinned host memory (Note [A
        returned cache] in cache/returned.py)."""
        try:
            if self.layout.device.type == "cuda":
                torch.cuda.synchronize(self.layout.device)
            cache.store.synchronize()
            stats = collect(self, cache, plan)
            self._last_timeline, self._last_trace = [], None  # (never an older call's)
            if self._timeline_capacity:
                self._last_timeline = cache.store.timeline()
                self._last_trace = call_trace(self, stats)
            if park:
                cache.park(self.pool)
            self._last_stats = dataclasses.replace(
                stats, continued_tokens=prefix, returned_cache_host_bytes=cache.parked_bytes
            )
        finally:
            cache.close()
