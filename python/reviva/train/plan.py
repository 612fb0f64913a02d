"""The memory and time model of a streamed fine-tuning step (reviva.finetune, Note [Streamed
fine-tuning] in train/finetune.py): which layers' frozen weights stay on the device for a sequence
of T tokens under a budget, the longest sequence a card holds, the pinned host memory it takes, and
the step's time. `Finetune` plans each step with it; `python -m reviva plan --train` prints it.

    dims = TrainDims.of(layout, layer_bytes)       # or TrainDims.meta(config) for the CLI
    plan = plan_step(dims, tokens=65536, budget=24e9, held=1.1e9)
    longest = longest_tokens(dims, budget=24e9, held=1.1e9)

What a step holds on the device beside the resident weights (`held`: the head, norms, LoRA
parameters, their gradients and optimizer state, all that is there before the step):
- the weight slots: two layers' frozen weights, the one in use and the next coming;
- the working set, per token in rows of the hidden size (TrainMemoryModel.layer_rows): a layer's
  recompute and backward at their peak, which is the step's (the attention's saved tensors and
  their gradients, the layer's output gradient, its checkpoint and the one brought back next);
- the chunks: an MLP chunk's wide tensors and a loss chunk's logits (fixed by the chunk sizes).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from reviva._C import RevivaOutOfMemoryError
from reviva.sizes import format_bytes


class FinetuneOutOfMemoryError(RevivaOutOfMemoryError, torch.OutOfMemoryError):
    """Torch ran out of device memory in a streamed fine-tuning step: the message names the
    step's plan and torch's message."""


_MiB = 1 << 20


@dataclass(frozen=True)
class TrainMemoryModel:
    """Coefficients of a streamed fine-tuning step's device memory (bytes unless named)."""

    # A layer's recompute and backward at their peak, per token, in rows of the hidden size (the
    # model's dtype): what the recompute saves (the normed input, q and k with RoPE, v, the
    # attention output and its log-sum-exp, the post-attention residual and its norm), their
    # gradients at the attention's backward, the layer's output and output gradient and the
    # checkpoints (this layer's, and the one brought back ahead). Measured on the H200
    # (bench_finetune, Llama-3-8B shape): torch's reserved peak beside what was held, less the
    # MLP and loss chunks (2.3 GB), is 12.2 rows with loss_rows at 64k (8.87 GB, 8d577a2) and
    # 13.7 at 128k (17.03 GB, 6e014ab: the attention's backward grows faster than the tokens).
    layer_rows: float = 12.0
    # An MLP chunk's recompute and backward: tensors of the MLP's width per chunk token (gate,
    # up, the activation, their product, and the gradients of the first two).
    mlp_wide_tensors: int = 6
    # A loss chunk: per chunk token and vocabulary entry, the logits in the model's dtype (2),
    # in fp32 (4), the cross-entropy's fp32 gradient (4) and its cast back (2).
    loss_bytes_per_vocab: int = 12
    # What the step's end holds beside a layer's backward: the final hidden states and their
    # gradient (rows of the hidden size per token).
    loss_rows: float = 2.0
    weight_slots: int = 2  # frozen weights of two layers at once: the one in use, the next one
    margin_fixed: int = 256 * _MiB  # cuBLAS workspaces, allocator rounding
    margin_fraction: float = 1 / 25  # fragmentation of torch's cache, as a part of the budget


MODEL = TrainMemoryModel()
# Each layer by chunks of query tokens (Note [Layers by chunks of query tokens] in
# train/chunked_layer.py): a layer's backward holds at full length its checkpoint and the next one
# coming back, K and V, dK and dV in fp32, the output gradient and the input gradient, and the
# last chunk's K/V gradients: ~6.5 rows for Llama-3-8B's GQA (8 K/V heads of 32), every other
# tensor a chunk's. That peak is the step's: the loss's final hidden states and their gradient
# are gone before the layers' backward begins (loss_rows 0). Modelled from the tensors above;
# measured on the H200 (bench_finetune, 0c15a95): 3.6 rows at 64k (the working set a step
# measured), 5.1 at 128k (torch's reserved peak less what was held and the chunks); kept at the
# modelled 6.5 until 256k is measured.
CHUNKED_MODEL = TrainMemoryModel(layer_rows=6.5, loss_rows=0.0)

