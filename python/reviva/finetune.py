"""reviva.finetune: fine-tuning a causal LM whose base weights are frozen (LoRA, or any other
set of trainable parameters) at long context on a card smaller than the model needs.

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16), lora)
    tuner = reviva.finetune(model, budget="24GB")   # the frozen layer weights go to pinned memory
    for batch in data:                               # plain PyTorch, HF's Trainer or TRL's
        loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        loss.backward()
        optimizer.step(); optimizer.zero_grad()
    print(tuner.stats())

Note [Streamed fine-tuning]
An 8B model's bf16 weights are 16 GB: a 24 GB card keeps ~7 GB beside them, and the loss alone
wants [tokens, vocab] fp32 logits (2 GB at 4k tokens of a 128k vocabulary), so activation
offload alone cannot reach long sequences. A step here holds on the device only:
- the trainable parameters (LoRA's, norms being trained), their gradients and optimizer state,
  and the parts outside the decoder layers (the head; the input embedding's table moves to
  pinned host memory when it is frozen and not tied: Note [Embedding on the host] in
  weights.py);
- the frozen weights of the layers the plan keeps resident (train_plan.plan_step); the others
  stream from pinned host memory through two slots (reviva.weights.StreamedWeights, the
  inference path's WeightStore), in the order a step uses them: forward 0..n-1, then backward
  n-1..0, where a layer's recompute and its gradient read its weights once more (Note
  [Declared orders] in src/weight_store.cpp; the last layer's two uses are adjacent, and so
  are layer 0's backward and the next step's forward: those stream first);
- each layer's input, its checkpoint, on its way to pinned host memory (Note [Checkpoints on
  the host]) and brought back for its layer's backward ahead of use;
- one layer's recompute and backward (_LayerStep, as torch's reentrant checkpoint: the layer
  runs without autograd in forward; its backward runs it again with autograd and
  back-propagates through it at once), whose token-wise parts (its norms and its MLP) run by
  chunks of tokens saving only their inputs (token_chunks.TokenChunked), as the final norm does;
- the loss by chunks of tokens, forward and backward (token_chunks.ChunkedHeadLoss): no
  [tokens, vocab] logits.
The parameters inside a layer that need gradients get them from the recompute's backward
(accumulated in .grad, as a plain backward does); a tensor that needs a gradient (`_anchor`) is
each _LayerStep's input so that its backward runs where the layer's input needs none (a frozen
input embedding). Random numbers (dropout) are replayed from each layer's and each chunk's saved
generator state, and autocast from the forward's state, so the recompute computes what the
forward did.

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

Note [Checkpoints on the host]
A layer's input is saved as a block of a core OffloadManager of its own (adopted: its device
memory becomes the block's, offloaded at once on the copy stream after an event on compute;
torch's allocator gets the memory back once the copy has read it), and the backward order is
declared to a PrefetchScheduler when the step's first checkpoint is needed: the last layer's
first, each brought back `prefetch_layers` ahead while the layer before computes. A checkpoint is
given up (its block unregistered) as soon as its layer's backward is done, and whatever else
ends it (an exception, a graph dropped without backward) ends it when autograd lets go of the
layer's context. At 64k tokens of the 8B shape a checkpoint is 512 MiB; the host holds the
step's 32 (16 GiB, pinned, pooled from step to step).
"""

from __future__ import annotations

import contextlib
import logging
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from reviva._C import OffloadManager, PrefetchScheduler, RevivaOutOfMemoryError
from reviva.adapters import inspect_model
from reviva.resources import device_resources
from reviva.sizes import format_bytes, parse_bytes
from reviva.token_chunks import (
    chunked,
    draws_random,
    head_loss,
    rng_restored,
    rng_state,
)
from reviva.train_plan import TrainDims, TrainPlan, describe, plan_step
from reviva.weights import HostEmbedding, StreamedWeights

log = logging.getLogger(__name__)

_FINETUNED = "_reviva_finetune"  # the CausalLM's __dict__ key: its Finetune, weakly
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


