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
  weights/host_embedding.py);
- the frozen weights of the layers the plan keeps resident (train_plan.plan_step); the others
  stream from pinned host memory through two slots (reviva.weights.streamed.StreamedWeights, the
  inference path's WeightStore), in the order a step uses them: forward 0..n-1, then backward
  n-1..0, where a layer's recompute and its gradient read its weights once more (Note
  [Declared orders] in src/weight_store.cpp; the last layer's two uses are adjacent, and so
  are layer 0's backward and the next step's forward: those stream first);
- each layer's input, its checkpoint, on its way to pinned host memory (Note [Checkpoints on
  the host]) and brought back for its layer's backward ahead of use;
- one layer's recompute and backward (_LayerStep, as torch's reentrant checkpoint: the layer
  runs without autograd in forward; its backward runs it again with autograd and
  back-propagates through it at once), whose token-wise parts (its norms and its MLP) run by
  chunks of tokens saving only their inputs (token_chunks.TokenChunked), as the final norm does,
  or (where the plan says so: attention_chunk_tokens) the whole layer by chunks of query
  tokens, holding only its input, K, V and their gradients at full length (Note [Layers by
  chunks of query tokens] in train/chunked_layer.py);
- the loss by chunks of tokens, forward and backward (token_chunks.ChunkedHeadLoss): no
  [tokens, vocab] logits for the loss; the logits HF returns beside it are made after it, or
  not at all with return_logits=False (Note [Logits with labels] in train/forwards.py).
The parameters inside a layer that need gradients get them from the recompute's backward
(accumulated in .grad, as a plain backward does); a tensor that needs a gradient (`_anchor`) is
each _LayerStep's input so that its backward runs where the layer's input needs none (a frozen
input embedding). Random numbers (dropout) are replayed from each layer's and each chunk's saved
generator state, and autocast from the forward's state, so the recompute computes what the
forward did.

The forwards are train/forwards.py's (Note [Outputs nobody reads]), a step's beginning and
plan train/step.py's, the checkpoints train/host_checkpoints.py's (Note [Checkpoints on the host]).
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from reviva.adapters import inspect_model
from reviva.hf_versions import check_transformers
from reviva.placement import Placement
from reviva.resources import device_resources
from reviva.sizes import format_bytes, parse_bytes
from reviva.train.forwards import _MLP_LAST, _TOKEN_WISE, FinetuneForwards
from reviva.train.host_checkpoints import _Checkpoints
from reviva.train.plan import (
    AUTO,
    CHUNKED_MODEL,
    MODEL,
    ChunkSetting,
    FinetuneOutOfMemoryError,
    TrainDims,
    TrainMemoryModel,
    TrainPlan,
    describe,
)
from reviva.train.retry import FinetuneRetry
from reviva.train.step import FinetuneStepPlan, _run_directly
from reviva.weights.host_embedding import HostEmbedding
from reviva.weights.streamed import StreamedWeights

log = logging.getLogger("reviva.finetune")  # (the name users filter on)

_FINETUNED = "_reviva_finetune"  # the CausalLM's __dict__ key: its Finetune, weakly
# The layers of a step whole or by chunks of query tokens (Note [Layers by chunks of query
# tokens] in train/chunked_layer.py; train_plan.plan_layers): "auto" by default, whole layers where
# they fit and by chunks of train_plan.AUTO_CHUNK_TOKENS where they do not (chunks halve a step's
# working set but take longer: benchmarks/README.md)
ATTENTION_CHUNK_TOKENS: ChunkSetting = AUTO


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
    # Note [Out of memory inside a step] (train/retry.py): the work run again after an
    # out-of-memory, and where each was ("layer 5's backward", ...)
    oom_retries: int = 0
    retried_in: list[str] = field(default_factory=list)


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


