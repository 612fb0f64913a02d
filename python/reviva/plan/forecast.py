"""What a generate call of a given shape will take, before running it: `python -m reviva plan`.

The memory comes from the planner itself (reviva.plan.planner.make_plan on the model's layout, built
on the meta device: no weights are made); the times from a model of the H200 calibrated on this
repository's measurements (benchmarks/results/, Llama-3-8B shape, bf16, card mode 24 GB):

- decode, compute: a step reads every weight and every token's K/V from device memory. Fitted to
  the no-card all-resident runs with decode graphs (64k: 11.0 ms a token, 90.8 tok/s, 13a52f1;
  128k: 13.2 ms, 75.5 tok/s, 612b104): 16.1 GB of weights at an effective 1.82 TB/s and 128 KiB of
  K/V per token at 3.9 TB/s (launch and host costs folded in).
- fp8 K/V: a step reads the rows in place (Note [fp8 decode attention]) at the fused kernel's
  rate, FP8_ROWS_READ_BPS (bench_fp8_decode.py on the H200, one layer of the 8B shape: 1.64 TB/s
  of rows at 64k, c27175f), and the weights at FP8_STEP_WEIGHT_READ_BPS: its step is one CUDA
  graph a layer on Reviva's row operations (Note [Decode row ops]) and, since 20f78a6, the host
  no longer waits for the device each step (generate/stop_check.py), so the host's costs folded into
  WEIGHT_READ_BPS above are not there. Fitted to the H200's whole-card 64k at d245ca8, every
  layer resident: 140.6 tok/s over 31 steps (call 2; 7.11 ms a step: 4.43 GB of rows at 1.64
  TB/s leaves 4.41 ms for 16.06 GB of weights, generate-fp8-64k-h200-2026-12-06-d245ca8.json;
  the 24 GB card's call, its first step promoting 14 layers back, 120.9 tok/s). The 135.0 of
  20f78a6 this was fitted to before came from a streamer that waited for the step after each
  token and left the first decode step out (Note [A stop decided a step late]). bf16's
  steps (attention eager between two replays) keep WEIGHT_READ_BPS: not re-measured on the H200
  since the host stopped waiting.
- decode, transfer: the streamed layers' K/V, and the streamed layers' weights (Note [Streamed
  weights]), over PCIe at 55 GB/s (pinned H2D, measured by bench_transfer), a step taking the
  slower of the two (the copies overlap the compute). Streamed weights measured at 0.95-0.98 of
  this (bench_weights, 2fc8869: 32B shape on 24 GB, 8B on 8 GB, 32k).
- prefill with streamed weights: every streamed layer's weights cross PCIe once. With two or
  more weight slots the copies run under the layers' compute (the prefill takes the longer of
  the two); with one (the planner's usual pick: plan_arithmetic._residency) a layer's copy
  starts when the layer before it is done with the slot, so it runs under that layer's compute
  only when that layer's weights are resident: the copy of a streamed layer after a streamed one
  (or of layer 0) is exposed. Measured 32k, one slot: 8B on 8 GB 1.60 s, 32B on 24 GB 5.29 s
  (call 2).
- prefill: linear layers (2 x parameters x tokens FLOPs) at 546 TFLOP/s, causal attention
  (2 x layers x tokens^2 x heads x head_dim) at 530 TFLOP/s in one call over the prompt; by
  query chunks at 325 TFLOP/s through flash attention (fitted to 64k 3.80 s, 128k 11.84 s no
  card, 256k 62.0 s by chunks on the card) and CUDNN_CHUNKED_ATTENTION_FLOPS through cuDNN's
  (Note [Prefill attention kernel] in cache/block_attention.py; one layer at 256k: 586 TFLOP/s in
  diag_prefill_attention.py). With the residual on the host, each layer's input and output
  cross PCIe once more, on copy streams of their own under the layer's compute (since 617485d):
  what the copies add is each layer's first chunk read in and last chunk written back, unless
  the copies of a layer take longer than its compute (in and out at once, PCIe being full
  duplex). The 128k A/B of residual-streams-2026-12-02-617485d.json saved 0.84 s of the 1.25 s
  this model counts for copies on the compute stream.

- layers spilled to disk (RevivaConfig(offload_device="disk"), Note [Spilled layers] in
  src/kv_store_disk.cpp): each decode step reads every spilled layer's K/V back from disk, at
  DISK_READ_BPS (io_uring, O_DIRECT, 1 MiB blocks: bench_disk.py on the H100 machine's local disk,
  2.84 GB/s, disk-store-bw-h100-2026-12-07-1161262.json) or `disk_bps`; the three tiers are a
  pipeline, so a step takes the slowest of the disk's reads, the PCIe copies and the compute.
  Prefill writes each spilled layer's prompt K/V once, under the next layers' compute.

- sliding-window layers (Mistral, Gemma, ...; not calibrated): a query reads its window's keys
  alone, in prefill (T*W - W^2/2 of the T^2/2 causal pairs) and in decode, and a streamed one's
  decode fetch copies its window alone (Note [Fetch tails] in src/append_blocks.cpp; bf16 K/V,
  not paged); full layers are promoted after prefill before sliding ones.

Other GPUs differ; the figures say what they were calibrated on. An estimate, not a
measurement: `benchmarks/bench_generate.py` measures.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from reviva.adapters import DecoderLayout
from reviva.cache.block_attention import call_kernel
from reviva.plan.call_plan import Plan
from reviva.plan.host_decode import host_decode_mix
from reviva.plan.memory_model import MODEL

CALIBRATION = "H200 (PCIe Gen5 x16), Llama-3-8B shape, bf16, torch 2.11; benchmarks/results/"
PCIE_BPS = 55e9
WEIGHT_READ_BPS = 1.82e12
KV_READ_BPS = 3.9e12
FP8_ROWS_READ_BPS = 1.64e12
FP8_STEP_WEIGHT_READ_BPS = 3.64e12
LINEAR_FLOPS = 546e12
WHOLE_ATTENTION_FLOPS = 530e12
CHUNKED_ATTENTION_FLOPS = 325e12
CUDNN_CHUNKED_ATTENTION_FLOPS = 570e12
DISK_READ_BPS = 2.84e9
DISK_WRITE_BPS = 2.61e9
CUDNN_PLAN_S = 0.036  # a new shape's plan, first call of a process (see Forecast)
# What a process holds on the card beside torch's tensors and Reviva's arena: the CUDA context
# (24 - 23.35 GB free after it, card mode) and what a call leaves (cuBLAS workspaces, the decode
# graphs' pool): the planner saw 23.28 GB to plan with in call 1 and 23.18 GB in later calls of
# generate-card24-2026-12-01-13a52f1.json (device_limit_mb).
CUDA_CONTEXT_BYTES = 820_000_000


@dataclass(frozen=True)
class Forecast:
    """Estimated times of one generate call (seconds) and what sets them."""

    prefill_s: float
    prefill_linear_s: float
    prefill_attention_s: float
    prefill_residual_copies_s: float  # what the residual's copies add (the rest overlaps)
    decode_step_s: float
    decode_compute_s: float
    decode_transfer_s: float
    decode_tok_s: float  # steady: one token a step
    decode_bound: str  # "transfer" or "compute"
    first_step_extra_s: float  # promotions after prefill, moved in the first decode step
    # The call's decode as bench_generate times it: the steps after the first token, the first
    # of them bringing the promoted layers in.
    decode_call_tok_s: float
    attention_kernel: str = "flash"  # prefill's chunked attention ("cudnn" or "flash")
    # A process's first call at a prompt length, with cuDNN: its plan for each new shape (Note
    # [Prefill attention kernel]), on top of prefill_s.
    prefill_first_call_extra_s: float = 0.0
    calibration: str = CALIBRATION
    # Note [Attention on the host]: decode's streamed K/V attended on the host ("host"), the
    # host's time a step, and the weight layers made resident for decode (Note [Weights first
    # when the host attends] in plan/decode_placement.py)
    decode_attention: str = "device"
    decode_host_s: float = 0.0
    weights_promoted_in_decode: int = 0
    # Note [Spilled layers]: a decode step's reads of the spilled layers from disk (seconds), and
    # the rate assumed
    decode_disk_s: float = 0.0
    disk_bps: float = DISK_READ_BPS

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def forecast(
    layout: DecoderLayout,
    plan: Plan,
    weight_bytes: int,
    attention_kernel: str = "auto",
    pcie_bps: float | None = None,
    host_attention: bool = False,
    host_beside: int = 0,
    disk_bps: float | None = None,
) -> Forecast:
    """Times of a call planned as `plan` on `layout` (see the module docstring), prefill's
    chunked attention through `attention_kernel`: "cudnn", "flash", or "auto" (what
    RevivaConfig(attention_kernel="auto") takes on the H200: block_attention.call_kernel).
    `pcie_bps`: the host-to-device copy rate to assume (bytes a second; None: the H200's 55 GB/s
    measured), for another machine's PCIe; the compute rates stay the H200's. `host_attention`:
    decode attends the streamed K/V on the host (RevivaConfig(decode_attention); "auto" takes it
    where planner.host_attention_pays): the room after prefill is shared as
    planner.host_decode_mix shares it, no K/V is fetched, and the host's time (MemoryModel's
    rate) bounds a step too. `host_beside`: of the layers fetched, this many are attended on the
    host instead (planner.host_kv_layers, Note [The host beside the copies]): their host time
    adds to the step's compute, beside the others' copies. `disk_bps`: the disk's read rate for
    spilled layers (bytes a second; None: DISK_READ_BPS)."""
    if attention_kernel not in ("auto", "cudnn", "flash"):
        raise ValueError(
            f"attention_kernel must be 'auto', 'cudnn' or 'flash', got {attention_kernel!r}"
        )
    if pcie_bps is not None and not pcie_bps > 0:
        raise ValueError(f"pcie_bps must be > 0 bytes a second, got {pcie_bps!r}")
    pcie = pcie_bps if pcie_bps is not None else PCIE_BPS
    if disk_bps is not None and not disk_bps > 0:
        raise ValueError(f"disk_bps must be > 0 bytes a second, got {disk_bps!r}")
    disk = disk_bps if disk_bps is not None else DISK_READ_BPS
    if attention_kernel == "auto":  # the H200 takes cuDNN: call_kernel decides by the prompt
        attention_kernel = call_kernel(
            "cudnn", "auto", plan.prompt_tokens, chunked=not plan.whole_attention
        )
    e = layout.dtype.itemsize
    params = weight_bytes / e
    # The embedding is a lookup and the head runs on one position: not prefill FLOPs.
    vocab_params = 2 * layout.vocab_size * layout.hidden_size
    tokens = plan.batch * plan.prompt_tokens
    linear = 2 * max(params - vocab_params, 0) * tokens / LINEAR_FLOPS
    # Sliding layers (Note [Sliding windows]): a query reads its window's keys alone, in prefill
    # and in decode, and a streamed one's decode fetch copies its window alone (Note [Fetch
    # tails] in src/append_blocks.cpp; bf16 K/V, not paged).
    short = layout.windows_shorter_than(plan.capacity)
    windows = [short.get(i) for i in range(layout.num_layers)]
    t = plan.prompt_tokens
    per_head = plan.batch * layout.num_heads * layout.head_dim
    attn_flops = sum(
        2 * per_head * t**2 if w is None or t <= w else 4 * per_head * (t * w - w * w / 2)
        for w in windows
    )
    if plan.whole_attention:
        rate = WHOLE_ATTENTION_FLOPS
    elif attention_kernel == "cudnn":
        rate = CUDNN_CHUNKED_ATTENTION_FLOPS
    else:
        rate = CHUNKED_ATTENTION_FLOPS
    attention = attn_flops / rate
    # cuDNN's plans: a chunk's earlier keys and its own block, one shape each.
    chunks = -(-plan.prompt_tokens // max(plan.chunk_tokens, 1))
    plans = 2 * chunks if rate == CUDNN_CHUNKED_ATTENTION_FLOPS else 0
    compute_prefill = linear + attention
    residual = 0.0
    if plan.residual_host_bytes:
        chunk_bytes = plan.residual_host_bytes * min(plan.chunk_tokens, plan.prompt_tokens)
        chunk_bytes //= plan.prompt_tokens
        exposed = 2 * layout.num_layers * chunk_bytes / pcie
        copies = layout.num_layers * plan.residual_host_bytes / pcie  # in and out at once
        residual = max(copies - compute_prefill, 0.0) + exposed
    held = plan.past_tokens + plan.prompt_tokens  # after prefill (Note [A returned cache])
    mean_len = held + (plan.capacity - held) / 2
    read = [mean_len if w is None else min(w, mean_len) for w in windows]
    kv_bytes = sum(read) * plan.kv_token_bytes
    if plan.kv_fp8:
        compute = weight_bytes / FP8_STEP_WEIGHT_READ_BPS + kv_bytes / FP8_ROWS_READ_BPS
    else:
        compute = weight_bytes / WEIGHT_READ_BPS + kv_bytes / KV_READ_BPS
    # the layers streamed in decode: not resident in prefill, less the promotions after it
    # (full layers first: RevivaManager._promote_after_prefill)
    streamed_ids = list(plan.streamed_layer_ids)
    full_count, ring_count = plan.promotable_split()
    weights_promoted = 0
    mix = host_decode_mix(plan, MODEL) if host_attention else None
    if mix is not None:
        weights_promoted, full_count, ring_count = mix.weights_promoted, mix.kv_promoted, 0
    # (Note [Window rings] in cache/window_rings.py: a ring is fetched whole, its rows; full layers
    # are promoted first, then rings)
    rings = [i for i in streamed_ids if i in plan.ring_layers]
    # (spilled layers first: RevivaManager._promote_after_prefill)
    full = sorted(
        (i for i in streamed_ids if windows[i] is None), key=lambda i: i not in plan.disk_layers
    )
    windowed = [i for i in streamed_ids if windows[i] is not None and i not in plan.ring_layers]
    promoted_ids = set((full + windowed)[:full_count]) | set(rings[:ring_count])
    tails = not plan.kv_fp8 and not plan.page_tokens
    fetched = [
        min(plan.ring_tokens, mean_len)
        if i in plan.ring_layers
        else (read[i] if tails else mean_len)
        for i in streamed_ids
        if i not in promoted_ids
    ]
    # (a step's copies: Note [Routed experts] in weights/routed_experts.py, an expert layer's routed
    # experts)
    weight_copies = plan.streamed_weight_layers * plan.weight_step_bytes / pcie
    host = 0.0
    if mix is not None:  # nothing fetched; the host reads the rows where they are
        host = mix.host_s
        transfer = weight_copies - weights_promoted * plan.weight_step_bytes / pcie
        # (the host's time in weight-resident layers, and beyond a streamed layer's copy, adds)
        step = max(compute, transfer, mix.step_s)
    else:
        beside = sorted(fetched)[len(fetched) - min(host_beside, len(fetched)) :]
        if beside:  # (read on the host at its fp8 rate, not fetched)
            host = sum(beside) * plan.kv_token_bytes / MODEL.host_fp8_attention_bps
            host += len(beside) * MODEL.host_attention_layer_s
            fetched = sorted(fetched)[: len(fetched) - len(beside)]
        transfer = sum(fetched) * plan.kv_token_bytes / pcie + weight_copies
        step = max(compute + host, transfer)
    # (spilled layers read back from disk each step, in a pipeline with the copies and compute)
    from_disk = sum(
        mean_len for i in streamed_ids if i in plan.disk_layers and i not in promoted_ids
    )
    disk_s = from_disk * plan.kv_token_bytes / disk
    step = max(step, disk_s)
    first_extra = sum(min(held, plan.kv_tokens(i)) for i in promoted_ids) * plan.kv_token_bytes
    first_extra /= pcie
    first_extra += weights_promoted * plan.weight_layer_bytes / pcie
    steps = plan.capacity - held - 1
    exposed = 0.0  # prefill's weight copies not under compute (see the module docstring)
    if plan.streamed_weight_layers and plan.weight_slots == 1:
        resident = set(plan.weight_resident_layers)
        alone = sum(
            1
            for i in range(plan.weight_layers)
            if i not in resident and (i == 0 or i - 1 not in resident)
        )
        exposed = alone * plan.weight_layer_bytes / pcie
        prefill = compute_prefill + exposed + residual
    else:
        prefill = max(compute_prefill, plan.streamed_weight_layers * plan.weight_layer_bytes / pcie)
        prefill += residual
    spilled_prompt = len(plan.disk_layers) * held * plan.kv_token_bytes
    prefill = max(prefill, spilled_prompt / DISK_WRITE_BPS)
    return Forecast(
        prefill_s=prefill,
        prefill_linear_s=linear,
        prefill_attention_s=attention,
        prefill_residual_copies_s=residual,
        decode_step_s=step,
        decode_compute_s=compute,
        decode_transfer_s=transfer,
        decode_tok_s=1 / step if step > 0 else float("inf"),
        decode_bound="compute"
        if step == compute
        else "disk"
        if disk_s > 0 and step == disk_s
        else ("transfer" if step <= transfer * 1.001 else "transfer+host"),
        first_step_extra_s=first_extra,
        decode_call_tok_s=steps / (steps * step + first_extra) if steps and step > 0 else 0.0,
        attention_kernel=attention_kernel,
        prefill_first_call_extra_s=plans * CUDNN_PLAN_S,
        calibration=CALIBRATION
        if pcie_bps is None
        else f"{CALIBRATION}; PCIe stated: {pcie_bps / 1e9:g} GB/s",
        decode_attention="host" if host_attention or host > 0 else "device",
        decode_host_s=host,
        weights_promoted_in_decode=weights_promoted,
        decode_disk_s=disk_s,
        disk_bps=disk,
    )
