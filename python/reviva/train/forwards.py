"""The forwards a streamed fine-tune installs on the model (Note [Streamed fine-tuning] in
train/finetune.py): each decoder layer as a _LayerStep (no autograd in forward, its input
checkpointed on the host, recomputed and back-propagated in its backward), the token-wise parts by
chunks of tokens (Note [Outputs nobody reads]), the causal LM's loss by chunks of tokens.

FinetuneForwards is a mixin of Finetune (train/finetune.py). State it reads: the tuner's layers,
_original forwards, weights, checkpoints, causal, chunk_tokens, loss_chunk_tokens,
attention_chunk_tokens, softcap, return_logits and _anchor. State it writes: _recomputed (the
layer being recomputed in its backward), _tiling (a layer runs by chunks of query tokens: its
norms and MLP run their own forwards, Note [Layers by chunks of query tokens] in
train/chunked_layer.py), _chunk_refusals and _chunks_refused (HF's layer, and its plan, after a
refusal).

Note [Outputs nobody reads]
A layer's recompute in backward exists for its graph: its output's values are never read (the
gradient flows from the output gradient saved by autograd), and in the Llama layout (Llama,
Mistral, Qwen2, Qwen3, SmolLM3, Phi-3: _MLP_LAST) the MLP's output only enters that output
through the residual's addition (Phi-3's dropout too), whose backward reads no values. So in the
recompute the MLP's TokenChunked computes nothing in its forward (an uninitialized output) and
runs each chunk once, with autograd, in its backward: the MLP's forward runs twice a step, as in
a plain run with checkpointing, not three times (a third of 14336-wide GEMMs is ~1.4 s of a 64k
step of the 8B shape on the H200). Where something reads the MLP's output (Gemma's
post_feedforward_layernorm) or its dropout draws random numbers, it is computed as usual.

Note [Logits with labels]
HF's causal LM returns its logits with the loss ([batch, tokens, vocab], the head's dtype,
after Gemma 2's final softcapping, differentiable: an auxiliary term on them back-propagates;
the Trainer's evaluation hands them to compute_metrics). The loss here never needs them (it runs
by chunks, ChunkedHeadLoss), but a forward with labels still returns them by default
(Finetune's return_logits=True), computed once the loss is, by the head run as HF runs it: the
[tokens, vocab] tensor is not held while the loss's chunks run, and beside HF's path the fp32
copy and the cross-entropy's [tokens, vocab] gradient never exist. Their bytes are real at long
context (64k tokens of a 128k vocabulary in bf16: 16 GB, alive through backward where the caller
keeps the output), so the step's plan counts them (train_plan.working_set's `logits`) and its
out-of-memory error names the option. return_logits=False returns the loss alone: the output's
`logits` then raises a ValueError naming the option (a None there would read as "no logits" and
silently differ from HF). Dict-style reads (items(), to_tuple(), HF's Trainer's prediction_step)
skip it as they skip every field that is None: evaluation with compute_metrics wants the
default. logits_to_keep with labels (a loss over some positions' logits, which HF's own loss
refuses by shape) is refused by name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from reviva.hf_versions import layer_cache
from reviva.train.chunked_layer import LayerChunks, refusal
from reviva.train.host_checkpoints import _Checkpoint
from reviva.train.plan import runs_by_chunks
from reviva.train.retry import grad_snapshot, restore_grads, set_rng
from reviva.train.step import with_hf_packing
from reviva.train.token_chunks import (
    autocast_state,
    chunked,
    draws_random,
    head_loss,
    rng_restored,
    rng_state,
    soft_capped,
)

# (the finetune's logger: what a user filters on stays reviva.finetune's)
log = logging.getLogger("reviva.finetune")

# Decoder layers whose MLP output only enters the layer's output through the residual's addition
# (Note [Outputs nobody reads]).
_MLP_LAST = frozenset(
    {
        "LlamaDecoderLayer",
        "MistralDecoderLayer",
        "Qwen2DecoderLayer",
        "Qwen3DecoderLayer",
        "SmolLM3DecoderLayer",
        "Phi3DecoderLayer",
    }
)
# The children of a decoder layer that map each token's row on their own (Note [Streamed
# fine-tuning]): run by chunks of tokens.
_TOKEN_WISE = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
    "mlp",
)


class _LayerStep(torch.autograd.Function):
    """A decoder layer without autograd in forward, recomputed and back-propagated in its
    backward (Note [Streamed fine-tuning])."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        anchor: torch.Tensor,
        tuner: FinetuneForwards,
        i: int,
        args: tuple,
        kwargs: dict[str, Any],
    ) -> torch.Tensor:
        layer = tuner.layers[i]
        ctx.tuner, ctx.i, ctx.args, ctx.kwargs = tuner, i, args, kwargs
        # (by chunks of query tokens where they compute what HF's layer computes: Note [Layers by
        # chunks of query tokens] in train/chunked_layer.py; the chunks keep their own generator
        # states)
        ctx.chunks = tuner._chunks(i, x, args, kwargs)
        ctx.rng = rng_state(x.device) if ctx.chunks is None and tuner._random(layer) else None
        ctx.autocast = autocast_state(x.device)
        y, ctx.chunks = tuner._run_layer(i, x, args, kwargs, ctx.chunks, step=True)
        ctx.checkpoint = tuner.checkpoints.save(x)
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        tuner: FinetuneForwards = ctx.tuner
        i = ctx.i
        record: _Checkpoint = ctx.checkpoint
        device = dy.device
        where = f"layer {i}'s backward"
        try:
            inputs = [tuner.checkpoints.restore(record)]  # (dropped before retire: a view of it)
        except torch.OutOfMemoryError as e:
            raise tuner._out_of_memory(e, where) from e
        # (what a failed attempt accumulated is put back before the next: Note [Out of memory
        # inside a step] in train/retry.py)
        before = grad_snapshot(tuner.layers[i].parameters())

        # (a layer whose forward ran whole may go back by chunks where the step's layers turned
        # to chunks after an out-of-memory, Note [Out of memory inside a step], unless it drew
        # random numbers: the chunks could not replay them)
        drew_nothing = ctx.rng is None
        chunks: LayerChunks | None = ctx.chunks
        plan = tuner._plan
        if chunks is None and drew_nothing and plan is not None and plan.attention_chunk_tokens:
            chunks = tuner._chunks(i, inputs[0], ctx.args, ctx.kwargs)

        def attempt() -> torch.Tensor | None:
            autocast = torch.autocast(device.type, dtype=ctx.autocast[1], enabled=ctx.autocast[0])
            if chunks is not None:
                with tuner._weights_of(i), autocast, tuner._tiled():
                    return chunks.backward(inputs[0], dy, bool(ctx.needs_input_grad[0]))
            with (
                tuner._weights_of(i),
                rng_restored(ctx.rng, device),
                autocast,
                torch.enable_grad(),
                tuner._recomputing(i),
            ):
                xg = inputs[0].detach().requires_grad_(bool(ctx.needs_input_grad[0]))
                y = tuner._original[i](xg, *ctx.args, **ctx.kwargs)
                if y.requires_grad:
                    torch.autograd.backward(y, dy)
                return xg.grad

        def undo() -> bool:
            if before is None:
                return False
            restore_grads(before)
            return True

        def by_chunks() -> bool:
            nonlocal chunks
            if chunks is not None or not drew_nothing:
                return False
            chunks = tuner._to_chunks(i, inputs[0], ctx.args, ctx.kwargs)
            return chunks is not None

        dx = tuner._retrying(where, attempt, undo, by_chunks)
        inputs.clear()
        tuner.checkpoints.retire(record)
        ctx.checkpoint = ctx.chunks = None
        return dx, None, None, None, None, None