# The H200's rates for a fine-tuning step (Llama-3-8B shape, bf16, torch 2.11; forecast_step):
# fitted to bench_finetune's steps on a 24 GB card, 64k 16.99 s (8d577a2) and 128k 53.41 s
# (6e014ab), the linear work at cuBLAS's usual rate and the rest the attention's.
TRAIN_LINEAR_FLOPS = 520e12
TRAIN_ATTENTION_FLOPS = 480e12
PCIE_BPS = 55e9
# Layers by chunks of query tokens (Note [Layers by chunks of query tokens] in
# train/chunked_layer.py): their extra time (the k/v projections once more, each chunk's two
# attention calls and their merge, smaller kernels) as a share of the linear work's, fitted to an
# H100's 64k steps (card mode, 89d548a): by chunks 17.92 s, whole 16.43 s, 1.49 s over a linear 5.68
# s. One layer's attention at 64k: 0.236 s by chunks, 0.216 s whole (cuDNN;
# diag_attention_chunks.py).
CHUNKED_EXTRA = 0.26
CALIBRATION = "H200 (PCIe Gen5 x16), Llama-3-8B shape, bf16, torch 2.11"


@dataclass(frozen=True)
class TrainDims:
    """What the model of a step needs of the model: its shape and its layers' frozen bytes."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_heads: int
    head_dim: int
    dtype_bytes: int
    layer_bytes: tuple[int, ...]  # each layer's streamed (frozen) weights, as packed
    layer_params: int  # parameters of one layer (FLOPs)
    name: str = ""
    dtype: str = ""

    @property
    def largest_layer(self) -> int:
        return max(self.layer_bytes)


@dataclass(frozen=True)
class TrainPlan:
    """One step's use of the device (bytes) and of pinned host memory."""

    tokens: int
    budget: int
    held: int  # on the device before the step (head, norms, LoRA and its optimizer state)
    working_set: int  # the step's peak beside the weights (measured once a step ran, else modelled)
    working_measured: bool
    slot_bytes: int  # the weight slots
    resident_layers: tuple[int, ...]
    streamed_layers: int
    resident_bytes: int
    checkpoint_host_bytes: int  # each layer's input in pinned host memory
    weight_host_bytes: int  # every layer's frozen weights in pinned host memory
    # the layers run by chunks of this many query tokens (None: whole; plan_layers)
    attention_chunk_tokens: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# attention_chunk_tokens="auto" (finetune's default; plan_layers): whole layers where they fit
# the budget, else by chunks of AUTO_CHUNK_TOKENS query tokens
AUTO = "auto"
AUTO_CHUNK_TOKENS = 4096
ChunkSetting = int | str | None  # tokens, AUTO or None (whole layers)


def runs_by_chunks(sequence: int, chunk: int | None) -> bool:
    """Whether a step's layers over rows of `sequence` tokens run by chunks of `chunk` query
    tokens (Note [Layers by chunks of query tokens] in train/chunked_layer.py; None: whole layers):
    a row no longer than a chunk runs whole. The step's forwards, its plan and `plan --train`
    decide by it."""
    return chunk is not None and sequence > chunk