class FinetuneOutOfMemoryError(RevivaOutOfMemoryError, torch.OutOfMemoryError):
    """Torch ran out of device memory in a streamed fine-tuning step: the message names the
    step's plan and torch's message."""


@dataclass
class FinetuneStats:
    """What a Finetune did: bytes, seconds; the plan of the last step."""

    steps: int = 0  # training steps begun (forwards with autograd)
    tokens: int = 0  # of the last step
    resident_layers: int = 0
    streamed_layers: int = 0
    weight_bytes_to_device: int = 0  # frozen weights brought in, all steps
    weight_stall_s: float = 0.0  # compute waiting for a layer's weights
    checkpoint_bytes_to_host: int = 0
    checkpoint_bytes_to_device: int = 0
    checkpoint_stall_s: float = 0.0  # compute waiting for a checkpoint to come back
    checkpoint_host_wait_s: float = 0.0  # the host waiting for checkpoints' copies (forward)
    working_set_bytes: int | None = None  # measured (CUDA): the last step's peak beside `held`
    plan: TrainPlan | None = None


def _causal_lm(model: nn.Module) -> nn.Module:
    """The CausalLM inside `model`: itself, or a PEFT model's base model."""
    seen = model
    for _ in range(4):
        if "lm_head" in seen._modules and "model" in seen._modules:  # (not PEFT's forwarding)
            return seen
        base = getattr(seen, "get_base_model", None)
        if not callable(base):
            break
        inner = base()
        if inner is seen:
            break
        seen = inner
    raise ValueError(
        f"reviva.finetune: {type(model).__name__} is not a causal LM with the Llama decoder "
        "layout (no `lm_head` and `model` found, also through a PEFT model's get_base_model())"
    )


def _run_directly(fn: Callable[..., Any], *args: Any) -> Any:
    """A layer's gradient-checkpointing function under reviva.finetune: the layer itself (its
    checkpointing is Reviva's: Finetune._serve_hf_checkpointing)."""
    return fn(*args)


def _autocast_state(device: torch.device) -> tuple[bool, torch.dtype]:
    kind = device.type
    return torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)


class _Checkpoint:
    """One layer's input of a step in pinned host memory (Note [Checkpoints on the host])."""

    __slots__ = ("owner", "block", "dtype", "shape", "nbytes", "restored", "__weakref__")

    def __init__(
        self, owner: _Checkpoints, block: int, dtype: torch.dtype, shape: tuple[int, ...]
    ) -> None:
        self.owner = weakref.ref(owner)
        self.block: int | None = block
        self.dtype = dtype
        self.shape = shape
        self.nbytes = owner.manager.nbytes(block)
        self.restored: torch.Tensor | None = None  # the block on the device once brought back

    def __del__(self) -> None:
        self.restored = None
        owner = self.owner()
        if owner is not None:
            owner.retire(self)