class Finetune(FinetuneForwards, FinetuneStepPlan, FinetuneRetry):
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
        return_logits: bool = True,
        attention_chunk_tokens: ChunkSetting = ATTENTION_CHUNK_TOKENS,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"reviva.finetune wraps an nn.Module, got {type(model).__name__}")
        if not isinstance(return_logits, bool):
            raise TypeError(f"reviva.finetune: return_logits must be a bool, got {return_logits!r}")
        for name, value, least in (
            ("chunk_tokens", chunk_tokens, 1),
            ("loss_chunk_tokens", loss_chunk_tokens, 1),
            ("prefetch_layers", prefetch_layers, 1),
            ("attention_chunk_tokens", attention_chunk_tokens, 1),
        ):
            if value is None and name in ("loss_chunk_tokens", "attention_chunk_tokens"):
                continue
            if value == AUTO and name == "attention_chunk_tokens":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                also = ", None or 'auto'" if name == "attention_chunk_tokens" else ""
                raise ValueError(
                    f"reviva.finetune: {name} must be an int >= {least}{also}, got {value!r}"
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
        # (Note [Layers by chunks of query tokens] in train/chunked_layer.py; None: HF's layers,
        # whole)
        self.attention_chunk_tokens = attention_chunk_tokens
        self._chunk_refusals: set[str] = set()  # (each reason logged once)
        self._tiling = False  # (a layer runs by chunks of query tokens now)
        vocab = layout.vocab_size
        self.loss_chunk_tokens = loss_chunk_tokens or max(128, (512 << 20) // (4 * vocab))
        self.prefetch_layers = prefetch_layers
        self.return_logits = return_logits  # (Note [Logits with labels] in train/forwards.py)
        # The step's memory models: train_plan.MODEL for HF's layers, CHUNKED_MODEL by chunks of
        # query tokens (_model_for picks; a benchmark fitting the coefficients of another setting
        # sets its own)
        self.memory_model: TrainMemoryModel = MODEL
        self.chunked_memory_model: TrainMemoryModel = CHUNKED_MODEL
        self._chunks_refused = False  # (a layer ran whole: Note [Layers by chunks of query tokens])
        self.softcap = getattr(causal.config, "final_logit_softcapping", None)
        self.resources = device_resources(self.device)
        self._cuda = self.device.type == "cuda"
        # where each of the model's tensors was before anything moved: close() puts it back
        self._placement = Placement(model)
        self._closed = False
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
                embed,
                self.resources.pool,
                self.resources.runtime,
                self.device,
                self._placement.origin(embed.weight),
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
        # (tokens, the plan's attention_chunk_tokens) -> the working set measured (CUDA)
        self._measured: dict[tuple[int, int | None], int] = {}
        # tokens -> the most layers resident after an out-of-memory at that length (Note [Out of
        # memory inside a step] in train/retry.py)
        self._caps: dict[int, int] = {}
        # row lengths whose whole layers ran out of memory with every layer streamed: under
        # "auto", those and longer ones plan chunks (Note [Out of memory inside a step])
        self._whole_failed: set[int] = set()
        self._step_tokens: int | None = None  # the training step in progress (to measure)
        self._held = 0
        self._recomputed: int | None = None  # the layer being recomputed in its backward
        self._stepped: int | None = None  # the layer whose training step's forward runs
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

    def sync(self) -> None:
        """Writes to the frozen weights since the last step reach their host copies (Note [The
        user's streamed parameters] in weights/writes.py; Note [Embedding on the host])."""
        self.weights.sync()
        if self.host_embedding is not None:
            self.host_embedding.sync()

    def close(self) -> None:
        """The model as it was: its own forwards, every parameter and buffer where it was before
        finetune() (the same Parameter objects, with the values they have now: the frozen
        weights' from their pinned host copies, the trained ones as trained; Note [The user's
        streamed parameters] in weights/writes.py). Closing twice does nothing."""
        if self._closed:
            return
        self._closed = True
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
        if self._cuda:  # (the steps' cached blocks: room for the weights coming back)
            torch.cuda.empty_cache()
        self.weights.close()
        if self.host_embedding is not None:
            self.host_embedding.close()
        self._placement.restore()
        if self._cuda:
            torch.cuda.empty_cache()

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
    return_logits: bool = True,
    attention_chunk_tokens: ChunkSetting = ATTENTION_CHUNK_TOKENS,
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
    return_logits: a forward with labels returns the logits beside the loss, as HF does (their
    [tokens, vocab] bytes counted in the plan); False returns the loss alone, and the output's
    `logits` raises naming this option (Note [Logits with labels] in train/forwards.py).
    attention_chunk_tokens: each decoder layer of a training step by chunks of that many query
    tokens (its norms, projections, attention, MLP and residuals), its backward holding only
    its input, K, V and their gradients at full length (Note [Layers by chunks of query tokens]
    in train/chunked_layer.py), where that computes what HF's layer computes (the Llama layout, a
    plain causal mask, no sliding window shorter than the sequence, no attention dropout; else
    HF's, said once in the log); a sequence no longer than a chunk runs them whole. None: HF's
    layers, whole. "auto" (the default): whole layers where they fit the budget (every layer's
    weights streamed if need be), by chunks of 4096 query tokens where only those fit (they
    take longer); the step's plan says which (stats().plan.attention_chunk_tokens).

    Train as usual afterwards (plain PyTorch, HF's Trainer, TRL's SFTTrainer): the model's
    forwards are Reviva's until close()."""
    check_transformers("reviva.finetune")  # Note [Tested transformers]
    t = time.perf_counter()
    tuner = Finetune(
        model,
        budget,
        device=device,
        chunk_tokens=chunk_tokens,
        loss_chunk_tokens=loss_chunk_tokens,
        prefetch_layers=prefetch_layers,
        return_logits=return_logits,
        attention_chunk_tokens=attention_chunk_tokens,
    )
    log.info(
        "reviva.finetune: %d layers' frozen weights (%s) in pinned host memory in %.1f s",
        tuner.weights.num_layers,
        format_bytes(tuner.weights.total_bytes),
        time.perf_counter() - t,
    )
    return tuner