def working_set(
    dims: TrainDims,
    tokens: int,
    chunk_tokens: int,
    loss_chunk_tokens: int,
    model: TrainMemoryModel = MODEL,
    logits: bool = False,
) -> int:
    """The step's device bytes beside the weights and what is held before it (the module
    docstring's working set and chunks); `logits`: the [tokens, vocab] logits returned beside
    the loss (Finetune's return_logits, Note [Logits with labels] in train/forwards.py), in
    the model's dtype, alive through the backward where the caller keeps the output."""
    row = dims.hidden_size * dims.dtype_bytes
    rows = model.layer_rows + model.loss_rows
    mlp = min(chunk_tokens, tokens) * dims.intermediate_size * dims.dtype_bytes
    loss = min(loss_chunk_tokens, tokens) * dims.vocab_size * model.loss_bytes_per_vocab
    returned = tokens * dims.vocab_size * dims.dtype_bytes if logits else 0
    return int(rows * tokens * row) + model.mlp_wide_tensors * mlp + loss + returned


def preference(num_layers: int) -> list[int]:
    """The order in which layers stay resident: a streamed layer's weights cross twice a step
    (its forward, then its backward) except the last layer's and the first's, whose two uses
    are adjacent (forward then backward; backward then the next step's forward), so those two
    stream first."""
    middle = list(range(1, num_layers - 1))
    return middle + [i for i in (0, num_layers - 1) if i not in middle and num_layers > 0]


def plan_step(
    dims: TrainDims,
    tokens: int,
    budget: int,
    held: int,
    chunk_tokens: int = 4096,
    loss_chunk_tokens: int = 1024,
    measured_working: int | None = None,
    model: TrainMemoryModel = MODEL,
    logits: bool = False,
) -> TrainPlan:
    """The layers whose weights stay on the device for a step of `tokens` tokens: as many as
    fit beside `held`, the working set (`measured_working` where a step of this length ran,
    else the model's) and the weight slots. Raises RevivaOutOfMemoryError naming the numbers
    where even every layer streamed does not fit."""
    if tokens <= 0:
        raise ValueError(f"a step needs tokens > 0, got {tokens}")
    work = (
        measured_working
        if measured_working is not None
        else working_set(dims, tokens, chunk_tokens, loss_chunk_tokens, model, logits)
    )
    margin = model.margin_fixed + int(budget * model.margin_fraction)
    slots = model.weight_slots * dims.largest_layer
    room = budget - held - work - margin
    if room < slots:
        longest = longest_tokens(
            dims, budget, held, chunk_tokens, loss_chunk_tokens, model, logits=logits
        )
        returned = tokens * dims.vocab_size * dims.dtype_bytes
        dropped = (
            f"; return_logits=False drops the {format_bytes(returned)} of [tokens, vocab] "
            "logits returned beside the loss"
            if logits
            else ""
        )
        raise RevivaOutOfMemoryError(
            f"fine-tuning {tokens} tokens does not fit a budget of {format_bytes(budget)}: "
            f"{format_bytes(held)} held before the step, a working set of {format_bytes(work)}"
            f"{' (measured)' if measured_working is not None else ''}, "
            f"{format_bytes(margin)} of margin and {format_bytes(slots)} of weight slots "
            f"(every layer's weights streamed); the longest sequence this budget holds is "
            f"about {longest} tokens{dropped}"
        )
    resident: list[int] = []
    used = 0
    order = preference(dims.num_layers)
    for i in order:
        need = dims.layer_bytes[i]
        # the last layer to stay makes the slots unneeded
        streams_after = len(order) - len(resident) - 1
        if used + need + (slots if streams_after > 0 else 0) > room:
            break
        resident.append(i)
        used += need
    return TrainPlan(
        tokens=tokens,
        budget=budget,
        held=held,
        working_set=work,
        working_measured=measured_working is not None,
        slot_bytes=slots if len(resident) < dims.num_layers else 0,
        resident_layers=tuple(sorted(resident)),
        streamed_layers=dims.num_layers - len(resident),
        resident_bytes=used,
        checkpoint_host_bytes=dims.num_layers * tokens * dims.hidden_size * dims.dtype_bytes,
        weight_host_bytes=sum(dims.layer_bytes),
    )