class _Checkpoints:
    """The step's layer inputs on the core's OffloadManager and PrefetchScheduler (Note
    [Checkpoints on the host])."""

    def __init__(self, engine: object, prefetch_layers: int) -> None:
        self.manager = OffloadManager(
            engine, budget_bytes=1, allocator="torch_compute", timeline_capacity=1 << 12
        )
        self.prefetch_layers = prefetch_layers
        self.scheduler: PrefetchScheduler | None = None
        self._saved: list[weakref.ReferenceType[_Checkpoint]] = []  # this step's, saving order
        self._using: dict[int, int] = {}  # blocks handed to compute: their bytes
        self._dropping: list[int] = []  # given up while a view of them lived
        self._window = 0  # device bytes of checkpoints in flight (either way)

    def begin_step(self) -> None:
        if self.scheduler is not None:
            self.scheduler.end_step()
            self.scheduler = None
        self._saved = []
        dropping, self._dropping = self._dropping, []
        for block in dropping:
            self._unregister_or_keep(block)

    def save(self, x: torch.Tensor) -> _Checkpoint:
        t = x.detach()
        if not t.is_contiguous() or t.untyped_storage().nbytes() != t.nbytes:
            t = t.clone(memory_format=torch.contiguous_format)  # (a storage of its own)
        self._window = max(self._window, (self.prefetch_layers + 1) * t.nbytes)
        self._raise(sum(self._using.values()) + self._window)
        whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
        block = self.manager.adopt(whole)
        self.manager.offload(block)
        del whole
        record = _Checkpoint(self, block, t.dtype, tuple(t.shape))
        self._saved.append(weakref.ref(record))
        return record

    def restore(self, record: _Checkpoint) -> torch.Tensor:
        if record.block is None:
            raise RuntimeError("reviva.finetune: a layer's checkpoint was used after it ended")
        if record.restored is None:
            if self.scheduler is None:
                self._start_backward()
            assert self.scheduler is not None
            need = sum(self._using.values()) + record.nbytes
            self._raise(need + self._window)
            try:
                (t,) = self.scheduler.acquire_group([record.block], "read")
            except RevivaOutOfMemoryError:  # (a view of a used block still alive)
                self._raise(self.manager.device_bytes + record.nbytes)
                (t,) = self.scheduler.acquire_group([record.block], "read")
            record.restored = t
            self._using[record.block] = record.nbytes
            del t  # the lease lives in the record alone
            self.scheduler.release_group([record.block], False)
        return record.restored.view(record.dtype).view(record.shape)

    def _start_backward(self) -> None:
        live = [r for r in (ref() for ref in self._saved) if r is not None and r.block is not None]
        self.scheduler = PrefetchScheduler(
            self.manager,
            prefetch_groups=self.prefetch_layers,
            eager_offload=False,
            max_ahead_bytes=max(self._window, 1),
        )
        if live:
            self.scheduler.declare_order([[r.block] for r in reversed(live)])

    def retire(self, record: _Checkpoint) -> None:
        """The checkpoint's layer is done with it: its block goes (now, or when the last view
        of it goes), and the next ones of the order come back into its room."""
        block, record.block = record.block, None
        record.restored = None
        if block is None:
            return
        self._unregister_or_keep(block)
        if self.scheduler is not None:
            self.scheduler.release_group([], False)

    def _unregister_or_keep(self, block: int) -> None:
        try:
            self.manager.unregister(block)
        except ValueError:  # a view of it is alive: discarded when it goes
            if self.manager.discard_when_free(block):
                self._dropping.append(block)
                return
            self.manager.unregister(block)
        self._using.pop(block, None)

    def _raise(self, nbytes: int) -> None:
        if nbytes > self.manager.budget_bytes:
            self.manager.budget_bytes = int(nbytes)


