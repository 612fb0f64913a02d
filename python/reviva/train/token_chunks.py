"""Autograd functions that run a token-wise computation by chunks of tokens, saving only their
input, for fine-tuning at long context (reviva.finetune, Note [Streamed fine-tuning]).

- `TokenChunked`: y = f(x) for a module that maps each token's row on its own (a norm, an MLP),
  run chunk by chunk; backward recomputes each chunk with autograd and back-propagates through it
  at once, so that what the module saves for backward (an MLP's gate, up and product: 10.5 rows of
  the hidden size a token for Llama-3-8B; an RMSNorm's fp32 copies: 4) exists for one chunk at a
  time instead of for every token.
- `ChunkedHeadLoss`: a causal LM's loss (the output head, then cross-entropy on the shifted
  labels, as transformers' ForCausalLMLoss computes it) by chunks of tokens, forward and
  backward, so that [tokens, vocab] logits never exist: 128k tokens of a 128k vocabulary are
  64 GB in fp32.

Both restore the random number generators' state of each chunk for its recompute (a LoRA dropout
draws the same mask twice), as torch.utils.checkpoint does, and both compute in the same dtype
and order of operations as the module run whole, so gradients differ from a plain run's only by
the matmuls' own chunking (their reductions run over the hidden size, not the tokens).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.nn import functional as F

# `retry(where, run)`: run() again after an out-of-memory where that can help (Finetune._retrying)
Grads = tuple[torch.Tensor | None, ...]
Retry = Callable[[str, Callable[[], Grads]], Grads]

IGNORE_INDEX = -100  # transformers' ignore_index for labels


def rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The CPU generator's state and the device's (CUDA), to replay a computation's randomness."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


@contextlib.contextmanager
def rng_restored(
    state: tuple[torch.Tensor, torch.Tensor | None] | None, device: torch.device
) -> Iterator[None]:
    """Runs the block with the generators at `state` (None: as they are), leaving them as they
    were before it."""
    if state is None:
        yield
        return
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, enabled=True):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield


def draws_random(module: nn.Module) -> bool:
    """Whether the module's forward may draw random numbers in its current mode: a dropout
    module with p > 0 in training (PEFT's lora_dropout, HF's MLP dropouts)."""
    return any(
        m.training and isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0
        for m in module.modules()
    )


def chunk_spans(rows: int, chunk: int) -> list[tuple[int, int]]:
    """[start, end) of each chunk of `chunk` rows (the last one shorter)."""
    return [(s, min(s + chunk, rows)) for s in range(0, rows, chunk)]


def autocast_state(device: torch.device) -> tuple[bool, torch.dtype]:
    """Whether autocast is on for the device's type, and its dtype: a recompute's is the
    forward's."""
    return torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type)


def run_by_chunks(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, chunk: int
) -> torch.Tensor:
    """fn over x's rows (every dimension but the last flattened) by chunks of `chunk`, without
    autograd: the output is one tensor, filled chunk by chunk."""
    rows = x.reshape(-1, x.shape[-1])
    out: torch.Tensor | None = None
    for s, e in chunk_spans(rows.shape[0], chunk):
        y = fn(rows[s:e])
        if out is None:
            out = torch.empty((rows.shape[0], y.shape[-1]), dtype=y.dtype, device=y.device)
        out[s:e] = y
    assert out is not None
    return out.view(*x.shape[:-1], out.shape[-1])


