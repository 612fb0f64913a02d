"""`python -m reviva plan`: how a generate call of a shape would use a card (the planner's own
plan, on a model built on the meta device) and its estimated prefill time and decode rate
(reviva/plan/forecast.py), without a GPU."""

from __future__ import annotations

import argparse
import sys

import torch

from reviva.cli.models import _config, _meta_model


def _plan(args: argparse.Namespace) -> int:
    import dataclasses
    import json

    import reviva
    from reviva.adapters import inspect_model
    from reviva.cache.window_rings import rings_wanted
    from reviva.plan.call_plan import Plan
    from reviva.plan.forecast import CUDA_CONTEXT_BYTES, forecast
    from reviva.plan.host_decode import host_attention_pays, host_decode_mix, host_kv_layers
    from reviva.plan.memory_state import DeviceState, HostState
    from reviva.plan.planner import make_plan
    from reviva.weights.packing import decode_slot_bytes, layer_weight_bytes
    from reviva.weights.routed_experts import routed_expert_sizes

    cfg = _config(args)
    if cfg is None:
        return 2
    cfg.max_position_embeddings = max(
        getattr(cfg, "max_position_embeddings", 0) or 0, args.context + args.new_tokens
    )
    model = _meta_model(args, cfg)
    if model is None:
        return 2
    layout = dataclasses.replace(inspect_model(model), device=torch.device("cuda", 0))
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    card = reviva.parse_bytes(args.card)
    config = reviva.RevivaConfig(
        vram_budget=args.vram_budget or args.card,
        prefill_residual=args.prefill_residual,
        kv_dtype=args.kv_dtype,
        kv_page_tokens=args.kv_page_tokens,
        decode_attention=args.decode_attention,
        offload_device=args.offload_device or ("disk" if args.disk_gbps else "cpu"),
    )
    # Note [Streamed weights]: as RevivaConfig(stream_weights="auto") decides for a model on the
    # device (its weights over the budget), or forced; the untied input embedding then lives in
    # pinned host memory too (Note [Embedding on the host]) unless --no-host-embedding.
    if args.stream_weights == "auto":
        stream = weights > config.budget_bytes(card)
    else:
        stream = args.stream_weights == "on"
    weight_layers = layout.num_layers if stream else 0
    granule = 2 << 20  # (the arena's mapping granule on CUDA: each layer part is a buffer)
    layer_bytes = max(layer_weight_bytes(lay, granule) for lay in layout.layers) if stream else 0
    decode_room = decode_slot_bytes(layout.layers, granule) if stream else 0
    on_device = weights
    host_embedding = False
    if stream:
        on_device -= sum(layer_weight_bytes(layer) for layer in layout.layers)
        embed = model.get_input_embeddings()
        host_embedding = not args.no_host_embedding and (
            embed.weight is not getattr(model.get_output_embeddings(), "weight", None)
        )
        if host_embedding:
            on_device -= embed.weight.numel() * embed.weight.element_size()
    state = DeviceState(
        total=card,
        baseline=on_device,
        available=max(card - CUDA_CONTEXT_BYTES - on_device, 0),
        granularity=2 << 20,
    )
    # Note [Streamed weights]: streamed weights live in pinned host memory, every layer's (and
    # the input embedding moved there), beside the K/V and hidden states the plan pins
    weight_host = sum(layer_weight_bytes(layer) for layer in layout.layers) if stream else 0
    if host_embedding:
        embed = model.get_input_embeddings().weight
        weight_host += embed.numel() * embed.element_size()
    host_memory = None
    if args.host_memory:  # the host's memory for pinning: what the planner may count on
        total = reviva.parse_bytes(args.host_memory)
        host_memory = HostState(total, total, 0, 0)
        if config.offload_device == "disk":  # (what the K/V may pin: the weights' goes first)
            left = max(total - weight_host, 0)
            host_memory = HostState(left, left, 0, 0)
    dtype = str(layout.dtype).removeprefix("torch.")
    shape = (
        f"{args.model}: {layout.num_layers} layers, hidden {layout.hidden_size}, "
        f"{layout.num_heads}/{layout.num_kv_heads} heads, {dtype} ({weights / 1e9:.2f} GB of "
        "weights)"
    )
    call = f"{args.context}-token prompt + {args.new_tokens} new, batch {args.batch}"

    def plan_call(rings: bool) -> Plan:
        return make_plan(
            layout,
            config,
            state,
            args.batch,
            args.context,
            args.new_tokens,
            host=host_memory,
            weight_layers=weight_layers,
            weight_layer_bytes=layer_bytes,
            weight_decode_slot_bytes=decode_room,
            rings=rings,
            weight_experts=routed_expert_sizes(layout.layers) if stream else (0, 0, 0),
        )

    try:
        plan = plan_call(rings_wanted())  # (as RevivaManager plans: Note [Window rings])
    except reviva.RevivaOutOfMemoryError as e:
        if args.json:
            print(
                json.dumps(
                    {
                        "model": shape,
                        "call": call,
                        "card": args.card,
                        "fits": False,
                        "error": str(e),
                    },
                    indent=1,
                )
            )
        else:
            print(f"reviva plan: {shape}\n  {call} on a {args.card} card: does not fit\n  {e}")
        return 1
    host_total = plan.pinned_host_bytes + weight_host
    if host_memory is not None and host_total > host_memory.available:
        why = (
            f"the streamed weights ({weight_host / 1e9:.2f} GB) and the plan's K/V and hidden "
            f"states ({plan.pinned_host_bytes / 1e9:.2f} GB) need {host_total / 1e9:.2f} GB of "
            f"pinned host memory, over --host-memory {args.host_memory}"
        )
        if args.json:
            out = {"model": shape, "call": call, "card": args.card, "fits": False, "error": why}
            print(json.dumps(out, indent=1))
        else:
            print(f"reviva plan: {shape}\n  {call} on a {args.card} card: does not fit\n  {why}")
        return 1
    pcie = None if args.pcie_gbps is None else args.pcie_gbps * 1e9
    # RevivaConfig(decode_attention) as RevivaManager._decode_attention_on_host decides it:
    # "host" needs bf16/fp32 or fp8 K/V, not paged; "auto" takes it where it pays (for fp8 rows,
    # some of the fetched layers: Note [The host beside the copies] in plan/host_decode.py)
    host_ok = (
        not plan.page_tokens
        and not plan.disk_layers
        and (plan.kv_fp8 or layout.dtype in (torch.bfloat16, torch.float32))
    )
    beside = host_kv_layers(plan) if args.decode_attention == "auto" and host_ok else 0
    host = args.decode_attention == "host" or (
        args.decode_attention == "auto"
        and host_ok
        and not plan.kv_fp8
        and host_attention_pays(plan)
    )
    if host and not host_ok:
        print(
            "reviva plan: --decode-attention host needs bf16/fp32 or fp8 K/V without pages",
            file=sys.stderr,
        )
        return 2
    if host and plan.ring_layers:  # (the host attends whole layers: the manager re-plans so)
        plan = plan_call(False)
    f = forecast(
        layout,
        plan,
        weights,
        args.attention_kernel,
        pcie_bps=pcie,
        host_attention=host,
        host_beside=beside,
        disk_bps=None if args.disk_gbps is None else args.disk_gbps * 1e9,
    )
    if args.json:
        out = {
            "model": shape,
            "call": call,
            "card": args.card,
            "fits": True,
            "plan": dataclasses.asdict(plan),
            "host_bytes": host_total,
            "host_weight_bytes": weight_host,
            "promotable_layers": plan.promotable_layers(),
            "weights_streamed": stream,
            "embedding_on_host": host_embedding,
            "decode_attention": "host" if host or beside else "device",
            "host_beside_copies": beside,
            "forecast": f.to_dict(),
        }
        print(json.dumps(out, indent=1))
        return 0
    gb = 1e9
    resident = len(plan.resident_layers)
    promoted = min(plan.promotable_layers(), plan.streamed_layers)
    decode_slots = plan.decode_slots if plan.streamed_layers > promoted else 0
    if host:  # (Note [Weights first when the host attends])
        promoted = host_decode_mix(plan).kv_promoted
        decode_slots = 0
    print(f"reviva plan: {shape}")
    print(f"  {call} on a {args.card} card (CUDA context {CUDA_CONTEXT_BYTES / gb:.2f} GB)")
    print(
        f"  device: weights {weights / gb:.2f} GB, working set {plan.working_set / gb:.2f} GB, "
        f"K/V {plan.layer_kv_bytes / gb:.2f} GB a layer"
        + (
            f" ({len(plan.ring_layers)} sliding layers as rings of {plan.ring_tokens} tokens, "
            f"{plan.ring_kv_bytes / gb:.3f} GB each)"
            if plan.ring_layers
            else ""
        )
        + f": {resident} resident + {plan.slots} "
        f"slots in prefill, {resident + promoted} resident + {decode_slots} slots in decode"
        + (
            f"; streamed layers in pages of {plan.page_tokens} tokens, {plan.page_slots} page "
            f"slots of {plan.page_bytes / gb:.3f} GB"
            if plan.page_slots
            else ""
        )
    )
    if stream:
        print(
            f"  weights streamed from pinned host memory: {len(plan.weight_resident_layers)} of "
            f"{plan.weight_layers} layers resident ({plan.weight_layer_bytes / gb:.2f} GB each), "
            f"{plan.weight_slots} slot(s); "
            + ("input embedding on the host" if host_embedding else "input embedding on the device")
            + (
                f"; {f.weights_promoted_in_decode} more resident in decode"
                if f.weights_promoted_in_decode
                else ""
            )
        )
    if host:
        print(
            f"  decode attention on the host: the {plan.streamed_layers - promoted} layers whose "
            "K/V still streams after prefill are attended in pinned host memory (nothing fetched)"
        )
    if beside:
        print(
            f"  decode attention on the host for {beside} of the {plan.streamed_layers - promoted}"
            " layers whose fp8 K/V still streams after prefill, while the others are fetched"
        )
    print(
        f"  prefill: chunks of {plan.chunk_tokens} tokens, attention "
        + ("over the whole prompt" if plan.whole_attention else "by query chunks")
        + (
            f", hidden states on the host ({plan.residual_host_bytes / gb:.2f} GB pinned)"
            if plan.residual_on_host
            else ", hidden states on the device"
        )
    )
    print(
        f"  host: {plan.host_bytes / gb:.2f} GB pinned for {plan.streamed_layers} streamed "
        f"layers' K/V"
        + (
            f" ({len(plan.disk_layers)} of them on disk, {plan.disk_staged_layers} staged)"
            if plan.disk_layers
            else ""
        )
        + (
            f" + {plan.residual_host_bytes / gb:.2f} GB hidden states"
            if plan.residual_on_host
            else ""
        )
        + (f" + {weight_host / gb:.2f} GB streamed weights" if weight_host else "")
    )
    if plan.disk_layers:  # Note [Spilled layers] (src/kv_store_disk.cpp)
        print(
            f"  disk: {len(plan.disk_layers)} streamed layers' K/V spilled "
            f"({plan.disk_bytes / gb:.2f} GB), {plan.disk_staged_layers} of them pinned at a time;"
            f" a decode step reads {f.decode_disk_s * f.disk_bps / gb:.2f} GB back at "
            f"{f.disk_bps / gb:.2f} GB/s ({f.decode_disk_s * 1e3:.0f} ms)"
        )
    print(
        f"  estimate ({f.calibration}): prefill {f.prefill_s:.1f} s (linear "
        f"{f.prefill_linear_s:.1f}, attention {f.prefill_attention_s:.1f} "
        f"({f.attention_kernel}), residual copies "
        f"{f.prefill_residual_copies_s:.1f}"
        + (
            f"; +{f.prefill_first_call_extra_s:.1f} s in a process's first call at this length: "
            "cuDNN's plans"
            if f.prefill_first_call_extra_s
            else ""
        )
        + f"); decode {f.decode_tok_s:.2f} tok/s "
        f"({f.decode_bound}-bound: compute "
        f"{f.decode_compute_s * 1e3:.1f} ms, transfer {f.decode_transfer_s * 1e3:.1f} ms"
        + (f", host attention {f.decode_host_s * 1e3:.1f} ms" if host else "")
        + " a token),"
        f" first step +{f.first_step_extra_s * 1e3:.0f} ms (promotions): "
        f"{f.decode_call_tok_s:.2f} tok/s over the call's {args.new_tokens - 1} steps"
    )
    return 0