class _LayerStep(torch.autograd.Function):
    """A decoder layer without autograd in forward, recomputed and back-propagated in its
    backward (Note [Streamed fine-tuning])."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        anchor: torch.Tensor,
        tuner: Finetune,
        i: int,
        args: tuple,
        kwargs: dict[str, Any],
    ) -> torch.Tensor:
        layer = tuner.layers[i]
        ctx.tuner, ctx.i, ctx.args, ctx.kwargs = tuner, i, args, kwargs
        ctx.rng = rng_state(x.device) if tuner._random(layer) else None
        ctx.autocast = _autocast_state(x.device)
        y = tuner._run_layer(i, x, args, kwargs)
        ctx.checkpoint = tuner.checkpoints.save(x)
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        tuner: Finetune = ctx.tuner
        i = ctx.i
        record: _Checkpoint = ctx.checkpoint
        device = dy.device
        try:
            x = tuner.checkpoints.restore(record)
            with (
                tuner._weights_of(i),
                rng_restored(ctx.rng, device),
                torch.autocast(device.type, dtype=ctx.autocast[1], enabled=ctx.autocast[0]),
                torch.enable_grad(),
                tuner._recomputing(i),
            ):
                xg = x.detach().requires_grad_(bool(ctx.needs_input_grad[0]))
                y = tuner._original[i](xg, *ctx.args, **ctx.kwargs)
                if y.requires_grad:
                    torch.autograd.backward(y, dy)
                dx = xg.grad
            del x, xg, y
        except torch.OutOfMemoryError as e:
            raise tuner._out_of_memory(e, f"layer {i}'s backward") from e
        tuner.checkpoints.retire(record)
        ctx.checkpoint = None
        return dx, None, None, None, None, None


class Finetune:
    """A model set up for streamed fine-tuning (the module docstring; Note [Streamed
    fine-tuning]). Made by `reviva.finetune`; `close()` puts the model's own forwards back."""

    def __init__(
        self,
        model: nn.Module,
        budget: int | str | None = None,
        *,
        device: torch.device | str | None = None,
        chunk_tokens: int = 4096,
        loss_chunk_tokens: int | None = None,
        prefetch_layers: int = 1,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"reviva.finetune wraps an nn.Module, got {type(model).__name__}")
        for name, value, least in (
            ("chunk_tokens", chunk_tokens, 1),
            ("loss_chunk_tokens", loss_chunk_tokens, 1),
            ("prefetch_layers", prefetch_layers, 1),
        ):
            if value is None and name == "loss_chunk_tokens":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(
                    f"reviva.finetune: {name} must be an int >= {least}, got {value!r}"
                )
        self.budget = None if budget is None else parse_bytes(budget)
        if self.budget is not None and self.budget <= 0:
            raise ValueError(f"reviva.finetune: budget must be > 0 bytes, got {budget!r}")
        self.model = model
        causal = _causal_lm(model)
        self.causal = causal
        earlier = causal.__dict__.get(_FINETUNED)
        if earlier is not None and earlier() is not None:
            raise ValueError(
                "reviva.finetune: this model is already set up for streamed fine-tuning (its "
                "Finetune is alive); use that one, or close() it first"
            )
        layout = inspect_model(causal)
        if layout.num_experts:
            raise ValueError(
                "reviva.finetune: mixture-of-experts layers (Mixtral, Qwen3-MoE) are not "
                "supported for fine-tuning yet; dense decoder layers only"
            )
        head = causal.lm_head
        if type(head) is not nn.Linear:
            raise ValueError(
                f"reviva.finetune: the output head is a {type(head).__name__}, not an nn.Linear "
                "(the chunked loss computes its logits)"
            )
        self.device = self._device_of(model, device)
        self.layout = layout
        self.layers: list[nn.Module] = list(layout.layers)
        self.chunk_tokens = chunk_tokens
        vocab = layout.vocab_size
        self.loss_chunk_tokens = loss_chunk_tokens or max(128, (512 << 20) // (4 * vocab))
        self.prefetch_layers = prefetch_layers
        self.softcap = getattr(causal.config, "final_logit_softcapping", None)
        self.resources = device_resources(self.device)
        self._cuda = self.device.type == "cuda"
        self._move_the_rest()
        self.weights = StreamedWeights(
            self.layers,
            self.resources.engine,
            self.resources.arena,
            self.device,
            timeline_capacity=1 << 12,
            frozen_only=True,
        )
        self.weights.in_call = True  # (every use acquires: the outside-a-call guard is not needed)
        n = len(self.layers)
        self.weights.set_order(list(range(n)) + list(reversed(range(n))))
        self.host_embedding: HostEmbedding | None = None
        embed = layout.embed_tokens
        if (
            type(embed) is nn.Embedding
            and embed.max_norm is None
            and not embed.weight.requires_grad
            and embed.weight is not head.weight
        ):
            self.host_embedding = HostEmbedding(
                embed, self.resources.pool, self.resources.runtime, self.device
            )
        if self._cuda:
            torch.cuda.empty_cache()  # (the layers' device memory, if they were there)
        self.dims = TrainDims(
            num_layers=n,
            hidden_size=layout.hidden_size,
            intermediate_size=layout.intermediate_size,
            vocab_size=vocab,
            num_heads=layout.num_heads,
            head_dim=layout.head_dim,
            dtype_bytes=torch.finfo(layout.dtype).bits // 8,
            layer_bytes=tuple(self.weights.layer_device_bytes),
            layer_params=sum(p.numel() for p in self.layers[0].parameters()),
            name=type(causal).__name__,
            dtype=str(layout.dtype).removeprefix("torch."),
        )
        self.checkpoints = _Checkpoints(self.resources.engine, prefetch_layers)
        self._anchor = torch.zeros((), device=self.device, requires_grad=True)
        self._original: list[Callable[..., Any]] = [layer.forward for layer in self.layers]
        # each patched module and the forward its instance had before (False: none of its own)
        self._patched: list[tuple[nn.Module, Any]] = []
        self._hooks: list[Any] = []
        # layers whose HF gradient checkpointing runs directly: their own checkpoint function
        self._hf_checkpointing: dict[int, tuple[nn.Module, Any]] = {}
        self._plan: TrainPlan | None = None
        self._measured: dict[int, int] = {}  # tokens -> the working set measured (CUDA)
        self._step_tokens: int | None = None  # the training step in progress (to measure)
        self._held = 0
        self._recomputed: int | None = None  # the layer being recomputed in its backward
        self.stats_ = FinetuneStats()
        self._install()
        causal.__dict__[_FINETUNED] = weakref.ref(self)
        # HF's Trainer and accelerate move a model to the device unless it says where its parts
        # are: the frozen layer weights live in pinned host memory, the rest on the device.
        causal.hf_device_map = {"model.layers": "cpu", "": str(self.device)}

    # --- setting up ------------------------------------------------------------------------------

    @staticmethod
    def _device_of(model: nn.Module, device: torch.device | str | None) -> torch.device:
        if device is not None:
            found = torch.device(device)
        else:
            trained = [p.device for p in model.parameters() if p.requires_grad]
            on_cuda = [d for d in trained if d.type == "cuda"]
            if on_cuda:
                found = on_cuda[0]
            else:
                found = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if found.type == "cuda" and found.index is None:
            found = torch.device("cuda", torch.cuda.current_device())
        if found.type not in ("cuda", "cpu"):
            raise ValueError(f"reviva.finetune: unsupported device {found}")
        return found

    def _move_the_rest(self) -> None:
        """Everything but the layers' frozen weights to the device (trainable parameters,
        buffers, the parts outside the layers); the frozen ones stay where they are until
        StreamedWeights packs them."""
        in_layers = {id(p) for layer in self.layers for p in layer.parameters()}
        for name, p in self.model.named_parameters():
            if p.device == self.device or (id(p) in in_layers and not p.requires_grad):
                continue
            if p.is_meta:
                raise ValueError(f"reviva.finetune: parameter {name} is on the meta device")
            p.data = p.data.to(self.device)
        for module in self.model.modules():
            for key, buf in module._buffers.items():
                if buf is not None and buf.device != self.device and not buf.is_meta:
                    module._buffers[key] = buf.to(self.device)

    def _install(self) -> None:
        for i, layer in enumerate(self.layers):
            self._patch(layer, self._layer_forward(i))
            for name in _TOKEN_WISE:
                child = getattr(layer, name, None)
                if isinstance(child, nn.Module):
                    unread = name == "mlp" and type(layer).__name__ in _MLP_LAST
                    self._patch(child, self._token_wise(child, i if unread else None))
        self._patch(self.layout.final_norm, self._token_wise(self.layout.final_norm))
        self._patch(self.causal, self._causal_forward(self.causal.forward))
        self._hooks.append(
            self.causal.model.register_forward_pre_hook(self._begin, with_kwargs=True)
        )

    def _patch(self, module: nn.Module, forward: Callable[..., Any]) -> None:
        self._patched.append((module, "forward" in module.__dict__ and module.__dict__["forward"]))
        module.forward = forward

    def close(self) -> None:
        """The model's own forwards again. Its frozen layer weights stay in pinned host memory
        (the parameters view it); the model is for this process's CPU or a new finetune()."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for module, previous in reversed(self._patched):
            if previous is False:
                module.__dict__.pop("forward", None)
            else:
                module.forward = previous
        self._patched.clear()
        for layer, func in self._hf_checkpointing.values():
            if layer.__dict__.get("_gradient_checkpointing_func") is _run_directly:
                if func is None:
                    del layer._gradient_checkpointing_func
                else:
                    layer._gradient_checkpointing_func = func
        self._hf_checkpointing.clear()
        self.causal.__dict__.pop(_FINETUNED, None)
        self.causal.__dict__.pop("hf_device_map", None)

    # --- the forwards ----------------------------------------------------------------------------

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

    def _run_layer(self, i: int, x: torch.Tensor, args: tuple, kwargs: dict[str, Any]) -> Any:
        try:
            with self._weights_of(i):
                return self._original[i](x, *args, **kwargs)
        except torch.OutOfMemoryError as e:
            raise self._out_of_memory(e, f"layer {i}'s forward") from e

    def _layer_forward(self, i: int) -> Callable[..., Any]:
        def forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("past_key_values") is not None and torch.is_grad_enabled():
                raise ValueError(
                    "reviva.finetune: a training forward with a K/V cache (use_cache=True) "
                    "would write each layer's K/V twice (forward and recompute); pass "
                    "use_cache=False"
                )
            layer = self.layers[i]
            trained = any(p.requires_grad for p in layer.parameters())
            if torch.is_grad_enabled() and (trained or hidden_states.requires_grad):
                return _LayerStep.apply(hidden_states, self._anchor, self, i, args, kwargs)
            return self._run_layer(i, hidden_states, args, kwargs)

        return forward

    def _token_wise(self, module: nn.Module, unread_in: int | None = None) -> Callable[..., Any]:
        """The module by chunks of tokens; `unread_in`: the layer in whose recompute its output
        is not read (Note [Outputs nobody reads])."""
        own = module.forward

        def forward(x: Any, *args: Any, **kwargs: Any) -> Any:
            if args or kwargs or not isinstance(x, torch.Tensor):
                return own(x, *args, **kwargs)
            random = module.training and draws_random(module)
            unread = unread_in is not None and self._recomputed == unread_in
            return chunked(own, x, self.chunk_tokens, self._anchor, random, unread)

        return forward

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

        if kwargs.get("past_key_values") is not None:
            raise ValueError(
                "reviva.finetune: labels with past_key_values: a loss over a cached prefix is not "
                "supported (the chunked loss needs the whole sequence's hidden states)"
            )
        num_items = kwargs.pop("num_items_in_batch", None)
        shifted = kwargs.pop("shift_labels", None)
        ignore = kwargs.pop("ignore_index", -100)
        if ignore != -100:
            raise ValueError(f"reviva.finetune: ignore_index={ignore!r}; the loss ignores -100")
        kwargs.pop("logits_to_keep", None)
        kwargs.pop("return_dict", None)
        kwargs["use_cache"] = False
        outputs = causal.model(**kwargs)
        hidden = outputs.last_hidden_state
        try:
            loss = head_loss(
                hidden,
                causal.lm_head,
                labels,
                self.loss_chunk_tokens,
                num_items,
                self.softcap,
                shifted,
            )
        except torch.OutOfMemoryError as e:
            raise self._out_of_memory(e, "the loss") from e
        return CausalLMOutputWithPast(
            loss=loss,
            logits=None,
            past_key_values=None,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )

    # --- the step's plan -------------------------------------------------------------------------

    def _begin(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> Any:
        """The decoder's forward starts: a step begins. The last training step's working set is
        measured (CUDA), this one's planned (which layers' weights stay), and its checkpoints
        start afresh."""
        self._serve_hf_checkpointing()
        ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        shape = ids.shape if isinstance(ids, torch.Tensor) else getattr(embeds, "shape", None)
        if shape is None:
            return None
        tokens = int(shape[0] * shape[1]) if len(shape) >= 2 else int(shape[0])
        self._measure()
        training = torch.is_grad_enabled()
        if training or self._plan is None:
            self._apply_plan(tokens)
        self.checkpoints.begin_step()
        if training:
            self.stats_.steps += 1
            self.stats_.tokens = tokens
            self._step_tokens = tokens
            if kwargs.get("use_cache") is not False:  # (None: the config's, True by default)
                kwargs = dict(kwargs)
                kwargs["use_cache"] = False  # (as HF's gradient checkpointing does)
                return args, kwargs
        return None

    def _serve_hf_checkpointing(self) -> None:
        """HF's gradient checkpointing (TRL's SFTConfig turns it on by default; the Trainer
        enables it at train()) would wrap each layer in torch's checkpoint around Reviva's own:
        a layer recomputed twice with use_reentrant=True. Reviva's checkpointing is what it asks
        for (each layer's input kept, the layer recomputed in backward), so a layer whose
        checkpointing is on runs its forward directly (its _gradient_checkpointing_func, which
        HF sets at each gradient_checkpointing_enable(), is replaced; close() puts it back)."""
        for layer in self.layers:
            if not getattr(layer, "gradient_checkpointing", False):
                continue
            func = layer.__dict__.get("_gradient_checkpointing_func")
            if func is _run_directly:
                continue
            if not self._hf_checkpointing:
                log.info(
                    "reviva.finetune: HF's gradient checkpointing is on; Reviva checkpoints each "
                    "layer itself (its input in pinned host memory), and HF's is not applied on "
                    "top of it"
                )
            self._hf_checkpointing[id(layer)] = (layer, func)
            layer._gradient_checkpointing_func = _run_directly

    def _collect(self) -> None:
        """The training step run since the last begin: its peak of torch's reserved memory
        beside what was held when it began (CUDA), kept as the working set of its length. The
        peak only grows until the next begin, so reading it again is harmless."""
        if self._cuda and self._step_tokens is not None:
            peak = max(torch.cuda.max_memory_reserved(self.device) - self._held, 0)
            self._measured[self._step_tokens] = peak
            self.stats_.working_set_bytes = peak

    def _measure(self) -> None:
        """A step begins: the last one's working set kept (_collect), the peak reset."""
        self._collect()
        self._step_tokens = None
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def _budget_now(self) -> tuple[int, int]:
        """(the budget, the bytes held before the step): the budget capped by what the device
        can give (free, torch's cache, the weights' arena memory and what torch holds)."""
        if self._cuda:
            free, total = torch.cuda.mem_get_info(self.device)
            held = torch.cuda.memory_allocated(self.device)
            cached = torch.cuda.memory_reserved(self.device) - held
            weights = int(self.weights.store.stats()["device_bytes"])
            limit = free + cached + weights + held
            budget = limit if self.budget is None else min(self.budget, limit)
            return budget, held
        held = (
            sum(
                t.numel() * t.element_size()
                for t in (*self.model.parameters(), *self.model.buffers())
                if t.device == self.device
            )
            - self.weights.param_bytes
        )
        budget = self.budget if self.budget is not None else 16 << 30
        return budget, max(held, 0)

    def plan(self, tokens: int) -> TrainPlan:
        """The plan a step of `tokens` tokens would run with now (train_plan.plan_step), with the
        working set measured by the last step of that length where one ran (CUDA)."""
        self._collect()
        budget, held = self._budget_now()
        # (the resident weights live in the arena, outside torch's `held`: the plan places them
        # in the room the budget leaves beside held, the working set and the margin)
        return plan_step(
            self.dims,
            tokens,
            budget,
            held,
            self.chunk_tokens,
            self.loss_chunk_tokens,
            self._measured.get(tokens),
        )

    def _apply_plan(self, tokens: int) -> None:
        plan = self.plan(tokens)
        self._held = plan.held
        before = self._plan
        if before is None or plan.resident_layers != before.resident_layers:
            if self._cuda:
                torch.cuda.empty_cache()  # (the arena maps its own memory: torch's cache gives)
            streams = plan.streamed_layers > 0
            self.weights.set_residency(
                list(plan.resident_layers),
                2 if streams else 0,
                self.prefetch_layers if streams else 0,
            )
            log.info("reviva.finetune: %s", describe(self.dims, plan))
        self._plan = plan
        self.stats_.plan = plan
        self.stats_.resident_layers = len(plan.resident_layers)
        self.stats_.streamed_layers = plan.streamed_layers

    def _out_of_memory(self, e: torch.OutOfMemoryError, where: str) -> FinetuneOutOfMemoryError:
        plan = self._plan
        said = describe(self.dims, plan) if plan is not None else "no plan yet"
        self._measured.clear()  # (the model's estimate again, not a measurement that fell short)
        return FinetuneOutOfMemoryError(
            f"reviva.finetune: out of device memory in {where} ({said}); a smaller budget= keeps "
            f"fewer layers' weights resident, smaller chunk_tokens ({self.chunk_tokens}) or "
            f"loss_chunk_tokens ({self.loss_chunk_tokens}) shrink the working set. torch: "
            f"{str(e).splitlines()[0] if str(e) else ''}"
        )

    # --- figures ---------------------------------------------------------------------------------

    def stats(self) -> FinetuneStats:
        """The figures so far (bytes, seconds; the last step's plan)."""
        st = self.stats_
        w = self.weights.store.stats()
        st.weight_bytes_to_device = int(w["bytes_to_device"])
        st.weight_stall_s = float(w["compute_stall_s"])
        m = self.checkpoints.manager.metrics()
        st.checkpoint_bytes_to_host = int(m["bytes_to_host"])
        st.checkpoint_bytes_to_device = int(m["bytes_to_device"])
        st.checkpoint_stall_s = float(m["compute_stall_s"])
        st.checkpoint_host_wait_s = float(m["host_wait_s"])
        return st

    def describe(self) -> str:
        plan = self._plan
        return describe(self.dims, plan) if plan is not None else "no step yet"


def finetune(
    model: nn.Module,
    budget: int | str | None = None,
    *,
    device: torch.device | str | None = None,
    chunk_tokens: int = 4096,
    loss_chunk_tokens: int | None = None,
    prefetch_layers: int = 1,
) -> Finetune:
    """Sets `model` (a causal LM with the Llama decoder layout, or a PEFT model of one) up for
    fine-tuning with its frozen base weights streamed from pinned host memory, each layer
    checkpointed to pinned host memory, and its token-wise parts and loss run by chunks of
    tokens (Note [Streamed fine-tuning]). Parameters that need gradients stay on the device.

    budget: the device bytes a step may use ("24GB"; None: what the device can give); each
    step keeps resident as many layers' weights as fit beside its working set. device: where
    compute runs (default: where the trainable parameters are, else CUDA if there is one).
    chunk_tokens: the token-wise parts' chunk; loss_chunk_tokens: the loss's (default: 512 MiB
    of fp32 logits). prefetch_layers: how far ahead weights and checkpoints come back.

    Train as usual afterwards (plain PyTorch, HF's Trainer, TRL's SFTTrainer): the model's
    forwards are Reviva's until close()."""
    t = time.perf_counter()
    tuner = Finetune(
        model,
        budget,
        device=device,
        chunk_tokens=chunk_tokens,
        loss_chunk_tokens=loss_chunk_tokens,
        prefetch_layers=prefetch_layers,
    )
    log.info(
        "reviva.finetune: %d layers' frozen weights (%s) in pinned host memory in %.1f s",
        tuner.weights.num_layers,
        format_bytes(tuner.weights.total_bytes),
        time.perf_counter() - t,
    )
    return tuner