class TokenChunked(torch.autograd.Function):
    """y = fn(x) by chunks of rows (see the module docstring). `anchor` is a tensor that needs a
    gradient (never used), so that the function's backward runs when x needs none: the
    parameters inside fn (LoRA's) get theirs through the recompute. `unread`: y's values are
    never read (Note [Outputs nobody reads]): the forward computes nothing and returns an
    uninitialized tensor of x's shape, the backward recomputes each chunk as always."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        anchor: torch.Tensor,
        fn: Callable[[torch.Tensor], torch.Tensor],
        chunk: int,
        random: bool,
        unread: bool = False,
    ) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        spans = chunk_spans(rows.shape[0], chunk)
        ctx.save_for_backward(x)
        ctx.fn, ctx.spans = fn, spans
        if unread:
            assert not random  # (the chunks' generator states would be those of a forward)
            ctx.states = [None] * len(spans)
            return torch.empty_like(x)
        states: list[tuple[torch.Tensor, torch.Tensor | None] | None] = []

        def each(piece: torch.Tensor) -> torch.Tensor:  # (a chunk's generators, then the chunk)
            states.append(rng_state(x.device) if random else None)
            return fn(piece)

        ctx.states = states
        return run_by_chunks(each, x, chunk)

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, dy: torch.Tensor
    ) -> tuple[torch.Tensor | None, None, None, None, None, None]:
        (x,) = ctx.saved_tensors
        rows = x.detach().reshape(-1, x.shape[-1])
        grads = dy.reshape(-1, dy.shape[-1])
        dx = torch.empty_like(rows) if ctx.needs_input_grad[0] else None
        for (s, e), state in zip(ctx.spans, ctx.states, strict=True):
            with rng_restored(state, x.device), torch.enable_grad():
                piece = rows[s:e].detach().requires_grad_(dx is not None)
                y = ctx.fn(piece)
                if y.requires_grad:
                    torch.autograd.backward(y, grads[s:e])
            if dx is not None:
                dx[s:e] = piece.grad if piece.grad is not None else 0
        return (dx.view_as(x) if dx is not None else None), None, None, None, None, None


def chunked(
    fn: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    chunk: int,
    anchor: torch.Tensor,
    random: bool,
    unread: bool = False,
) -> torch.Tensor:
    """fn(x) by chunks of `chunk` rows where x has more rows than that (TokenChunked under
    autograd, run_by_chunks without it); fn(x) itself otherwise. `unread` (under autograd, fn
    drawing no random numbers): TokenChunked's output values are not computed (Note [Outputs
    nobody reads] in train/forwards.py)."""
    if x.dim() < 2 or x.reshape(-1, x.shape[-1]).shape[0] <= chunk:
        return fn(x)
    if torch.is_grad_enabled():
        return TokenChunked.apply(x, anchor, fn, chunk, random, unread and not random)
    return run_by_chunks(fn, x, chunk)


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """The labels each position predicts (the next token's; ignored at the end), as
    transformers' ForCausalLMLoss shifts them."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].contiguous()


def soft_capped(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Gemma 2's final_logit_softcapping as HF applies it (none where `softcap` is None)."""
    if softcap is None:
        return logits
    return torch.tanh(logits / softcap) * softcap


def _chunk_loss(
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    y: torch.Tensor,
    softcap: float | None,
) -> torch.Tensor:
    """Summed cross-entropy of one chunk, in the plain path's dtypes: the head's logits in the
    model's dtype, then fp32 (ForCausalLMLoss's logits.float())."""
    logits = soft_capped(F.linear(h, weight, bias).float(), softcap)  # (before the loss)
    return F.cross_entropy(logits, y, ignore_index=IGNORE_INDEX, reduction="sum")


class ChunkedHeadLoss(torch.autograd.Function):
    """loss = sum over tokens of cross_entropy(head(h), labels) / denominator, by chunks of
    tokens (see the module docstring). h: [rows, hidden]; labels: [rows] already shifted;
    denominator: the number of labelled tokens (HF's "mean"), or num_items_in_batch."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        h: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        labels: torch.Tensor,
        denominator: torch.Tensor,
        chunk: int,
        softcap: float | None,
        retry: Retry | None = None,
    ) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for s, e in chunk_spans(h.shape[0], chunk):
            total += _chunk_loss(h[s:e], weight, bias, labels[s:e], softcap)
        ctx.save_for_backward(h, weight, bias, labels, denominator)
        ctx.chunk, ctx.softcap, ctx.retry = chunk, softcap, retry
        return total / denominator

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        h, weight, bias, labels, denominator = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        # d loss / d (a chunk's summed cross-entropy), in fp32 as the plain path's division
        scale = grad / denominator

        def run() -> tuple[torch.Tensor | None, ...]:
            # (the head's gradients go to leaves of this run's own, returned at its end: a run
            # that fails leaves nothing behind, and the retry starts afresh)
            dh = torch.empty_like(h) if need_h else None
            w = weight.detach().requires_grad_(need_w)
            b = bias.detach().requires_grad_(need_b) if bias is not None else None
            for s, e in chunk_spans(h.shape[0], ctx.chunk):
                with torch.enable_grad():
                    piece = h[s:e].detach().requires_grad_(need_h)
                    loss = _chunk_loss(piece, w, b, labels[s:e], ctx.softcap)
                    torch.autograd.backward(loss, scale)
                if dh is not None:
                    dh[s:e] = piece.grad
            dw = w.grad if need_w else None
            db = b.grad if need_b and b is not None else None
            return dh, dw, db

        grads = run() if ctx.retry is None else ctx.retry("the loss's backward", run)
        return (*grads, None, None, None, None, None)


def head_loss(
    hidden: torch.Tensor,
    head: nn.Linear,
    labels: torch.Tensor,
    chunk: int,
    num_items_in_batch: torch.Tensor | int | None = None,
    softcap: float | None = None,
    shifted: torch.Tensor | None = None,
    retry: Retry | None = None,
) -> torch.Tensor:
    """The causal LM loss of `hidden` [batch, tokens, hidden] through `head` against `labels`
    [batch, tokens] (shifted here, or `shifted` as given: transformers' shift_labels), as
    transformers' ForCausalLMLoss computes it (mean over labelled tokens, or their sum over
    num_items_in_batch), the logits of `chunk` tokens at a time. `retry(where, run)`: runs the
    backward, again after an out-of-memory (a Finetune's, Note [Out of memory inside a step])."""
    targets = shift_labels(labels) if shifted is None else shifted
    targets = targets.to(hidden.device).reshape(-1)
    rows = hidden.reshape(-1, hidden.shape[-1])
    if targets.shape[0] != rows.shape[0]:
        raise ValueError(
            f"labels of {targets.shape[0]} tokens for hidden states of {rows.shape[0]} tokens"
        )
    if num_items_in_batch is None:
        denominator = (targets != IGNORE_INDEX).sum().to(torch.float32)
    else:
        denominator = torch.as_tensor(num_items_in_batch, device=hidden.device).to(torch.float32)
    return ChunkedHeadLoss.apply(
        rows, head.weight, head.bias, targets, denominator, chunk, softcap, retry
    )