class FinetuneForwards:
    """The model's forwards under a Finetune (its mixin; see the module docstring)."""

    def _random(self, layer: nn.Module) -> bool:
        dropout = getattr(getattr(layer, "self_attn", None), "attention_dropout", 0.0) or 0.0
        return layer.training and (dropout > 0 or draws_random(layer))

    @contextlib.contextmanager
    def _weights_of(self, i: int) -> Iterator[None]:
        self.weights.acquire(i)
        try:
            yield
        finally:
            self.weights.release(i)

    def _run_layer(
        self,
        i: int,
        x: torch.Tensor,
        args: tuple,
        kwargs: dict[str, Any],
        chunks: LayerChunks | None = None,
        step: bool = False,
    ) -> tuple[Any, LayerChunks | None]:
        """Layer i's forward, without autograd (by `chunks` where given), and the chunks it ran
        by: in a training `step`, an out-of-memory with every layer streamed may turn it to
        chunks (Note [Out of memory inside a step] in train/retry.py)."""
        # (run again after an out-of-memory from the same generators' state: Note [Out of
        # memory inside a step] in train/retry.py)
        state = rng_state(x.device) if self._random(self.layers[i]) else None

        def attempt() -> Any:
            if chunks is not None:
                with self._weights_of(i), self._tiled():
                    return chunks.forward(x)
            with self._weights_of(i):
                return self._original[i](x, *args, **kwargs)

        def undo() -> bool:
            set_rng(state, x.device)
            return True

        def by_chunks() -> bool:
            nonlocal chunks
            if chunks is not None or not step:
                return False
            chunks = self._to_chunks(i, x, args, kwargs)
            return chunks is not None

        return self._retrying(f"layer {i}'s forward", attempt, undo, by_chunks), chunks

    def _layer_forward(self, i: int) -> Callable[..., Any]:
        def forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if layer_cache(kwargs) is not None and torch.is_grad_enabled():
                raise ValueError(
                    "reviva.finetune: a training forward with a K/V cache (use_cache=True) "
                    "would write each layer's K/V twice (forward and recompute); pass "
                    "use_cache=False"
                )
            layer = self.layers[i]
            trained = any(p.requires_grad for p in layer.parameters())
            if torch.is_grad_enabled() and (trained or hidden_states.requires_grad):
                return _LayerStep.apply(hidden_states, self._anchor, self, i, args, kwargs)
            return self._run_layer(i, hidden_states, args, kwargs)[0]

        return forward

    def _token_wise(self, module: nn.Module, unread_in: int | None = None) -> Callable[..., Any]:
        """The module by chunks of tokens; `unread_in`: the layer in whose recompute its output
        is not read (Note [Outputs nobody reads])."""
        own = module.forward

        def forward(x: Any, *args: Any, **kwargs: Any) -> Any:
            if self._tiling or args or kwargs or not isinstance(x, torch.Tensor):
                return own(x, *args, **kwargs)
            random = module.training and draws_random(module)
            unread = unread_in is not None and self._recomputed == unread_in
            return chunked(own, x, self.chunk_tokens, self._anchor, random, unread)

        return forward

    @contextlib.contextmanager
    def _tiled(self) -> Iterator[None]:
        """A layer runs by chunks of query tokens: its norms and MLP run their own forwards on
        each chunk (Note [Layers by chunks of query tokens] in train/chunked_layer.py)."""
        before, self._tiling = self._tiling, True
        try:
            yield
        finally:
            self._tiling = before

    def _chunks(
        self, i: int, x: torch.Tensor, args: tuple, kwargs: dict[str, Any]
    ) -> LayerChunks | None:
        """Layer i's call in a training step by chunks of query tokens where the step's plan
        runs its layers so (train_plan.plan_layers) and that computes what HF's layer computes
        (chunked_layer.refusal); None: HF's layer, whole (the plan's, a sequence no longer than
        a chunk, or a refusal: said once in the log, and the step's plan is the untiled one's
        from then on)."""
        chunk = None if self._plan is None else self._plan.attention_chunk_tokens
        if chunk is None or x.dim() != 3 or not runs_by_chunks(x.shape[1], chunk):
            return None
        why = refusal(self.layers[i], x, args, kwargs)
        if why is None:
            cos, sin = kwargs["position_embeddings"]
            return LayerChunks(self.layers[i], cos, sin, x.shape[1], chunk)
        if why not in self._chunk_refusals:  # (said once: not a silent fallback)
            self._chunk_refusals.add(why)
            log.info(
                "reviva.finetune: layer %d runs as HF runs it, not by chunks of %d query "
                "tokens: %s",
                i,
                chunk,
                why,
            )
        self._chunks_refused = True  # (HF's layer: the plan of its working set from now on)
        return None

    @contextlib.contextmanager
    def _recomputing(self, i: int) -> Iterator[None]:
        """Layer i's recompute in its backward (Note [Outputs nobody reads])."""
        before, self._recomputed = self._recomputed, i
        try:
            yield
        finally:
            self._recomputed = before

    def _causal_forward(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        causal = self.causal

        # (the model's own signature, through __wrapped__: HF's Trainer keeps the dataset's
        # columns it names, remove_unused_columns; generate reads it to pass attention_mask,
        # position_ids and logits_to_keep)
        @functools.wraps(inner)
        def forward(*args: Any, labels: torch.Tensor | None = None, **kwargs: Any) -> Any:
            if labels is None or kwargs.get("fused_lm_head") or args:
                # (no loss, or a loss computed by whoever patched the forward before: TRL's
                # fused head reads the decoder's output itself)
                if labels is not None:
                    kwargs["labels"] = labels
                return inner(*args, **kwargs)
            return self._loss_forward(causal, labels, kwargs)

        return forward

    def _loss_forward(self, causal: nn.Module, labels: torch.Tensor, kwargs: dict[str, Any]) -> Any:
        from transformers.modeling_outputs import CausalLMOutputWithPast

        keep = kwargs.pop("logits_to_keep", 0)
        if not (isinstance(keep, int) and keep == 0):
            raise ValueError(
                f"reviva.finetune: labels with logits_to_keep={keep!r}: the loss is over every "
                "position (HF's loss of some positions' logits against every label fails on its "
                "shapes); pass logits_to_keep=0 with labels"
            )
        if layer_cache(kwargs) is not None:
            raise ValueError(
                "reviva.finetune: labels with past_key_values: a loss over a cached prefix is not "
                "supported (the chunked loss needs the whole sequence's hidden states)"
            )
        num_items = kwargs.pop("num_items_in_batch", None)
        shifted = kwargs.pop("shift_labels", None)
        ignore = kwargs.pop("ignore_index", -100)
        if ignore != -100:
            raise ValueError(f"reviva.finetune: ignore_index={ignore!r}; the loss ignores -100")
        kwargs.pop("return_dict", None)
        # (HF's masks of packed position_ids follow the caller's use_cache: Note [Packed
        # sequences] in train/step.py)
        kwargs = with_hf_packing(causal.model, kwargs)
        kwargs["use_cache"] = False
        outputs = causal.model(**kwargs)
        hidden = outputs.last_hidden_state
        loss = self._retrying(
            "the loss",
            lambda: head_loss(
                hidden,
                causal.lm_head,
                labels,
                self.loss_chunk_tokens,
                num_items,
                self.softcap,
                shifted,
                self._retrying,  # (its backward: Note [Out of memory inside a step])
            ),
        )
        fields = dict(
            loss=loss,
            past_key_values=None,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )
        if not self.return_logits:  # (Note [Logits with labels])
            return _loss_only_output()(**fields)
        # (after the loss's chunks: not held beside them; capped as HF's Gemma 2 returns them)
        logits = self._retrying(
            "the logits returned beside the loss",
            lambda: soft_capped(causal.lm_head(hidden), self.softcap),
        )
        return CausalLMOutputWithPast(logits=logits, **fields)


@functools.cache
def _loss_only_output() -> type:
    """The output of a forward with labels under return_logits=False (Note [Logits with
    labels]): HF's CausalLMOutputWithPast whose `logits` raises, naming the option. Made on
    first use (transformers is not needed to import reviva)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    @dataclasses.dataclass
    class LossOnlyOutput(CausalLMOutputWithPast):
        """A causal LM's loss without its logits (reviva.finetune(..., return_logits=False))."""

        @property
        def logits(self) -> torch.Tensor:
            raise ValueError(
                "reviva.finetune(..., return_logits=False): this forward returned the loss "
                "without the logits (their [tokens, vocab] bytes never existed); make the "
                "Finetune with return_logits=True (the default, as HF) to have them"
            )

        @logits.setter
        def logits(self, value: torch.Tensor | None) -> None:
            if value is not None:
                raise ValueError("LossOnlyOutput holds no logits")
            self.__dict__["logits"] = None  # (what ModelOutput's checks read)

    return LossOnlyOutput
