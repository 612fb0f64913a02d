"""`python -m reviva plan --train`: a LoRA fine-tuning step under reviva.finetune on a card
(reviva/train/plan.py): the frozen layers streamed, the pinned host memory, the longest sequence
the card holds and the step's time."""

from __future__ import annotations

import argparse
import sys

import torch

from reviva.cli.models import _config, _meta_model


def _plan_training(args: argparse.Namespace) -> int:
    """`plan --train`: a LoRA fine-tuning step of --context tokens under reviva.finetune on the
    card (reviva.train.plan: the frozen weights streamed as the room allows, the checkpoints in
    pinned host memory), the longest sequence the card holds, and the step's time."""
    import json

    import reviva
    from reviva.adapters import inspect_model
    from reviva.plan.forecast import CUDA_CONTEXT_BYTES
    from reviva.train.finetune import ATTENTION_CHUNK_TOKENS
    from reviva.train.plan import (
        AUTO,
        AUTO_CHUNK_TOKENS,
        CHUNKED_MODEL,
        MODEL,
        TrainDims,
        forecast_step,
        host_shortfall,
        longest_host_tokens,
        longest_tokens,
        plan_layers,
    )
    from reviva.weights.packing import layer_weight_bytes

    cfg = _config(args)
    if cfg is None:
        return 2
    cfg.max_position_embeddings = max(getattr(cfg, "max_position_embeddings", 0) or 0, args.context)
    model = _meta_model(args, cfg)
    if model is None:
        return 2
    layout = inspect_model(model)
    if layout.num_experts:
        print("reviva plan --train: mixture-of-experts models are not supported", file=sys.stderr)
        return 2
    targets = [t for t in args.lora_targets.split(",") if t]
    missing = [t for t in targets if not any(n.endswith(t) for n, _ in model.named_modules())]
    if missing:
        print(
            f"reviva plan --train: --lora-targets {','.join(missing)}: no such module in the model",
            file=sys.stderr,
        )
        return 2
    lora = 0  # LoRA parameters (r x (in + out) per targeted projection)
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and any(name.endswith(t) for t in targets):
            lora += args.lora_r * (module.in_features + module.out_features)
    granule = 2 << 20
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    layers = sum(p.numel() * p.element_size() for lay in layout.layers for p in lay.parameters())
    embed = model.get_input_embeddings().weight
    tied = embed is getattr(model.get_output_embeddings(), "weight", None)
    # on the device beside the layers: the head (and a tied embedding), the final norm, LoRA's
    # parameters in bf16 with their gradients and Adam's two fp32 states (12 bytes each)
    held = weights - layers - (0 if tied else embed.numel() * embed.element_size()) + 12 * lora
    dims = TrainDims(
        num_layers=layout.num_layers,
        hidden_size=layout.hidden_size,
        intermediate_size=layout.intermediate_size,
        vocab_size=layout.vocab_size,
        num_heads=layout.num_heads,
        head_dim=layout.head_dim,
        dtype_bytes=2,
        layer_bytes=tuple(layer_weight_bytes(lay, granule) for lay in layout.layers),
        layer_params=sum(p.numel() for p in layout.layers[0].parameters()),
        name=args.model,
        dtype="bfloat16",
    )
    card = reviva.parse_bytes(args.card)
    budget = reviva.parse_bytes(args.vram_budget) if args.vram_budget else card
    budget = min(budget, card - CUDA_CONTEXT_BYTES)
    loss_chunk = max(128, (512 << 20) // (4 * layout.vocab_size))  # (finetune's default)
    # (Note [Layers by chunks of query tokens]; 0: whole layers; default finetune's, "auto")
    chunk = args.attention_chunk_tokens
    chunk = ATTENTION_CHUNK_TOKENS if chunk is None else chunk or None
    # (the longest sequence is longer than a chunk: by chunks wherever they may run)
    longest_model = MODEL if chunk is None else CHUNKED_MODEL
    longest = longest_tokens(dims, budget, held, 4096, loss_chunk, longest_model)
    layers_said = {
        None: "",
        AUTO: f", layers whole where they fit, else by chunks of {AUTO_CHUNK_TOKENS} query tokens",
    }.get(chunk, f", layers by chunks of {chunk} query tokens")
    shape = (
        f"{args.model}: {layout.num_layers} layers, hidden {layout.hidden_size}, bf16 "
        f"({weights / 1e9:.2f} GB of weights), LoRA r={args.lora_r} on {','.join(targets)}"
        f"{layers_said}"
    )
    out: dict[str, object] = {
        "model": shape,
        "tokens": args.context,
        "card": args.card,
        "budget": budget,
        "held": held,
        "longest_tokens": longest,
    }

    def does_not_fit(error: str) -> int:
        out.update(fits=False, error=error)
        if args.json:
            print(json.dumps(out, indent=1))
        else:
            print(f"reviva plan --train: {shape}\n  {args.context}-token step: does not fit")
            print(f"  {error}")
        return 1

    try:
        plan = plan_layers(dims, args.context, args.context, budget, held, 4096, loss_chunk, chunk)
    except reviva.RevivaOutOfMemoryError as e:
        return does_not_fit(str(e))
    host = reviva.parse_bytes(args.host_memory) if args.host_memory else None
    if host is not None:  # (checkpoints and weights pinned: Note [Checkpoints on the host])
        out["longest_host_tokens"] = longest_host_tokens(dims, host)
        short = host_shortfall(plan, dims, host, weights_pinned=False)
        if short:
            return does_not_fit(f"{short} (--host-memory {args.host_memory})")
    pcie = None if args.pcie_gbps is None else args.pcie_gbps * 1e9
    chunked = plan.attention_chunk_tokens is not None
    f = forecast_step(dims, args.context, plan.streamed_layers, pcie, chunked)
    out.update(fits=True, plan=plan.to_dict(), forecast=f.to_dict())
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    gb = 1e9
    print(f"reviva plan --train: {shape}")
    print(
        f"  a {args.context}-token step on a {args.card} card (CUDA context "
        f"{CUDA_CONTEXT_BYTES / gb:.2f} GB): {len(plan.resident_layers)} of {dims.num_layers} "
        f"layers' frozen weights resident, {plan.streamed_layers} streamed "
        f"({dims.largest_layer / gb:.2f} GB each); working set {plan.working_set / gb:.2f} GB, "
        f"held {held / gb:.2f} GB (head, norms, LoRA and its optimizer state); the layers "
        + (f"by chunks of {plan.attention_chunk_tokens} query tokens" if chunked else "whole")
    )
    print(
        f"  host: {plan.checkpoint_host_bytes / gb:.2f} GB pinned for the layers' checkpoints + "
        f"{plan.weight_host_bytes / gb:.2f} GB for the frozen weights"
    )
    print(f"  longest sequence on this card: {longest} tokens (every layer's weights streamed)")
    if host is not None:
        print(
            f"  longest sequence this host's {args.host_memory} pins: "
            f"{out['longest_host_tokens']} tokens"
        )
    print(
        f"  estimate ({f.calibration}): {f.step_s:.1f} s a step ({f.bound}-bound: linear "
        f"{f.linear_s:.1f} s, attention {f.attention_s:.1f} s; copies {f.copies_s:.1f} s under "
        "them)"
    )
    return 0
