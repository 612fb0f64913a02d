"""What a generate call did, collected at its end: its GenerateStats (stats.py: one definition of
each figure) from the phase events (generate/phases.py), the cache's store, the copy engine, the
arena and the streamed weights; and its Chrome trace (trace.py, Note [Traces]). Plain functions
that read the manager and its last call; nothing here changes what the call does (the one write
is _phase_peak's reset of the peak counters, where the decode phase's peak is read).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from reviva import switches
from reviva._C import DeviceArena, PinnedHostPool, Runtime, TransferEngine
from reviva.adapters import DecoderLayout
from reviva.cache.kv_cache import RevivaCache
from reviva.config import RevivaConfig
from reviva.generate.stop_check import stop_state
from reviva.plan.call_plan import Plan
from reviva.stats import GenerateStats, PhaseStats
from reviva.trace import chrome_trace, span, store_spans

if TYPE_CHECKING:
    from reviva.generate.decode_graphs import DecodeGraphs
    from reviva.weights.host_embedding import HostEmbedding
    from reviva.weights.streamed import StreamedWeights


class _Manager(Protocol):
    """What the functions here read of a RevivaManager (generate/manager.py) and its last call."""

    layout: DecoderLayout
    runtime: Runtime
    pool: PinnedHostPool
    engine: TransferEngine
    arena: DeviceArena
    weights: StreamedWeights | None
    host_embedding: HostEmbedding | None
    _graphs: DecodeGraphs | None
    _phase: dict[str, Any]
    _last_timeline: list[dict[str, Any]]
    _call_kernel: str

    config: RevivaConfig

    def _phase_peak(self) -> int | None: ...


def phase_s(ph: dict[str, Any], a: str, b: str) -> float | None:
    """Seconds between the phase events a and b of a call, None if either is missing."""
    if a not in ph or b not in ph:
        return None
    return elapsed_s(ph[a], ph[b])


def elapsed_s(a: Any, b: Any) -> float:
    """Seconds from event a to event b (CUDA events, or the host's perf_counter on the CPU)."""
    if isinstance(a, float):
        return b - a
    return a.elapsed_time(b) / 1000.0


def phase_counters(manager: _Manager, cache: RevivaCache | None) -> dict[str, float]:
    """The call's copy and stall counters so far (the engine's are reset at its start; the
    weight store's are its manager's, counted from weights_before)."""
    eng = manager.engine.stats()
    out = {
        "to_device": eng["to_device"]["bytes_submitted"],
        "to_host": eng["to_host"]["bytes_submitted"],
        "stall_s": cache.store.stats()["compute_stall_s"] if cache is not None else 0.0,
    }
    before = manager._phase.get("weights_before")
    if manager.weights is not None and before is not None:
        out["stall_s"] += manager.weights.stats()["compute_stall_s"] - before["compute_stall_s"]
    return out


def collect(manager: _Manager, cache: RevivaCache, plan: Plan) -> GenerateStats:
    st = cache.store.stats()
    eng = manager.engine.stats()
    arena = manager.arena.stats()
    ph = manager._phase
    prefill_end = ph.get("prefill_end", ph["end"])
    prefill_s = elapsed_s(ph["start"], prefill_end)
    decode_s = elapsed_s(prefill_end, ph["end"])
    ran = ph.get("decode_steps", 0)
    # (less the step run past a stop and taken back: Note [A stop decided a step late])
    steps = ran - cache.undone_steps
    layer_kv = plan.layer_kv_bytes
    # (rings hold their rows alone: Note [Window rings] in cache/window_rings.py)
    kv_total = sum(plan.kv_tokens(i) for i in range(plan.num_layers)) * plan.kv_token_bytes
    # Compute's waits for K/V fetches: the store's manager's meter (the one stall meter of
    # the residency engine; the store is the call's own).
    stall_s = st["compute_stall_s"]
    prefill_peak = ph.get("prefill_peak")
    decode_peak = manager._phase_peak()
    peaks = [p for p in (prefill_peak, decode_peak) if p is not None]
    weights = weight_stats(manager, plan)
    end = phase_counters(manager, cache)
    mid = ph.get("prefill_counters", end)
    rows = plan.batch
    resident_end = st["resident_layers"]
    prefill = PhaseStats(
        seconds=prefill_s,
        tokens=plan.prompt_tokens * rows,
        peak_device_bytes=prefill_peak,
        bytes_to_device=int(mid["to_device"]),
        bytes_to_host=int(mid["to_host"]),
        stall_s=mid["stall_s"],
        kv_streamed_layers=plan.num_layers - len(plan.resident_layers),
        kv_resident_layers=len(plan.resident_layers),
        weight_streamed_layers=plan.weight_layers - len(plan.weight_resident_layers),
    )
    decode = PhaseStats(
        seconds=decode_s,
        tokens=steps * rows,
        peak_device_bytes=decode_peak,
        bytes_to_device=int(end["to_device"] - mid["to_device"]),
        bytes_to_host=int(end["to_host"] - mid["to_host"]),
        stall_s=end["stall_s"] - mid["stall_s"],
        kv_streamed_layers=plan.num_layers - resident_end,
        kv_resident_layers=resident_end,
        weight_streamed_layers=weights.get("weight_streamed_layers", 0),
    )
    refusal = ph.get("first_promotion_refusal")
    return GenerateStats(
        device=str(manager.layout.device),
        backend=manager.runtime.backend,
        budget_bytes=plan.budget,
        requested_budget_bytes=plan.requested_budget,
        device_limit_bytes=plan.device_limit,
        prefill=prefill,
        decode=decode,
        # Torch's tensors and the arena's K/V, at most, by phase (_phase_peak).
        peak_device_bytes=max(peaks) if peaks else None,
        bytes_to_device=eng["to_device"]["bytes_completed"],
        bytes_to_host=eng["to_host"]["bytes_completed"],
        to_device_gbps=eng["to_device"]["bandwidth_gbps"],
        copy_to_device_s=eng["to_device"]["busy_s"],
        stall_s=stall_s,
        overlap_ratio=st["overlap_ratio"],  # Note [Overlap ratio], the store's copies
        # Note [fp8 K/V rows]: the K/V format, and the largest relative round-trip error of a
        # layer's prompt K or V (||x - fp8(x)|| / ||x||) when it is fp8.
        kv_dtype="fp8" if plan.kv_fp8 else str(manager.layout.dtype).replace("torch.", ""),
        kv_cache_bytes=kv_total,
        kv_device_bytes=st["device_bytes"],
        kv_device_peak_bytes=st["peak_device_bytes"],
        device_bytes_saved=max(kv_total - st["device_bytes"], 0),
        host_bytes=st["host_bytes"],
        pinned_reserved_bytes=manager.pool.stats()["bytes_reserved"],
        layer_kv_bytes=layer_kv,
        kv_fp8_rel_error=cache.fp8_error if plan.kv_fp8 else None,
        kv_block_tokens=plan.kv_block_tokens,
        kv_fp8_prefill_shadow_bytes=plan.kv_fp8_shadow_bytes,
        # Note [Paged layers]: layers kept in pages, the page size and the pages' staging room
        kv_page_tokens=plan.page_tokens,
        paged_layers=st["paged_layers"],
        page_slots=st["page_slots"],
        # Note [Shared prompt K/V]: rows per prompt holding its K/V once (1: a copy per row)
        shared_prompt_rows=cache.share,
        # Note [Fetch tails]: sliding layers fetched as their window alone
        fetch_window_layers=len(cache.fetch_windows),
        window_ring_layers=len(cache.rings),
        window_ring_tokens=plan.ring_tokens if cache.rings else 0,
        disk_layers=st["spilled_layers"],
        disk_staged_layers=plan.disk_staged_layers,
        disk_peak_staged_layers=st["peak_staged_layers"],
        disk_bytes=st.get("disk_peak_bytes", 0),
        disk_reads=st["disk_reads"],
        disk_staging_hits=st["staging_hits"],
        bytes_from_disk=st["bytes_from_disk"],
        bytes_to_disk=st["bytes_to_disk"],
        disk_wait_s=st["disk_wait_s"],
        disk_file=st.get("disk_file"),
        disk_io_uring=st.get("disk_io_uring"),
        disk_direct_io=st.get("disk_direct_io"),
        generated_rows_bytes=cache.generated_bytes,
        resident_layers=resident_end,
        # which layers' K/V streamed at the call's end (decode, after promotions)
        streamed_layers=st["streamed_layers"],
        streamed_layer_ids=[i for i in range(plan.num_layers) if not cache.store.resident(i)],
        resident_layers_in_prefill=len(plan.resident_layers),
        promoted_layers=st["promotions"],
        promotion_failures=st["promotion_failures"],
        promotions_refused_by_device=ph.get("promotions_refused_by_device", 0),
        first_promotion_refusal=dict(refusal) if refusal else None,
        prefetches_without_memory=st["prefetches_without_memory"],
        prefetches_deferred=st["prefetches_deferred"],
        slots=plan.slots,
        decode_slots=st["slots"],
        decode_attention="host" if ph.get("host_attention") else "device",
        host_attended_layers=st["host_attended_layers"],
        weight_layers_promoted_in_decode=ph.get("weights_promoted_for_host", 0),
        host_attention_s=cache.host_attention_s,
        host_attention_wait_s=cache.host_wait_s,
        host_attention_calls=cache.host_attention_calls,
        bytes_written_on_host=st["bytes_written_on_host"],
        prefetch_window=plan.prefetch_layers,
        fills=st["fills"],
        prefetched_fills=st["prefetched_fills"],
        slot_hits=st["slot_hits"],
        prompt_tokens=plan.prompt_tokens,
        chunk_tokens=plan.chunk_tokens,
        prefill_residual="host" if plan.residual_on_host else "device",
        residual_host_bytes=plan.residual_host_bytes,
        attention_kernel=manager._call_kernel,
        prefill_s=prefill_s,
        # where prefill's time went: before the first layer (planning, pinning what is
        # pinned first, embeddings), the first layer (a process's first call loads its
        # kernels there), and after the last layer (final norm, decode graphs captured
        # ahead, the head, the first token); on the device's clock, None if not reached
        prefill_before_first_layer_s=phase_s(ph, "start", "layer0_start"),
        prefill_first_layer_s=phase_s(ph, "layer0_start", "layer1_start"),
        prefill_after_layers_s=phase_s(ph, "layers_end", "prefill_end"),
        # (host clock, from the set-up's start: pinned, weights_placed, cache_made,
        # first_layer)
        prefill_setup_host_s={k: v / 1e3 for k, v in ph.get("setup_host_ms", {}).items()},
        arena_map_s=arena["map_s"] - ph["map_s"],
        host_copy_wait_s=st["host_copy_wait_s"],
        pin_s=ph.get("pin_s", 0.0),
        pin_mode=ph.get("pin_mode", switches.pin_mode()),
        pin_background_s=ph.get("pin_background_s", 0.0),
        pin_error=ph.get("pin_error"),
        decode_steps=steps,
        decode_s=decode_s,
        decode_tok_s=steps / decode_s if steps and decode_s > 0 else None,
        own_decode_attention=ph.get("own_decode_steps", 0) == ran > 0,
        decode_stop=stop_state(manager.layout.device, cache),
        decode_steps_undone=cache.undone_steps,
        # Note [Decode graphs]: layer steps replayed as CUDA graphs and run eagerly (before
        # the layer's capture), the layers captured in this call and the host time it took,
        # and "on", or why they are off.
        decode_graphs=graphs_state(manager),
        decode_graph_replays=manager._graphs.replays if manager._graphs else 0,
        decode_graph_capture_s=manager._graphs.capture_ms / 1e3 if manager._graphs else 0.0,
        decode_graph_captures=manager._graphs.captured if manager._graphs else 0,
        decode_graph_captures_ahead=manager._graphs.captured_ahead if manager._graphs else 0,
        decode_graph_captures_in_prefill_layers=(
            manager._graphs.captured_in_layers if manager._graphs else 0
        ),
        decode_graph_eager_steps=manager._graphs.eager_steps if manager._graphs else 0,
        decode_graph_uncaptured=dict(manager._graphs.uncaptured) if manager._graphs else {},
        **weights,
    )


def weight_stats(manager: _Manager, plan: Plan) -> dict[str, Any]:
    """Note [Streamed weights]: what the call's weights did (zeros when they do not stream)."""
    w = manager.weights
    before = manager._phase.get("weights_before")
    if w is None or before is None:
        return {"weights_streamed": False, "weight_resident_layers": manager.layout.num_layers}
    now = w.stats()
    return {
        "weights_streamed": True,
        "embedding_on_host": manager.host_embedding is not None,
        "weight_resident_layers": now["resident_layers"],
        "weight_streamed_layers": now["streamed_layers"],
        "weight_slots": now["slots"],
        "weight_prefetch_layers": plan.weight_prefetch_layers,
        "weight_prefetch_blocks": now["prefetch_blocks"],  # (Note [Layers in parts])
        # decode's room for streamed weights (Note [Layers in parts]), and what lowering the
        # slot to it gave back for K/V promotions
        "weight_slot_bytes": w.store.slot_bytes,
        "weight_bytes_given_back": manager._phase.get("weight_bytes_given_back", 0),
        "weight_host_bytes": now["host_bytes"],
        "weight_resident_bytes": now["resident_bytes"],
        "weight_bytes_to_device": now["bytes_to_device"] - before["bytes_to_device"],
        "weight_bytes_to_host": now["bytes_to_host"] - before["bytes_to_host"],
        "weight_fills": now["fills"] - before["fills"],
        "weight_prefetched_fills": now["prefetched_fills"] - before["prefetched_fills"],
        "weight_stall_s": now["compute_stall_s"] - before["compute_stall_s"],
    }


def graphs_state(manager: _Manager) -> str:
    if manager._graphs is None:
        if not manager.config.cuda_graphs:
            return "off: RevivaConfig(cuda_graphs=False)"
        return "not used: only the CUDA half-precision decode path has them"
    if manager._graphs.failed is not None:
        return f"off: {manager._graphs.failed}"
    return "on"


def call_trace(manager: _Manager, stats: GenerateStats) -> dict[str, Any]:
    """The call's Chrome trace (Note [Traces]): compute spans from the phase events, the
    stores' copies and stalls from the core's timelines."""
    ph = manager._phase

    def at(e: Any) -> float:  # ms from the call's start
        return elapsed_s(ph["start"], e) * 1e3

    end = at(ph["end"])
    prefill_end = at(ph["prefill_end"]) if "prefill_end" in ph else end
    spans = []
    spans.append(span("prefill", "compute", 0.0, prefill_end, tokens=stats.prefill.tokens))
    layers = [at(e) for e in ph.get("layer_events", [])]
    layers_end = at(ph["layers_end"]) if "layers_end" in ph else prefill_end
    for i, start in enumerate(layers):
        stop = layers[i + 1] if i + 1 < len(layers) else layers_end
        spans.append(span(f"prefill layer {i}", "compute", start, stop))
    steps = [at(e) for e in ph.get("step_events", [])]
    if steps:
        spans.append(span("decode", "compute", prefill_end, end, steps=len(steps)))
    for j, start in enumerate(steps):
        stop = steps[j + 1] if j + 1 < len(steps) else end
        spans.append(span(f"decode step {j}", "compute", start, stop))
    t0 = ph["t0"]
    if "store_host" in ph:
        spans += store_spans(manager._last_timeline, "K/V", (ph["store_host"] - t0) * 1e3)
    if manager.weights is not None:
        offset = (manager.weights.origin_host - t0) * 1e3
        spans += store_spans(manager.weights.store.take_timeline(), "weights", offset)
    return chrome_trace(
        spans,
        {
            "device": stats.device,
            "backend": stats.backend,
            "prompt_tokens": stats.prompt_tokens,
            "decode_steps": stats.decode_steps,
            "clock": "CUDA events" if manager.layout.device.type == "cuda" else "host",
            "stats": stats.to_dict(),
        },
    )