def plan_layers(
    dims: TrainDims,
    tokens: int,
    sequence: int,
    budget: int,
    held: int,
    chunk_tokens: int,
    loss_chunk_tokens: int,
    asked: ChunkSetting,
    measured: Callable[[int | None], int | None] = lambda chunk: None,
    whole: TrainMemoryModel = MODEL,
    chunked: TrainMemoryModel = CHUNKED_MODEL,
    logits: bool = False,
) -> TrainPlan:
    """plan_step for a step of `tokens` tokens in rows of `sequence`, its layers whole or by
    chunks of query tokens as `asked` says (Note [Layers by chunks of query tokens] in
    train/chunked_layer.py): chunks of that many tokens (runs_by_chunks: a row no longer than a
    chunk runs whole), None whole, AUTO whole where whole layers fit (every layer streamed if need
    be) and by chunks of AUTO_CHUNK_TOKENS where only those fit (they take longer: whole layers
    where both fit). `measured(chunk)`: the working set a step of this length measured with
    those layers (None: none ran). The plan's attention_chunk_tokens says which ran."""

    def with_chunks(chunk: int | None) -> TrainPlan:
        by_chunks = runs_by_chunks(sequence, chunk)
        chunk = chunk if by_chunks else None
        plan = plan_step(
            dims,
            tokens,
            budget,
            held,
            chunk_tokens,
            loss_chunk_tokens,
            measured(chunk),
            chunked if by_chunks else whole,
            logits,
        )
        return dataclasses.replace(plan, attention_chunk_tokens=chunk)

    if asked != AUTO:
        assert asked is None or isinstance(asked, int)
        return with_chunks(asked)
    try:
        return with_chunks(None)
    except RevivaOutOfMemoryError:
        if not runs_by_chunks(sequence, AUTO_CHUNK_TOKENS):
            raise
    try:
        return with_chunks(AUTO_CHUNK_TOKENS)
    except RevivaOutOfMemoryError as e:
        raise RevivaOutOfMemoryError(
            f"{e} (the layers by chunks of {AUTO_CHUNK_TOKENS} query tokens; whole layers "
            "need more)"
        ) from None


def longest_tokens(
    dims: TrainDims,
    budget: int,
    held: int,
    chunk_tokens: int = 4096,
    loss_chunk_tokens: int = 1024,
    model: TrainMemoryModel = MODEL,
    multiple: int = 1024,
    logits: bool = False,
) -> int:
    """The longest sequence (a multiple of `multiple` tokens, or of 64 under `multiple`) whose
    step fits `budget` with every layer's weights streamed; 0 when none does."""
    args = (dims, budget, held, chunk_tokens, loss_chunk_tokens, model)
    found = _longest(*args, multiple, logits)
    if found == 0 and multiple > 64:
        return _longest(*args, 64, logits)
    return found


def _longest(
    dims: TrainDims,
    budget: int,
    held: int,
    chunk_tokens: int,
    loss_chunk_tokens: int,
    model: TrainMemoryModel,
    multiple: int,
    logits: bool,
) -> int:
    margin = model.margin_fixed + int(budget * model.margin_fraction)
    room = budget - held - margin - model.weight_slots * dims.largest_layer
    lo, hi = 0, multiple
    while working_set(dims, hi, chunk_tokens, loss_chunk_tokens, model, logits) <= room:
        lo, hi = hi, hi * 2
    while hi - lo > multiple:
        mid = (lo + hi) // 2 // multiple * multiple
        if working_set(dims, mid, chunk_tokens, loss_chunk_tokens, model, logits) <= room:
            lo = mid
        else:
            hi = mid
    return lo


def longest_host_tokens(dims: TrainDims, host_bytes: int) -> int:
    """The longest sequence whose checkpoints (each layer's input) fit `host_bytes` of pinned
    host memory beside every layer's frozen weights; 0 when the weights alone do not."""
    per_token = dims.num_layers * dims.hidden_size * dims.dtype_bytes
    return max(host_bytes - sum(dims.layer_bytes), 0) // per_token


def host_shortfall(plan: TrainPlan, dims: TrainDims, can_give: int, weights_pinned: bool) -> str:
    """Why a step's pinned host memory does not fit (Note [Checkpoints on the host]): "" when
    it fits. `can_give`: what the host can still pin; `weights_pinned`: the frozen weights are
    pinned already (a running Finetune), not asked of `can_give` again."""
    need = plan.checkpoint_host_bytes + (0 if weights_pinned else plan.weight_host_bytes)
    if need <= can_give:
        return ""
    room = can_give + (plan.weight_host_bytes if weights_pinned else 0)
    return (
        f"a {plan.tokens}-token step pins {format_bytes(plan.checkpoint_host_bytes)} of host "
        f"memory for its {dims.num_layers} layers' checkpoints"
        + ("" if weights_pinned else f" beside {format_bytes(plan.weight_host_bytes)} of weights")
        + f", over the {format_bytes(can_give)} the host can give; the longest sequence it holds "
        f"is about {longest_host_tokens(dims, room)} tokens"
    )


@dataclass(frozen=True)
class StepForecast:
    """A step's estimated time (seconds) and what sets it."""

    step_s: float
    compute_s: float
    linear_s: float
    attention_s: float
    copies_s: float  # frozen weights in (twice a streamed layer) and checkpoints out and in
    bound: str  # "compute" or "copies"
    calibration: str = CALIBRATION

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def forecast_step(
    dims: TrainDims,
    tokens: int,
    streamed_layers: int,
    pcie_bps: float | None = None,
    chunked: bool = False,
) -> StepForecast:
    """A step's time on the H200: the base weights are frozen, so a layer's linear work is its
    forward, its recompute and its input gradient (6 x parameters x tokens FLOPs; the head's the
    same with the loss's recompute); causal attention 2 x tokens^2 x heads x head_dim FLOPs
    forward, as many again in the recompute and 2.5 times that in backward. The copies (a
    streamed layer's weights twice, the checkpoints out and back, PCIe's two directions at
    once) run under the compute; a step takes the longer of the two. `chunked`: the layers run
    by chunks of query tokens, CHUNKED_EXTRA of the linear work's time more."""
    linear = 6 * tokens * (dims.num_layers * dims.layer_params + dims.hidden_size * dims.vocab_size)
    attention_fwd = 2 * tokens * tokens * dims.num_heads * dims.head_dim * dims.num_layers
    linear_s = linear / TRAIN_LINEAR_FLOPS
    attention_s = attention_fwd * (1 + 1 + 2.5) / TRAIN_ATTENTION_FLOPS
    rate = pcie_bps if pcie_bps is not None else PCIE_BPS
    weights_in = 2 * streamed_layers * dims.largest_layer
    checkpoints = dims.num_layers * tokens * dims.hidden_size * dims.dtype_bytes
    copies_s = (weights_in + checkpoints) / rate  # (host-to-device, the busier direction)
    compute_s = linear_s * (1 + CHUNKED_EXTRA if chunked else 1) + attention_s
    return StepForecast(
        step_s=max(compute_s, copies_s),
        compute_s=compute_s,
        linear_s=linear_s,
        attention_s=attention_s,
        copies_s=copies_s,
        bound="compute" if compute_s >= copies_s else "copies",
    )


def describe(dims: TrainDims, plan: TrainPlan) -> str:
    """One line for logs."""
    return (
        f"{plan.tokens} tokens: {len(plan.resident_layers)} of {dims.num_layers} layers' weights "
        f"resident, {plan.streamed_layers} streamed; working set {format_bytes(plan.working_set)}"
        f"{' (measured)' if plan.working_measured else ''}, held {format_bytes(plan.held)}, "
        f"budget {format_bytes(plan.budget)}; pinned host "
        f"{format_bytes(plan.checkpoint_host_bytes)} of checkpoints + "
        f"{format_bytes(plan.weight_host_bytes)} of weights"
        + (
            ""
            if plan.attention_chunk_tokens is None
            else f"; layers by chunks of {plan.attention_chunk_tokens} query tokens"
        )
    )
