"""RevivaManager: long-context generation with a HuggingFace causal LM under a device budget.

Prefill runs layer by layer over the whole prompt in token chunks (reviva.llama_layer), writing
each layer's K/V into a RevivaCache: layers that fit stay resident, the others leave for pinned
host memory chunk by chunk while compute goes on. Decode runs HF's own decoder layers (or
Reviva's own attention call on CUDA in half precision); the cache hands each layer its K/V,
streamed ones filled `prefetch_layers` ahead, and appends the new token to the host copy alone.
Everything plugs in through a `Cache` and per-instance `forward` wrappers of the decoder layers
and the final norm, so `model.generate` keeps its logits processors, sampling, stopping criteria
and streamers. The plan of each call comes from reviva.planner, against what the device can give
at that moment; the call gives its device memory back before it returns, whatever happens.

    manager = RevivaManager(model, RevivaConfig(vram_budget="24GB"))
    out = manager.generate(input_ids, max_new_tokens=64)
    manager.get_memory_stats()
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import logging
import os
import threading
import time
import traceback
import weakref
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import Cache

from reviva._C import RevivaOutOfMemoryError
from reviva.adapters import DecoderLayout, base_model_of, inspect_model
from reviva.block_attention import call_kernel, resolve_kernel
from reviva.config import RevivaConfig
from reviva.kv_cache import RevivaCache
from reviva.kv_fp8 import row_bytes as fp8rows_width
from reviva.llama_layer import DecodeGraphs, LlamaLayerPath, take_matmul_workspaces
from reviva.planner import (
    MODEL,
    Plan,
    budget_for,
    device_state,
    host_attention_pays,
    host_decode_mix,
    host_kv_layers,
    host_state,
    make_plan,
    rings_wanted,
    spread,
)
from reviva.resources import device_resources
from reviva.stats import GenerateStats, PhaseStats
from reviva.trace import PrefillProgress, Ranges, chrome_trace, span, store_spans, write_trace
from reviva.weights import (
    DECODE_ROOMS,
    HOST_DECODE_ROOMS,
    HostEmbedding,
    StreamedWeights,
    routed_expert_sizes,
)

log = logging.getLogger(__name__)

_MiB = 1 << 20

_MISSING = object()
# Which manager has wrapped a model's layers: a second one on the same model (in this thread or
# another) is refused rather than left to interleave its wrappers with the first's.
_WRAPPED_BY = "_reviva_wrapped_by"
_WRAP_LOCK = threading.Lock()
# The StreamedWeights holding a model's decoder layers' weights (Note [Streamed weights]): a
# second manager would pack the host views of the first into a copy of its own.
_WEIGHTS_OF = "_reviva_streamed_weights"


_PIN_MODES = ("background", "before_compute")


def _pin_mode() -> str:
    """Where a call pins its host copies (RevivaManager._pin_host_copies)."""
    mode = os.environ.get("REVIVA_PIN_HOST_COPIES", "background")
    if mode not in _PIN_MODES:
        raise ValueError(f"REVIVA_PIN_HOST_COPIES must be one of {_PIN_MODES}, got {mode!r}")
    return mode


# The helper thread pins the rest of a call's host copies when the host issues this layer's
# prefill (RevivaManager._pin_host_copies).
_PIN_AFTER_LAYER = 2


class CallOutOfMemoryError(RevivaOutOfMemoryError, torch.OutOfMemoryError):
    """The device ran out of memory inside a call whose plan fitted (Note [Out of memory
    beyond the plan]): a RevivaOutOfMemoryError and a torch.OutOfMemoryError at once, so code
    catching either (HF's and accelerate's retries catch torch's) still catches it; its message
    ends with torch's."""


# Note [Out of memory beyond the plan]
# A call starts only when its plan fits the budget (planner.py); what the plan cannot see is the
# working set's estimate missing a model's real peak (HF's experts forward was one: Note [The
# experts' working set]) or other memory taken on the device during the call. torch then
# raises its OutOfMemoryError from deep inside a layer, where the user cannot tell that Reviva
# planned the call or what to change. generate re-raises it, after the call's own clean-up, as a
# CallOutOfMemoryError naming where it happened (prefill's layer and chunk size, or the decode
# step) and what the plan held, with the two settings that leave room: smaller prefill chunks
# (RevivaConfig(chunk_tokens=...)) and a smaller vram_budget (free memory outside Reviva's).
# Nothing is retried: a silent retry would hide a wrong estimate. The finished frames of torch's
# exception are cleared first (their lines stay in the traceback): their locals held tensors of
# the call (in Reviva's arena too) for as long as the caller held the exception, so memory the
# call gave back stayed mapped inside a user's `except` block, where a retry would run.


def _beyond_the_plan(error: torch.OutOfMemoryError, plan: Plan, phase: dict[str, Any]) -> str:
    """CallOutOfMemoryError's message for `error`, raised in the call `plan` planned."""
    if "prefill_end" not in phase:
        layers = len(phase.get("layer_events", ()))
        at = f"layer {layers - 1} of {plan.num_layers}" if layers else "before its first layer"
        where = f"in prefill ({at}, chunks of {plan.chunk_tokens} tokens)"
    else:
        where = f"in decode step {phase.get('decode_steps', 0)}"
    return (
        f"RevivaManager.generate ran out of device memory {where}, beyond its plan: budget "
        f"{plan.budget / 1e9:.2f} GB, {len(plan.resident_layers)} of {plan.num_layers} layers' "
        f"K/V resident, an estimated working set of {plan.working_set / 1e9:.2f} GB. Leave more "
        f"room: RevivaConfig(chunk_tokens={max(plan.chunk_tokens // 2, 1)}) (smaller prefill "
        "chunks) or a smaller vram_budget (more of the device left outside Reviva's plan). "
        f"torch: {error}"
    )


class RevivaManager:
    """Wraps a HF causal LM (Llama layout) to generate under a device memory budget."""

    def __init__(
        self,
        model: nn.Module,
        config: RevivaConfig | None = None,
        fill_layer: Callable[[int, nn.Module], None] | None = None,
    ) -> None:
        """fill_layer(i, layer): for a model whose decoder layers are on the meta device (built
        without memory), writes layer i's parameter values once they have their place in pinned
        host memory (RevivaConfig.stream_weights; reviva.weights)."""
        if config is None:
            config = RevivaConfig()
        if not isinstance(config, RevivaConfig):
            raise TypeError(f"config must be a RevivaConfig, got {type(config).__name__}")
        if not config.pin_memory:
            raise ValueError(
                "RevivaConfig(pin_memory=False): RevivaManager streams K/V through pinned host "
                "memory only (pageable copies are synchronous and ~3x slower); use pin_memory=True"
            )
        self.config = config
        if type(model).__name__ == "OptimizedModule":
            # torch.compile's wrapper has no generate: the model it wraps runs, its decoder
            # layers through Reviva's own calls (the compiled forward is not what runs them)
            log.info("reviva: a torch.compile'd model: the module it wraps is wrapped")
            model = base_model_of(model)
        # (a PEFT model stays the one the with-block patches; its base model runs: the layout's)
        self.model = model
        layout = inspect_model(model)
        device = torch.device(config.device) if config.device is not None else layout.device
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device.type not in ("cuda", "cpu"):
            raise ValueError(f"RevivaManager: model on unsupported device {device}")
        self.layout: DecoderLayout = dataclasses.replace(layout, device=device)
        self.resources = device_resources(device)
        self.runtime = self.resources.runtime
        self.pool = self.resources.pool
        self.engine = self.resources.engine
        self.arena = self.resources.arena
        # Note [Streamed weights] (reviva/weights.py): the decoder layers' weights in pinned host
        # memory, streamed to the device by each call's plan; None: they stay where they are.
        self.weights: StreamedWeights | None = self._take_weights(config, fill_layer)
        # Note [Embedding on the host] (reviva/weights.py): with streamed weights, an untied
        # input embedding's table in pinned host memory.
        self.host_embedding: HostEmbedding | None = None
        embed = self.layout.embed_tokens
        if (
            self.weights is not None
            and type(embed) is nn.Embedding  # (Gemma's scaled embedding stays on the device)
            and embed.max_norm is None
            and embed.weight is not getattr(model.get_output_embeddings(), "weight", None)
        ):
            # (a manager before this one may have moved the table already: its forward says so)
            earlier = getattr(embed.__dict__.get("forward"), "__self__", None)
            if isinstance(earlier, HostEmbedding):
                self.host_embedding = earlier
            else:
                self.host_embedding = HostEmbedding(embed, self.pool, self.runtime, device)
        self.layers = LlamaLayerPath(self.layout)
        # Note [Prefill attention kernel] (block_attention.py): "flash", "cudnn" or "reference"
        # for the device; each call's (call_kernel) in _call_kernel.
        self._device_kernel = resolve_kernel(config.attention_kernel, device)
        self._call_kernel = self._device_kernel
        self._saved_forwards: dict[int, tuple[nn.Module, Any]] = {}
        # Note [generate inside the with-block]: the model's own generate while entered, and
        # whether the manager's call is running it (then it is HF's, with the manager's cache)
        self._saved_generate: Any = _MISSING
        self._in_own_call = False
        self._entered = 0
        self._owner: int | None = None  # the thread inside `with manager:`
        self._generate_lock = threading.Lock()
        self._cache: RevivaCache | None = None
        self._plan: Plan | None = None
        self._phase: dict[str, Any] = {}
        self._last_stats: GenerateStats | None = None
        # Note [Traces] (trace.py): each call's store keeps up to this many copy and stall
        # events, left in _last_timeline (ms since the store was built; diag_phases.py reads
        # them), and the call's trace for trace(path).
        self._timeline_capacity = 1 << 16
        self._last_timeline: list[dict[str, Any]] = []
        self._last_trace: dict[str, Any] | None = None
        self._ranges = Ranges()
        self._progress: PrefillProgress | None = None
        # Note [Residual stream on the host] (llama_layer.py): the prompt's hidden states on the
        # host for this call's prefill, the placeholder the model's forward passes around instead,
        # the prompt's positions, and the rotary module's own forward (each chunk's cos and sin).
        self._residual: torch.Tensor | None = None
        self._placeholder: torch.Tensor | None = None
        self._positions: torch.Tensor | None = None
        self._rotary_forward: Any = None
        self._rotary_by_type = False  # its forward takes a layer_type
        # Layers return new tensors instead of updating the hidden states in place, when HF
        # records each layer's output (output_hidden_states): else every entry aliases one.
        self._copy_hidden = False
        # Note [Shared prompt K/V] (kv_cache.py): this call's rows per prompt whose prompt K/V
        # is held once (1: every row its own).
        self._share = 1
        # Note [A returned cache] (kv_cache.py): the tokens this call's cache took from the cache
        # it continues from (its prefill starts after them); 0 for a call from an empty cache.
        self._prefix = 0
        # Decode with Reviva's own attention call where a fused kernel reads the cache's layout
        # in place (CUDA, half precision); elsewhere HF's layers run unchanged (exact numbers).
        self._own_decode = device.type == "cuda" and self.layout.dtype in (
            torch.float16,
            torch.bfloat16,
        )
        # Note [Decode graphs] (llama_layer.py): the own decode path's compute as CUDA graphs.
        use_graphs = self._own_decode and config.cuda_graphs
        self._graphs = DecodeGraphs(self.layers) if use_graphs else None
        if self._graphs is not None:
            self._graphs.before_capture = self._weights_ready
            # (cuBLAS's workspaces of the compute and capture streams taken now, before any
            # plan: the first call plans with the room the later ones have)
            take_matmul_workspaces(device, self.layout.dtype)

    def _weights_ready(self, i: int) -> None:
        """Torch's current stream waits for layer i's resident weights to land (a decode graph's
        capture reads them: captures run ahead of prefill's later layers, and a resident layer
        is filled behind the call's first streamed layers: Note [Streamed weights] in
        src/weight_store.cpp)."""
        weights = self.weights
        if weights is not None and weights.resident(i):
            weights.acquire(i)
            weights.release(i)

    def _take_weights(
        self, config: RevivaConfig, fill_layer: Callable[[int, nn.Module], None] | None
    ) -> StreamedWeights | None:
        """Moves the decoder layers' weights into pinned host memory when config.stream_weights
        asks for it (or, "auto", when they are not on the compute device or the model's weights
        on it exceed the budget), and the rest of the model to the compute device."""
        lay = self.layout
        device = lay.device
        layer_params = [p for layer in lay.layers for p in layer.parameters()]
        elsewhere = [p for p in layer_params if p.device != device]
        mode = config.stream_weights
        if mode == "auto":
            stream = bool(elsewhere)
            if not stream and device.type == "cuda":
                total = torch.cuda.get_device_properties(device).total_memory
                held = sum(p.numel() * p.element_size() for p in lay.model.parameters())
                stream = held > config.budget_bytes(total)
        else:
            stream = bool(mode)
        if not stream:
            if elsewhere:
                raise ValueError(
                    f"RevivaManager: the decoder layers' weights are on {elsewhere[0].device} and "
                    f"compute runs on {device}, with RevivaConfig(stream_weights=False): move the "
                    "model to the device, or let its weights stream (stream_weights='auto')"
                )
            if fill_layer is not None:
                raise ValueError(
                    "RevivaManager: fill_layer is for decoder layers on the meta device, whose "
                    "weights stream; this model's do not"
                )
            return None
        model = lay.model
        holder = model.__dict__.get(_WEIGHTS_OF)
        if holder is not None and holder() is not None:
            raise ValueError(
                "RevivaManager: this model's decoder layers' weights already live in another "
                "RevivaManager's pinned host memory (stream_weights); use that manager, one per "
                "model"
            )
        ids = {id(p) for p in layer_params}
        for name, p in model.named_parameters():
            if id(p) in ids or p.device == device:
                continue
            if p.is_meta:
                raise ValueError(
                    f"RevivaManager: parameter {name} is on the meta device; only the decoder "
                    "layers' parameters are filled (fill_layer): load the rest before wrapping"
                )
            p.data = p.data.to(device)
        for module in model.modules():  # (the layers' buffers too: they are small)
            for key, buf in module._buffers.items():
                if buf is not None and buf.device != device and not buf.is_meta:
                    module._buffers[key] = buf.to(device)
        t = time.perf_counter()
        weights = StreamedWeights(
            lay.layers, self.engine, self.arena, device, fill_layer, timeline_capacity=1 << 16
        )
        model.__dict__[_WEIGHTS_OF] = weakref.ref(weights)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the layers' device memory, if they were there
        log.info(
            "reviva: %d decoder layers' weights (%.1f GB) in pinned host memory in %.1f s",
            weights.num_layers,
            weights.total_bytes / 1e9,
            time.perf_counter() - t,
        )
        return weights

    def _streamed_param_bytes(self) -> int:
        """Bytes of parameters that do not live on the device as such: the streamed layers' (in
        their WeightStore) and a host embedding's table (Note [Embedding on the host])."""
        if self.weights is None:
            return 0
        table = self.host_embedding.nbytes if self.host_embedding is not None else 0
        return self.weights.param_bytes + table

    # --- enabling and restoring ------------------------------------------------------------------

    def __enter__(self) -> RevivaManager:
        me = threading.get_ident()
        if self._entered and self._owner != me:
            raise RuntimeError(
                "RevivaManager: already entered in another thread; use one manager per thread "
                "(generate on one manager from several threads is serialized)"
            )
        if self._entered == 0:
            self._install()
            self._owner = me
        self._entered += 1
        return self

    def __exit__(self, *exc: object) -> None:
        self._entered -= 1
        if self._entered == 0:
            self._owner = None
            self._restore()

    def _install(self) -> None:
        model = self.layout.model
        with _WRAP_LOCK:
            holder = model.__dict__.get(_WRAPPED_BY)
            if holder is not None and holder() is not None and holder() is not self:
                raise RuntimeError(
                    "RevivaManager: this model's layers are wrapped by another RevivaManager "
                    "right now (two managers on one model would interleave their wrappers); "
                    "use one manager per model"
                )
            model.__dict__[_WRAPPED_BY] = weakref.ref(self)
        if self.weights is not None:
            self.weights.in_call = True
        self._saved_generate = model.__dict__.get("generate", _MISSING)
        model.generate = self._routed_generate
        try:
            for i, layer in enumerate(self.layout.layers):
                self._wrap(layer, self._make_layer_forward(i, layer))
            self._wrap(self.layout.final_norm, self._make_norm_forward(self.layout.final_norm))
            if self.layout.embed_tokens is not None and self.layout.rotary_emb is not None:
                self._wrap(
                    self.layout.embed_tokens, self._make_embed_forward(self.layout.embed_tokens)
                )
                self._rotary_forward = self.layout.rotary_emb.forward
                # (Gemma 3: a rotary base per layer type, HF passing each layer its own)
                self._rotary_by_type = (
                    "layer_type" in inspect.signature(self._rotary_forward).parameters
                )
                self._wrap(self.layout.rotary_emb, self._make_rotary_forward())
        except BaseException:
            self._restore()
            raise

    def _wrap(self, module: nn.Module, forward: Any) -> None:
        # An instance attribute shadows the class's forward; restoring puts back exactly what
        # was there (an instance forward of someone else's hooks, or nothing).
        self._saved_forwards[id(module)] = (module, module.__dict__.get("forward", _MISSING))
        module.forward = forward

    def _restore(self) -> None:
        if self.weights is not None:
            self.weights.in_call = False
        model = self.layout.model
        if self._saved_generate is _MISSING:
            model.__dict__.pop("generate", None)
        else:
            model.generate = self._saved_generate
        self._saved_generate = _MISSING
        for module, saved in self._saved_forwards.values():
            if saved is _MISSING:
                module.__dict__.pop("forward", None)
            else:
                module.forward = saved
        self._saved_forwards.clear()
        with _WRAP_LOCK:
            holder = self.layout.model.__dict__.get(_WRAPPED_BY)
            if holder is not None and holder() in (self, None):
                del self.layout.model.__dict__[_WRAPPED_BY]

    # Note [generate inside the with-block]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # `with manager: model.generate(...)` is how HF users write it. While the manager is entered,
    # the model's generate is an instance attribute routing the call to manager.generate (the same
    # path, plan, cache and stats as calling the manager); the manager's own call runs the model's
    # generate underneath (_in_own_call). Leaving the block puts back exactly what was there.
    def _routed_generate(self, *args: Any, **kwargs: Any) -> Any:
        model = self.layout.model
        original = self._saved_generate
        if original is _MISSING:
            original = type(model).generate.__get__(model)
        if self._in_own_call:
            return original(*args, **kwargs)
        bound = inspect.signature(original).bind(*args, **kwargs)
        call = dict(bound.arguments)
        extra = call.pop("kwargs", {})  # (HF's generate takes the rest as **kwargs)
        inputs = call.pop("inputs", None)
        return self.generate(inputs, **{k: v for k, v in call.items() if v is not None}, **extra)

    # --- the wrappers ----------------------------------------------------------------------------

    def _make_layer_forward(self, i: int, layer: nn.Module) -> Any:
        original = layer.forward

        def forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            weights = self.weights
            if weights is None:
                return run(hidden_states, *args, **kwargs)
            # (Note [Streamed weights]: its parameters on the device; a decode step's layer
            # takes them one block at a time, Note [Layers in parts])
            cache = kwargs.get("past_key_values")
            prompt = hidden_states is self._placeholder or (
                hidden_states.shape[1] > 1
                and (cache is None or cache.get_seq_length(i) == self._prefix)
            )
            if i == 0 and not prompt and cache is self._cache and cache is not None:
                self._prefill_over()  # (before the first decode layer takes its weights)
            weights.acquire(i, whole=prompt)
            try:
                return run(hidden_states, *args, **kwargs)
            finally:
                weights.release(i)

        def run(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            cache = kwargs.get("past_key_values")
            if cache is not self._cache or cache is None:
                return original(hidden_states, *args, **kwargs)
            if hidden_states is self._placeholder and self._residual is not None:
                # (No padding here, _check_host_residual: a mask HF passes is the causal one,
                # which the chunks' attention applies itself.)
                self._prefill_layer_starts(i, kwargs, hidden_states)
                rotary = self._rotary_forward
                kind = getattr(layer.self_attn, "layer_type", None)
                if kind is not None and self._rotary_by_type:
                    rotary = functools.partial(rotary, layer_type=kind)
                self.layers.prefill_from_host(
                    cache, self._plan, i, layer, self._residual, self._positions, rotary
                )
                return hidden_states
            if self._copy_hidden:
                hidden_states = hidden_states.clone()
            if hidden_states.shape[1] > 1 and cache.get_seq_length(i) == self._prefix:
                if self._share > 1:  # Note [Shared prompt K/V]: one row per prompt
                    hidden_states, kwargs = self._prompt_rows(hidden_states, kwargs)
                self._prefill_layer_starts(i, kwargs, hidden_states)
                # (after a returned cache's tokens: Note [A returned cache] in kv_cache.py)
                return self.layers.prefill(
                    cache,
                    self._plan,
                    i,
                    layer,
                    hidden_states,
                    kwargs,
                    self._prefix,
                    self._phase.get("padded", False),
                )
            if i == 0:
                self._mark_decode_step()
            # (without padding, a mask HF passes is the causal one, which the own path applies
            # itself: several candidate tokens verified at once in assisted decoding)
            if (
                (
                    self._own_decode
                    or cache.fp8
                    or cache.page_tokens > 0
                    or cache.share > 1
                    or cache.host_attended(i)
                )
                and (kwargs.get("attention_mask") is None or not self._phase.get("padded", True))
                and "position_embeddings" in kwargs
            ):
                if i == 0:
                    self._phase["own_decode_steps"] = self._phase.get("own_decode_steps", 0) + 1
                # (a shared prompt is attended in two parts: Note [Shared prompt K/V])
                graphs = None if self._copy_hidden or cache.share > 1 else self._graphs
                return self.layers.decode(cache, i, layer, hidden_states, kwargs, graphs)
            cache.acquire(i)
            try:
                return original(hidden_states, *args, **kwargs)
            finally:
                cache.release(i)

        return forward

    def _prompt_rows(
        self, hidden_states: torch.Tensor, kwargs: dict[str, Any]
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """Note [Shared prompt K/V]: a prefill's input and its per-row arguments, every
        `share`-th row (one per prompt: HF repeated each prompt's row), when they have every row."""
        s, rows = self._share, self._cache.batch if self._cache is not None else 0

        def one_per_prompt(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == rows:
                return x[::s]
            return x

        if hidden_states.shape[0] == rows:
            hidden_states = hidden_states[::s].contiguous()
        kwargs = dict(kwargs)
        for key in ("attention_mask", "position_ids", "cache_position"):
            if key in kwargs:
                kwargs[key] = one_per_prompt(kwargs[key])
        if "position_embeddings" in kwargs:
            kwargs["position_embeddings"] = tuple(
                one_per_prompt(x) for x in kwargs["position_embeddings"]
            )
        return hidden_states, kwargs

    def _make_embed_forward(self, embed: nn.Module) -> Any:
        original = embed.forward

        def forward(input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            plan, cache = self._plan, self._cache
            if (
                self._share > 1
                and cache is not None
                and input_ids.dim() == 2
                and input_ids.shape[0] == cache.batch
                and input_ids.shape[1] > 1
                and cache.get_seq_length(0) == 0
            ):
                # Note [Shared prompt K/V]: the prompt's rows are repeats; embed one per prompt
                return original(input_ids[:: self._share], *args, **kwargs)
            if (
                cache is None
                or plan is None
                or not plan.residual_on_host
                or self._placeholder is not None
                or input_ids.dim() != 2
                or input_ids.shape[1] != plan.prompt_tokens
                or cache.get_seq_length(0) != 0
            ):
                return original(input_ids, *args, **kwargs)
            # The prompt's embeddings go to the host by chunks; the model's forward passes a
            # placeholder of their shape that holds no memory (Note [Residual stream on the host]).
            batch, tokens = input_ids.shape
            residual = None
            for s in range(0, tokens, plan.chunk_tokens):
                e = min(tokens, s + plan.chunk_tokens)
                x = original(input_ids[:, s:e], *args, **kwargs)
                if residual is None:
                    residual = self.pool.tensor([tokens, batch, x.shape[2]], x.dtype)
                    # held by the manager at once: if this call raises with copies in flight,
                    # generate's cleanup waits for them before the block goes back to the pool
                    self._residual = residual
                residual[s:e].copy_(x.transpose(0, 1), non_blocking=True)
            self._placeholder = torch.zeros((), dtype=x.dtype, device=x.device).expand(
                batch, tokens, x.shape[2]
            )
            return self._placeholder

        return forward

    def _make_rotary_forward(self) -> Any:
        original = self._rotary_forward

        def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if x is not self._placeholder or self._residual is None:
                return original(x, *args, **kwargs)
            positions = kwargs.pop("position_ids", None)
            if positions is None:
                positions, *args = args
            self._positions = positions
            # Each chunk's cos and sin are computed when it runs: broadcast placeholders here.
            cos, sin = original(x[:, :1], positions[:, :1], *args, **kwargs)
            shape = (cos.shape[0], x.shape[1], cos.shape[2])
            return cos.expand(shape), sin.expand(shape)

        return forward

    def _make_norm_forward(self, norm: nn.Module) -> Any:
        original = norm.forward

        def forward(hidden_states: torch.Tensor) -> torch.Tensor:
            plan = self._plan
            cache = self._cache
            if hidden_states is self._placeholder and self._residual is not None:
                # The last token's row alone (generate asks for its logits only), broadcast to
                # the prompt's shape (Note [Residual stream on the host]).
                last = self._residual[-1:].to(self.layout.device).transpose(0, 1)
                out = original(last.contiguous())
                return out.expand(hidden_states.shape[0], hidden_states.shape[1], out.shape[2])
            if hidden_states.shape[1] > 1 and "layers_end" not in self._phase:
                self._phase["layers_end"] = self._event()  # every layer of prefill issued
            if (
                self._share > 1
                and cache is not None
                and hidden_states.dim() == 3
                and hidden_states.shape[1] > 1
                and hidden_states.shape[0] * self._share == cache.batch
            ):
                # Note [Shared prompt K/V]: prefill ran one row per prompt; the head reads the
                # last token's row alone (logits_to_keep=1, checked), one per sequence, broadcast
                # to the prompt's shape
                out = original(hidden_states[:, -1:]).repeat_interleave(self._share, dim=0)
                return out.expand(cache.batch, hidden_states.shape[1], out.shape[2])
            if self._graphs is not None and cache is not None and plan is not None:
                left = plan.capacity - cache.get_seq_length(0)  # decode steps still to come
                if hidden_states.shape[1] > 1:
                    # Every layer of prefill is issued and the device works through the last
                    # ones: the decode graphs not yet captured are captured now (Note [Decode
                    # graphs]).
                    self._capture_ahead(hidden_states, busy=False)
                    self._phase.pop("rope_like", None)
                elif left >= 4:
                    # Every layer of this decode step is issued: the device works through the
                    # step while the host captures layers that are still eager.
                    self._graphs.capture_pending(hidden_states, left)
            if (
                self._cache is None
                or plan is None
                or hidden_states.dim() != 3
                or hidden_states.shape[1] <= plan.chunk_tokens
                or torch.is_grad_enabled()
            ):
                return original(hidden_states)
            # Token-chunked and in place: the full-width fp32 temporaries of RMSNorm over a long
            # prompt would be the largest tensors of the whole prefill.
            c = plan.chunk_tokens
            for s in range(0, hidden_states.shape[1], c):
                hidden_states[:, s : s + c] = original(hidden_states[:, s : s + c])
            return hidden_states

        return forward

    def _prefill_layer_starts(
        self, i: int, kwargs: dict[str, Any], hidden_states: torch.Tensor
    ) -> None:
        """Layer i's prefill is about to be issued: the phase events of the call's first layers
        (stats: prefill_before_first_layer_s, prefill_first_layer_s; each layer's for the
        trace), the rotary shapes for the decode graphs, the helper thread's go
        (RevivaManager._pin_host_copies), and from the middle layer on the decode graphs'
        captures while the device is busy."""
        start = self._event()
        self._phase.setdefault("layer_events", []).append(start)
        self._ranges.swap("reviva.prefill.layer")
        if self._progress is not None:
            self._progress.layer(i)
        if i == 0:
            self._phase["layer0_start"] = start
            if "t_setup" in self._phase:
                t = time.perf_counter() - self._phase["t_setup"]
                self._phase["setup_host_ms"]["first_layer"] = t * 1e3
            self._note_rope(kwargs)
        elif i == 1:
            self._phase["layer1_start"] = start
        if i == _PIN_AFTER_LAYER and "pin_go" in self._phase:
            self._phase["pin_go"].set()
        if i >= max(_PIN_AFTER_LAYER + 1, len(self.layout.layers) // 2):
            thread = self._phase.get("pin_thread")
            if thread is None or not thread.is_alive():  # (registration holds up the host)
                self._capture_ahead(hidden_states, busy=True)

    def _capture_ahead(self, hidden_states: torch.Tensor, busy: bool) -> None:
        """Captures the decode graphs of layers that have none yet, before decode (Note [Decode
        graphs]), when this call's decode runs them and at least 8 steps are to come:
        hidden_states is prefill's ([batch, tokens, hidden]). busy: prefill's later layers are
        being issued, and the host captures only while the device works through what is
        queued (an event recorded now); else (the end of prefill) every such layer."""
        rope = self._phase.get("rope_like")
        cache, plan = self._cache, self._plan
        if self._graphs is None or rope is None or cache is None or plan is None:
            return
        if plan.capacity - cache.get_seq_length(0) < 8:  # decode steps still to come
            return
        h = self._phase.get("graph_h")
        if h is None:
            h = torch.zeros(
                (hidden_states.shape[0], 1, hidden_states.shape[2]),
                dtype=hidden_states.dtype,
                device=hidden_states.device,
            )
            self._phase["graph_h"] = h
        event = None
        if busy:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(h.device))
        self._graphs.capture_ahead(self.layout.layers, h, *rope, busy=event)

    def _note_rope(self, kwargs: dict[str, Any]) -> None:
        """Prefill's first layer: one position of its cos and sin (shape and dtype of a decode
        step's) for the decode graphs captured at the end of prefill, if the call's decode runs
        them (Reviva's own decode path, no padding mask, no per-layer hidden states kept)."""
        pe = kwargs.get("position_embeddings")
        if (
            self._graphs is None
            or pe is None
            or self._copy_hidden
            or self._phase.get("padded", True)
            or not (
                self._own_decode
                or (self._cache is not None and (self._cache.fp8 or self._cache.page_tokens > 0))
            )
        ):
            return
        self._phase["rope_like"] = tuple(t[:, :1].clone() for t in pe)

    def _promote_after_prefill(self) -> None:
        """Prefill's working set is gone: slots beyond the plan's decode_slots are given up and
        streamed layers that now fit become resident (Plan.promotable_layers). On CUDA each
        promotion also needs the memory to be on the device now, beside decode's working set:
        torch's cached prefill blocks go back to the device first, and a layer the device cannot
        take (another part of the process holds the memory) stays streamed; the stats count it."""
        plan, cache = self._plan, self._cache
        if plan is None or cache is None or plan.streamed_layers == 0:
            return
        # (layers attended on the host need no slot: their room goes to promotions too, and
        # the last slot goes once they are on the host, _attend_on_host_after_prefill)
        # (Note [The host beside the copies]: the layers fetched keep their slots)
        host = self._phase.get("host_attention", False) and not self._phase.get(
            "host_beside_copies"
        )
        # (Note [Weights first when the host attends]: the weights promoted took room first, in
        # whole layers' K/V)
        taken = -(-self._phase.get("weight_promoted_bytes", 0) // plan.layer_kv_bytes)
        full_count, ring_count = plan.promotable_split(host, taken * plan.layer_kv_bytes)
        count = full_count + ring_count
        if count <= 0:
            return
        for _ in range(plan.slots - (min(plan.decode_slots, 1) if host else plan.decode_slots)):
            cache.drop_slot()
        cuda = self.layout.device.type == "cuda"
        if cuda:
            torch.cuda.empty_cache()  # prefill's cached working set: the device's again
        streamed = list(plan.streamed_layer_ids)
        # Note [Fetch tails]: a sliding layer streamed moves its window a step, a full one all
        # its tokens: full layers are promoted first. Rings (Note [Window rings] in
        # kv_cache.py) take the room left, by their own bytes.
        rings = [i for i in streamed if i in plan.ring_layers]
        full = [i for i in streamed if i not in cache.fetch_windows and i not in rings]
        windowed = [i for i in streamed if i in cache.fetch_windows]
        if host and self.weights is not None:
            # Note [Weights first when the host attends]: a layer whose weights stay has no copy
            # to hide its host attention under: its K/V comes first
            stay = [i for i in streamed if self.weights.resident(i)]
            rest = [i for i in streamed if i not in stay]
            picks = stay[: int(count)]
            more = int(count) - len(picks)
            picks += [rest[k] for k in spread(min(more, len(rest)), len(rest))]
        else:
            picks = [full[k] for k in spread(min(full_count, len(full)), len(full))]
            picks += [windowed[k] for k in spread(full_count - len(picks), len(windowed))]
            picks += [rings[k] for k in spread(ring_count, len(rings))]
        promoted = refused = 0
        first_refusal: dict | None = None
        for layer in picks:
            if cuda:
                # (the arena's retiring memory, given back and waiting for its streams, is the
                # arena's to map again: freed weight slots and dropped K/V slots are there)
                free = torch.cuda.mem_get_info(self.layout.device)[0]
                free += int(self.arena.stats()["retiring_bytes"])
                if free < plan.kv_bytes(layer) + plan.decode_working_set:
                    refused += 1
                    first_refusal = first_refusal or self._refusal_state("device", free, promoted)
                    continue
            if cache.promote(layer):
                promoted += 1
            else:
                refused += 1
                first_refusal = first_refusal or self._refusal_state("store", None, promoted)
        self._phase["promotions_refused_by_device"] = refused
        self._phase["first_promotion_refusal"] = first_refusal
        log.info("reviva: %d of %d planned promotions after prefill", promoted, count)

    # Note [Weights first when the host attends]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # Without attention on the host, the room prefill's working set leaves goes to K/V
    # promotions: a layer's K/V kept on the device saves its bytes at every step, as a layer's
    # weights do. With it, a streamed layer's K/V costs the step no copy but host time. In a layer
    # whose weights stream, that time runs while the next blocks' copies go on (the layer takes
    # the longer of its copy and its host attention); in a layer whose weights stay, nothing
    # hides it. So K/V kept goes to weight-resident layers first, and weights are promoted as
    # long as the step gets shorter: w layers promoted save w copies and may leave weight-
    # resident layers with their K/V on the host (planner.host_decode_mix, with MemoryModel's
    # rates measured on the H200; the forecast uses the same split). At ace9acc, promoting
    # weights until the host time matched the copies (the host attending 30 of 32 layers, 12 of
    # them with resident weights) ran at 3.6-3.95 tok/s against 4.04 on the device: host time in
    # weight-resident layers is not hidden.
    def _promote_weights_for_host_decode(self) -> None:
        plan, cache, weights = self._plan, self._cache, self.weights
        if plan is None or cache is None or weights is None:
            return
        if not self._phase.get("host_attention", False):
            return
        streamed = [i for i in range(plan.weight_layers) if not weights.resident(i)]
        best = host_decode_mix(plan, MODEL).weights_promoted
        self._phase["weights_promoted_for_host"] = 0
        if best <= 0 or not streamed:
            return
        wb = plan.weight_layer_bytes
        if self.layout.device.type == "cuda":
            torch.cuda.empty_cache()  # prefill's cached working set: the device's again
            free = torch.cuda.mem_get_info(self.layout.device)[0]
            free += int(self.arena.stats()["retiring_bytes"])
            best = min(best, max(free - plan.decode_working_set, 0) // wb)
        picks = [streamed[k] for k in spread(int(best), len(streamed))]
        if picks and weights.promote(picks):
            self._phase["weights_promoted_for_host"] = len(picks)
            self._phase["weight_promoted_bytes"] = len(picks) * wb
        log.info("reviva: %d weight layers promoted for decode with attention on the host", best)

    def _attend_on_host_after_prefill(self) -> None:
        """Note [Attention on the host] (src/host_attention.cpp): with the call's decode
        attention on the host, every layer whose K/V still streams after the promotions stays in
        its pinned host copy from here on (never fetched again), and the store's slots go."""
        cache = self._cache
        if cache is None or not self._phase.get("host_attention", False):
            return
        beside = self._phase.get("host_beside_copies")
        if beside:  # Note [The host beside the copies] (planner.py): some, between the fetched
            streamed = [i for i in range(len(cache.layers)) if not cache.store.resident(i)]
            for k in spread(min(beside, len(streamed)), len(streamed)):
                cache.attend_on_host(streamed[k])
            return
        for i in range(len(cache.layers)):
            if not cache.store.resident(i):
                cache.attend_on_host(i)
        while cache.drop_slot():
            pass

    @staticmethod
    def _inferred_mask(model: nn.Module, gen: Any, ids: torch.Tensor) -> torch.Tensor | None:
        """The attention mask HF's generate infers for token ids given without one
        (GenerationMixin._prepare_special_tokens and _prepare_attention_mask_for_generation):
        where the pad id occurs in them and is no eos id, 0 at the pad ids; None where it masks
        nothing. The calls decide "padded" from it as from a mask given (a pad id in a prompt, or
        generated in an earlier chat turn, is masked as plain HF masks it)."""
        config = copy.deepcopy(gen)
        model._prepare_special_tokens(config, False, ids.device, ids.shape[0])
        mask = model._prepare_attention_mask_for_generation(ids, config, {})
        return None if bool(mask.all()) else mask

    def _new_tokens(self, gen: Any, kwargs: dict, tokens: int) -> int:
        """The new tokens HF's generate makes of a prompt of `tokens` (GenerationMixin.
        _prepare_generated_length and _validate_generated_length): max_new_tokens; else the
        max_length given (in the call, its generation_config or the model's), which must exceed
        the prompt; else 20 after the prompt, within max_position_embeddings."""
        if gen.max_new_tokens is not None:
            return int(gen.max_new_tokens)
        given = kwargs.get("generation_config")
        if (
            kwargs.get("max_length") is not None
            or (given is not None and given.max_length is not None)
            or self.layout.model.generation_config.max_length is not None
        ):
            length = int(gen.max_length)
        else:
            length = tokens + 20  # (HF's "by default let's always generate 20 new tokens")
            positions = getattr(self.layout.model.config, "max_position_embeddings", None)
            if positions is not None:
                length = min(length, int(positions))
        if tokens >= length:
            raise ValueError(
                f"RevivaManager.generate: input length of input_ids is {tokens}, but max_length "
                f"is {length} (as transformers' generate refuses it): set max_new_tokens"
            )
        return length - tokens

    def _decode_attention_on_host(self, plan: Plan, beams: int, padded: bool, share: int) -> bool:
        """Whether this call's decode attends its streamed K/V on the host (RevivaConfig.
        decode_attention): "host" unless something below rules it out, and then it raises
        naming it; "device" never; "auto" where nothing rules it out and it pays (below)."""
        choice = self.config.decode_attention
        if choice == "device":
            return False
        why = None
        if not plan.kv_fp8 and self.layout.dtype not in (torch.bfloat16, torch.float32):
            why = f"K/V in {self.layout.dtype} (the host reads bf16, fp32 or fp8 rows)"
        elif plan.page_tokens:
            why = f"kv_page_tokens={plan.page_tokens}"
        elif beams > 1:
            why = f"num_beams={beams} (beams reorder rows on the device)"
        elif share > 1:
            why = "a prompt shared by several sequences"
        elif padded:
            why = "a padded batch (a padding mask)"
        if choice == "host":
            if why is not None:
                raise ValueError(
                    f"RevivaManager.generate: RevivaConfig(decode_attention='host') with {why}, "
                    "which attention on the host does not support; use decode_attention='auto' "
                    "or 'device'"
                )
            return True
        # "auto": on a GPU, where the weights stream too and the model plans a shorter step
        # with the host attending (planner.host_attention_pays; Note [Decode rooms when the host
        # attends] in weights.py), or, for fp8 rows, some of the layers fetched (Note [The host
        # beside the copies] in planner.py); never on the CPU, whose cores are the device's
        if why is not None or self.layout.device.type != "cuda":
            return False
        if plan.kv_fp8:
            return self._host_beside_copies(plan) > 0
        return host_attention_pays(plan, MODEL)

    def _host_beside_copies(self, plan: Plan) -> int:
        """Note [The host beside the copies] (planner.py): the streamed layers decode attends on
        the host while the others are fetched (0: none), kept for the call in the phase."""
        count = host_kv_layers(plan, MODEL)
        if count > 0:
            self._phase["host_beside_copies"] = count
        return count

    def _refusal_state(self, by: str, free: int | None, promoted: int) -> dict:
        """What the device and the arena held when a promotion was first refused (bytes)."""
        st = self.arena.stats()
        state = {
            "refused_by": by,
            "promoted_before": promoted,
            "arena_mapped_bytes": int(st["mapped_bytes"]),
            "arena_retiring_bytes": int(st["retiring_bytes"]),
            "arena_limit_bytes": int(st["limit_bytes"]),
        }
        if free is not None:
            dev = self.layout.device
            state["device_free_bytes"] = free
            state["torch_allocated_bytes"] = torch.cuda.memory_allocated(dev)
            state["torch_reserved_bytes"] = torch.cuda.memory_reserved(dev)
        return state

    # --- phases ----------------------------------------------------------------------------------

    def _event(self) -> Any:
        if self.layout.device.type == "cuda":
            e = torch.cuda.Event(enable_timing=True)
            e.record(torch.cuda.current_stream(self.layout.device))
            return e
        return time.perf_counter()

    def _mark_decode_step(self) -> None:
        self._prefill_over()
        self._phase["decode_steps"] = self._phase.get("decode_steps", 0) + 1
        self._phase.setdefault("step_events", []).append(self._event())
        self._ranges.swap("reviva.decode.step")

    def _prefill_over(self) -> None:
        """The call's first decode step starts (once per call, before its first layer): decode's
        smaller fp8 blocks, streamed weights taken one block at a time in a smaller room (Note
        [Layers in parts]), then what prefill's working set and that room leave promoted."""
        if "prefill_end" in self._phase:
            return
        self._phase["prefill_end"] = self._event()
        self._ranges.pop("reviva.prefill")
        self._ranges.push("reviva.decode")
        if self._progress is not None:
            self._progress.close()
        self._phase["prefill_peak"] = self._phase_peak()
        self._phase["prefill_counters"] = self._phase_counters(self._cache)
        if "pin_go" in self._phase:  # (a prompt too short for a layered prefill)
            self._phase["pin_go"].set()
        plan, cache = self._plan, self._cache
        if cache is not None and plan is not None and cache.fp8 and plan.kv_decode_block_tokens:
            cache.block_tokens = plan.kv_decode_block_tokens
        if self.weights is not None:
            # (Note [Decode rooms when the host attends] in weights.py)
            rooms = HOST_DECODE_ROOMS if self._phase.get("host_attention", False) else DECODE_ROOMS
            self._phase["weight_bytes_given_back"] = self.weights.enter_decode(rooms)
            self._promote_weights_for_host_decode()
        self._promote_after_prefill()
        self._attend_on_host_after_prefill()

    def _phase_peak(self) -> int | None:
        """The device bytes a phase (prefill, then decode) held at most: torch's peak plus the
        arena's peak within it, and starts the next phase's peaks. A sum of two peaks bounds
        the true one; within one phase they nearly coincide (prefill's K/V grows to the end of
        the phase, where the last layer's working set peaks; decode's barely moves)."""
        if self.layout.device.type != "cuda":
            return None
        peak = torch.cuda.max_memory_allocated(self.layout.device)
        peak += self.arena.stats()["peak_bytes"]
        torch.cuda.reset_peak_memory_stats(self.layout.device)
        self.arena.reset_peak()
        return peak

    def _phase_s(self, a: str, b: str) -> float | None:
        ph = self._phase
        if a not in ph or b not in ph:
            return None
        return self._elapsed_s(ph[a], ph[b])

    @staticmethod
    def _elapsed_s(a: Any, b: Any) -> float:
        if isinstance(a, float):
            return b - a
        return a.elapsed_time(b) / 1000.0

    # --- planning --------------------------------------------------------------------------------

    def plan(
        self,
        batch: int,
        prompt_tokens: int,
        new_tokens: int,
        padded: bool = False,
        past_tokens: int = 0,
        rings: bool | None = None,
    ) -> Plan:
        """How a generate call of this shape would use the budget now (reviva.planner); raises
        RevivaOutOfMemoryError naming the numbers when even one layer's K/V cannot fit.
        past_tokens: the tokens of a returned cache the call continues from, before its
        prompt_tokens. rings: sliding layers kept as rings of their window (Note [Window rings]
        in kv_cache.py); None: as generate decides (yes, unless REVIVA_WINDOW_RINGS=0)."""
        if rings is None:
            rings = rings_wanted()
        state = device_state(self.layout, self.arena, self._streamed_param_bytes())
        host = host_state(self.pool)
        w = self.weights
        return make_plan(
            self.layout,
            self.config,
            state,
            batch,
            prompt_tokens,
            new_tokens,
            padded,
            host=host,
            weight_layers=w.num_layers if w is not None else 0,
            weight_layer_bytes=max(w.layer_device_bytes) if w is not None else 0,
            weight_decode_slot_bytes=w.decode_slot_bytes if w is not None else 0,
            past_tokens=past_tokens,
            rings=rings,
            weight_experts=routed_expert_sizes(self.layout.layers) if w is not None else (0, 0, 0),
        )

    def budget_for(
        self,
        batch: int,
        prompt_tokens: int,
        new_tokens: int,
        resident_layers: int,
        padded: bool = False,
    ) -> int:
        """The smallest vram_budget (bytes) that keeps `resident_layers` layers' K/V resident
        in prefill for a call of this shape (the planner's inverse)."""
        state = device_state(self.layout, self.arena, self._streamed_param_bytes())
        return budget_for(
            self.layout,
            self.config,
            state,
            batch,
            prompt_tokens,
            new_tokens,
            resident_layers,
            padded,
        )

    def prepare(
        self, batch: int, prompt_tokens: int, new_tokens: int, padded: bool = False
    ) -> Plan:
        """Plans a generate call of this shape and pins the host memory its streamed layers
        will need now. Optional: a call pins what the pool lacks before its compute starts, and
        the process's pool keeps it for later calls."""
        plan = self.plan(batch, prompt_tokens, new_tokens, padded=padded)
        _reserve_host_copies(self.pool, plan, plan.streamed_layer_ids)
        return plan

    def offload_activations(self, min_bytes: int = 0) -> Any:
        """Activation offload for a training step of the wrapped model (reviva.training) under
        this manager's budget (the config's vram_budget or vram_threshold: its peak is kept
        under it), on the process's shared engine and pinned pool. The layers are found by
        ActivationOffload itself (the same model.model.layers), so that the head region is
        offloaded as on the path bench_train measured."""
        from reviva.training import ActivationOffload

        total = (
            torch.cuda.get_device_properties(self.layout.device).total_memory
            if self.layout.device.type == "cuda"
            else device_state(self.layout, self.arena).total
        )
        budget = self.config.budget_bytes(total)
        return ActivationOffload(
            self.model, budget, self.config.prefetch_layers, min_bytes, engine=self.engine
        )

    # --- generate --------------------------------------------------------------------------------

    def generate(self, inputs: Any = None, **kwargs: Any) -> Any:
        """`model.generate(inputs, **kwargs)` under the budget; returns what it returns. Every
        byte of device memory the call took (K/V) is given back before it returns, also when it
        raises. Calls from several threads on one manager run one at a time."""
        with self._generate_lock:
            return self._generate(inputs, kwargs)

    def _generate(self, inputs: Any, kwargs: dict[str, Any]) -> Any:
        model = self.layout.model
        if isinstance(inputs, dict) or hasattr(inputs, "keys"):  # a BatchEncoding
            kwargs = {**dict(inputs), **kwargs}
            inputs = kwargs.pop("input_ids", None)
        if inputs is None:
            inputs = kwargs.pop("input_ids", None)
        embeds = kwargs.get("inputs_embeds")
        if embeds is not None:
            # The prompt as embeddings ([batch, tokens, hidden], on the device): they are the
            # first layer's input; token ids, if given too, are only what the output starts with.
            if not isinstance(embeds, torch.Tensor) or embeds.dim() != 3:
                raise ValueError(
                    "RevivaManager.generate: inputs_embeds must be a [batch, tokens, hidden] "
                    f"tensor, got {type(embeds).__name__}"
                    + (
                        f" of shape {tuple(embeds.shape)}"
                        if isinstance(embeds, torch.Tensor)
                        else ""
                    )
                )
            shape = tuple(embeds.shape[:2])
        elif not isinstance(inputs, torch.Tensor) or inputs.dim() != 2:
            raise ValueError(
                "RevivaManager.generate needs token ids as a [batch, tokens] tensor (or a "
                f"tokenizer's BatchEncoding, or inputs_embeds), got {type(inputs).__name__}"
                + (f" of shape {tuple(inputs.shape)}" if isinstance(inputs, torch.Tensor) else "")
            )
        else:
            shape = tuple(inputs.shape)
        if shape[0] < 1 or shape[1] < 1:
            raise ValueError(
                f"RevivaManager.generate: the prompt has shape {shape}; batch and prompt length "
                "must both be >= 1"
            )
        # (the dtype and device the manager planned for: its stores hold K/V of that dtype)
        param = next(model.parameters())
        if param.dtype != self.layout.dtype:
            raise ValueError(
                f"RevivaManager.generate: the model's parameters are {param.dtype} now, "
                f"{self.layout.dtype} when the manager wrapped it; change the dtype before "
                "wrapping (e.g. model.half() then RevivaManager(model))"
            )
        if kwargs.get("use_cache") is False:
            # (HF recomputes the whole sequence at every step without a cache; the manager's
            # cache is what bounds the call's memory: it runs with it, the same tokens)
            kwargs.pop("use_cache")
        # Note [A returned cache] (kv_cache.py): a cache to continue from, as parked K/V
        past = kwargs.pop("past_key_values", None)
        if isinstance(past, Cache) and not isinstance(past, RevivaCache):
            if not getattr(past, "layers", None) or past.get_seq_length() == 0:
                raise ValueError(
                    f"RevivaManager.generate: an empty {type(past).__name__} passed as "
                    "past_key_values, for the call to fill: the manager keeps a call's K/V in its "
                    "own cache (on the device and in pinned host memory); leave past_key_values "
                    "unset, and continue a chat from the call's own cache (return_dict_in_generate="
                    "True, then past_key_values=out.past_key_values)"
                )
        continued = None if past is None else self._parked_of(past, shape, embeds is not None)
        if kwargs.get("cache_implementation") is not None:
            # (transformers takes cache_implementation from a fixed list, with no registry to
            # add one to: the manager supplies its cache itself, as past_key_values)
            raise ValueError(
                "RevivaManager.generate: cache_implementation="
                f"{kwargs['cache_implementation']!r}: the manager supplies the cache (a "
                "RevivaCache, as past_key_values); leave cache_implementation unset"
            )
        gen = copy.deepcopy(kwargs.get("generation_config") or model.generation_config)
        gen_kwargs = {k: v for k, v in kwargs.items() if hasattr(gen, k)}
        gen.update(**gen_kwargs)
        if gen.output_attentions:
            raise ValueError(
                "RevivaManager.generate does not support output_attentions=True: prefill runs "
                "attention by token chunks (or in a fused kernel), which never forms the "
                "attention weights"
            )
        batch, tokens = shape
        # Several sequences per prompt (sampling) or beams: generate repeats each prompt's row
        # that many times before prefill, so the cache holds that many rows (Note [Beams] in
        # kv_cache.py).
        beams = gen.num_beams or 1
        rows = max(beams, gen.num_return_sequences or 1)
        batch *= rows
        new_tokens = self._new_tokens(gen, kwargs, tokens)
        if kwargs.get("attention_mask") is None and embeds is None:
            inferred = self._inferred_mask(model, gen, inputs)
            if inferred is not None:  # (HF's generate takes it as it would infer it)
                kwargs["attention_mask"] = inferred
        mask = kwargs.get("attention_mask")
        padded = mask is not None and not bool(mask.all())
        cuda = self.layout.device.type == "cuda"
        self.arena.reclaim(True)  # memory a previous call gave back is free before planning
        if continued is not None and rows > 1:
            raise ValueError(
                "RevivaManager.generate: continuing from a returned cache (past_key_values) "
                f"with {rows} sequences per prompt (num_beams / num_return_sequences) is not "
                "supported yet (nor by transformers' own caches): continue with one sequence "
                "per prompt"
            )
        share = 1 if continued else self._share_rows(rows, tokens + new_tokens, padded, gen, kwargs)
        # (a continued call's prefill runs the tokens after the returned cache's alone)
        past_tokens = 0 if continued is None else continued[2]
        # Note [Window rings] (kv_cache.py): not for a padded batch continuing a returned cache
        # (HF's mask of its new tokens would start at the ring's first token)
        rings = rings_wanted() and not (continued is not None and padded)
        plan = self.plan(
            batch // share, tokens - past_tokens, new_tokens, padded, past_tokens, rings
        )
        if share > 1 and (plan.kv_fp8 or plan.page_tokens or plan.residual_on_host):
            share = 1  # (K/V attended by blocks or pages, or a prefill from the host: per row)
            plan = self.plan(batch, tokens, new_tokens, padded=padded, rings=rings)
        if continued is not None and plan.residual_on_host:
            raise ValueError(
                "RevivaManager.generate: continuing from a returned cache (past_key_values) with "
                "a plan that keeps the new tokens' hidden states on the host is not supported "
                "yet: raise vram_budget, or use prefill_residual='device'"
            )
        log.info(
            "reviva plan: %d of %d layers resident, %d slots, chunk %d tokens, K/V %.1f MB/layer",
            len(plan.resident_layers),
            plan.num_layers,
            plan.slots,
            plan.chunk_tokens,
            plan.layer_kv_bytes / _MiB,
        )
        if plan.residual_on_host:
            self._check_host_residual(gen, kwargs, padded)
            if embeds is not None:
                raise ValueError(
                    "RevivaManager.generate: inputs_embeds while the prompt's hidden states stay "
                    f"on the host through prefill (RevivaConfig(prefill_residual="
                    f"{self.config.prefill_residual!r}) and a plan that needs it): the "
                    "embeddings are already the prompt's size on the device; pass token ids"
                )
        if plan.page_tokens and beams > 1:
            raise ValueError(
                f"RevivaManager.generate: num_beams={beams} with RevivaConfig(kv_page_tokens="
                f"{self.config.kv_page_tokens!r}) and a plan that pages layers: beams reorder "
                "each layer's generated rows, which pages would spread; use kv_page_tokens=0"
            )
        if plan.page_tokens and padded:
            raise ValueError(
                "RevivaManager.generate: a padded batch with RevivaConfig(kv_page_tokens="
                f"{self.config.kv_page_tokens}): paged K/V is attended by pages without a padding "
                "mask; pass prompts without padding"
            )
        # (a window as long as the call's tokens never leaves a key out: Gemma's 4096 or
        # Mistral's over a shorter call attend as full layers do)
        windows = set(self.layout.windows_shorter_than(plan.capacity).values())
        if windows and (plan.kv_fp8 or plan.page_tokens):
            raise ValueError(
                f"RevivaManager.generate: layers with a sliding window ({min(windows)} tokens) "
                "and "
                + ("kv_dtype='fp8'" if plan.kv_fp8 else f"kv_page_tokens={plan.page_tokens}")
                + ": fp8 and paged K/V are attended by blocks, without the window yet; use "
                "kv_dtype='auto' and kv_page_tokens=0 (Note [Sliding windows])"
            )
        if plan.kv_fp8 and padded:
            raise ValueError(
                "RevivaManager.generate: a padded batch with RevivaConfig(kv_dtype='fp8'): fp8 "
                "K/V is attended by blocks without a padding mask; pass prompts without padding"
            )
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.layout.device)
        self.arena.reset_peak()
        self.engine.reset_stats()
        cache: RevivaCache | None = None
        returned = False  # (set once generate returned: only then is its cache parked)
        self._phase = {"start": self._event(), "map_s": self.arena.stats()["map_s"]}
        self._phase["t0"] = time.perf_counter()  # (the call's start on the host: Note [Traces])
        self._phase["padded"] = padded
        self._phase["host_attention"] = self._decode_attention_on_host(plan, beams, padded, share)
        if self._phase["host_attention"] and plan.ring_layers:
            # (the host attends whole layers: its K/V is in host memory, where a ring saves
            # little; Note [Window rings] in kv_cache.py)
            plan = self.plan(
                batch // share, tokens - past_tokens, new_tokens, padded, past_tokens, False
            )
        self._ranges.close()
        self._ranges.push("reviva.generate")
        self._ranges.push("reviva.prefill")
        if PrefillProgress.wanted(self.config.progress, plan.prompt_tokens * plan.batch):
            self._progress = PrefillProgress(plan.num_layers, plan.prompt_tokens * plan.batch)
        if self.weights is not None:
            self.weights.store.take_timeline()  # (the call's own events from here)
        # the host's time from the call's start to each step of its set-up (ms): where a first
        # call's time before its first layer goes (prefill_before_first_layer_ms is the device's)
        setup = self._phase["setup_host_ms"] = {}
        t_setup = self._phase["t_setup"] = time.perf_counter()
        self._phase["pin_s"] = self._pin_host_copies(plan)
        setup["pinned"] = (time.perf_counter() - t_setup) * 1e3
        self._copy_hidden = bool(gen.output_hidden_states)
        self._call_kernel = call_kernel(
            self._device_kernel,
            self.config.attention_kernel,
            plan.prompt_tokens,
            chunked=not plan.whole_attention,
        )
        weights_before = None
        try:
            if self.weights is not None:
                # (before set_residency: the call's bytes include the resident layers' first
                # fills and the first streamed layers it starts bringing in)
                weights_before = self.weights.stats()
                self.weights.set_residency(
                    list(plan.weight_resident_layers),
                    plan.weight_slots,
                    plan.weight_prefetch_layers,
                )
                setup["weights_placed"] = (time.perf_counter() - t_setup) * 1e3
            self._phase["weights_before"] = weights_before
            if self._graphs is not None:
                self._graphs.begin_call(self.layout.layers)
                for i in range(plan.weight_layers):
                    if i not in plan.weight_resident_layers:  # (their addresses change per use)
                        self._graphs.uncaptured[i] = "its weights stream from pinned host memory"
            cache = RevivaCache(
                self.engine,
                self.arena,
                plan.num_layers,
                batch,
                self.layout.num_kv_heads,
                self.layout.head_dim,
                self.layout.dtype,
                plan.capacity,
                list(plan.resident_layers),
                plan.slots,
                plan.prefetch_layers,
                self._timeline_capacity,
                kv_fp8=plan.kv_fp8,
                block_tokens=plan.kv_block_tokens,
                runtime=self.runtime,
                page_tokens=plan.page_tokens,
                attention_kernel=self._call_kernel,
                share=share,
                device=self.layout.device,
                rings={i: (self.layout.windows[i], plan.ring_tokens) for i in plan.ring_layers},
            )
            cache.fp8_shadow = plan.kv_fp8_shadow_bytes > 0  # Note [fp8 prefill shadow]
            # Note [Prefill masks left to Reviva] (kv_cache.py)
            cache.skip_prefill_masks = (
                not padded
                and continued is None
                and bool(self.layout.windows_shorter_than(plan.prompt_tokens))
            )
            self._phase["store_host"] = time.perf_counter()  # (its timeline's origin)
            if plan.page_slots:
                cache.store.set_page_slots(plan.page_slots)
            if continued is not None:
                cache.load_parked(continued[0], continued[1], continued[2])
                self._prefix = continued[2]
            if (
                self._own_decode
                and rows == 1
                and not padded
                and os.environ.get("REVIVA_FETCH_WINDOWS", "1") != "0"  # (to compare)
            ):
                # Note [Fetch tails] (src/offload_manager.cpp): a sliding layer's reads are all
                # Reviva's own window-sliced calls here, so its fetches copy its window alone
                # (a ring is fetched whole: it is its window already)
                windows = self.layout.windows_shorter_than(plan.capacity)
                cache.set_fetch_windows(
                    {i: w for i, w in windows.items() if i not in plan.ring_layers}
                )
            setup["cache_made"] = (time.perf_counter() - t_setup) * 1e3
            self._cache, self._plan = cache, plan
            if self._graphs is not None:  # Note [fp8 attention in the decode graphs]
                self._graphs.cache = cache
            self._share = share
            with self:
                self._in_own_call = True
                try:
                    out = model.generate(inputs, past_key_values=cache, **kwargs)
                except torch.OutOfMemoryError as e:
                    if isinstance(e, RevivaOutOfMemoryError):
                        raise
                    # (the finished frames' locals let go: their tensors would keep the call's
                    # device memory for as long as the caller holds the exception)
                    traceback.clear_frames(e.__traceback__)
                    oom = CallOutOfMemoryError(_beyond_the_plan(e, plan, self._phase))
                    raise oom from e
                finally:
                    self._in_own_call = False
            returned = bool(gen.return_dict_in_generate)  # (a call that raised returns nothing)
        finally:
            thread = self._phase.get("pin_thread")
            if thread is not None:
                # (a prefill that raised before layer 2: the helper ends without pinning)
                self._phase["pin_cancel"] = not self._phase["pin_go"].is_set()
                self._phase["pin_go"].set()
                thread.join()  # no helper thread outlives its call
            self._phase["end"] = self._event()
            self._ranges.close()
            if self._progress is not None:
                self._progress.close()
                self._progress = None
            self._copy_hidden = False
            self._share = 1
            prefix, self._prefix = self._prefix, 0
            self._cache, self._plan = None, None
            if self._graphs is not None:
                self._graphs.cache = None
            try:
                if cache is not None:
                    # (a cache generate returns is parked: Note [A returned cache])
                    self._finish_call(cache, plan, park=returned, prefix=prefix)
            finally:
                if self._residual is not None and cuda:  # its copies end before it goes back
                    torch.cuda.synchronize(self.layout.device)
                self._residual, self._placeholder, self._positions = None, None, None
                if self.weights is not None:
                    self.weights.trim()  # streamed layers' device memory back; resident stay
            self.arena.reclaim(True)
        return out

    def _share_rows(
        self, rows: int, capacity: int, padded: bool, gen: Any, kwargs: dict[str, Any]
    ) -> int:
        """Note [Shared prompt K/V] (kv_cache.py): how many rows share each prompt's K/V in this
        call: `rows` (beams, or sequences per prompt) when nothing in the prompt differs between
        them and HF's head reads the last position only; else 1. REVIVA_SHARE_PROMPT=0 keeps a
        copy per row (to compare)."""
        if rows == 1 or os.environ.get("REVIVA_SHARE_PROMPT", "1") == "0":
            return 1
        short_window = bool(self.layout.windows_shorter_than(capacity))
        keep = kwargs.get("logits_to_keep")
        if (
            padded
            or short_window
            or gen.output_hidden_states
            or keep not in (None, 1)
            or not self.layout.model._supports_logits_to_keep()
        ):
            return 1
        return rows

    def _check_host_residual(self, gen: Any, kwargs: dict[str, Any], padded: bool) -> None:
        """Refuses, by name, what the prompt's hidden states on the host cannot give (Note
        [Residual stream on the host]): every position's hidden states or logits, padding."""
        why = (
            "the prompt's hidden states stay on the host through prefill (RevivaConfig("
            f"prefill_residual={self.config.prefill_residual!r}) and a plan that needs it)"
        )
        if gen.output_hidden_states:
            raise ValueError(f"RevivaManager.generate: output_hidden_states=True while {why}")
        if padded:
            raise ValueError(f"RevivaManager.generate: a padded batch while {why}")
        keep = kwargs.get("logits_to_keep")
        if keep not in (None, 1) or not self.layout.model._supports_logits_to_keep():
            raise ValueError(
                f"RevivaManager.generate: logits of every prompt position (logits_to_keep={keep!r}"
                f", or a model without logits_to_keep) while {why}"
            )

    def _pin_host_copies(self, plan: Plan) -> float:
        """Pins the streamed layers' host copies for the call (the pool keeps them for later
        calls, so from the second call of a shape this finds them there). Returns the seconds
        the calling thread spent on it.

        Where (REVIVA_PIN_HOST_COPIES): "background" (the default) pins the copies of layers 0
        and 1 (those streamed in prefill) before compute, and the rest on a helper thread once
        the host issues layer 2's prefill (_PIN_AFTER_LAYER): the pool lets allocations wait for
        slabs landing (Note [Slabs landing]); the calling thread joins the helper before the
        call returns. Pinning registers memory with the driver, which holds up the calling
        thread's CUDA calls meanwhile (Note [Pinning by registration] in cuda_backend.cpp); in
        a process's first call the host, not the device, sets the pace until its first layers
        are issued (kernels loaded, cuBLAS and cuDNN set up), so pinning then cost the call
        what it took. From layer 2 on the host runs a layer ahead of the device and such waits
        hide. (H200, 64k on a 24 GB card: pinning from the start of the call on the helper
        thread left call 1's time before layer 0 and layer 0 itself ~0.6 s over a no-card
        call 1's, benchmarks/results/logs/5c3b5e3, a19b83d.)
        "before_compute" pins everything before the call's compute starts."""
        if plan.streamed_layers == 0:
            return 0.0
        t = time.perf_counter()
        streamed = plan.streamed_layer_ids
        self._phase["pin_mode"] = _pin_mode()
        if self._phase["pin_mode"] == "before_compute":
            _reserve_host_copies(self.pool, plan, streamed)
            return time.perf_counter() - t
        first = [i for i in streamed if i < _PIN_AFTER_LAYER]
        rest = [i for i in streamed if i >= _PIN_AFTER_LAYER]
        if first:
            _reserve_host_copies(self.pool, plan, first)
        if not rest:
            return time.perf_counter() - t
        go = threading.Event()

        def pin() -> None:
            go.wait()
            if self._phase.get("pin_cancel"):
                return
            t0 = time.perf_counter()
            try:
                # (the early layers hold their blocks by now: layer 2 is issued after them)
                _reserve_host_copies(self.pool, plan, rest)
            except Exception as e:  # noqa: BLE001 (the call's own allocations raise theirs)
                self._phase["pin_error"] = f"{type(e).__name__}: {e}"[:300]
            finally:
                self._phase["pin_background_s"] = time.perf_counter() - t0

        thread = threading.Thread(target=pin, name="reviva-pin", daemon=True)
        self._phase["pin_go"] = go
        self._phase["pin_thread"] = thread
        thread.start()
        return time.perf_counter() - t

    def _finish_call(
        self, cache: RevivaCache, plan: Plan, park: bool = False, prefix: int = 0
    ) -> None:
        """Waits for the call's work, collects its statistics, and closes the cache: its device
        memory goes back to the arena (and from there to the device). With `park` (a call that
        returns its cache) the cache's K/V is first parked in pinned host memory (Note [A
        returned cache] in kv_cache.py)."""
        try:
            if self.layout.device.type == "cuda":
                torch.cuda.synchronize(self.layout.device)
            cache.store.synchronize()
            stats = self._collect(cache, plan)
            self._last_timeline, self._last_trace = [], None  # (never an older call's)
            if self._timeline_capacity:
                self._last_timeline = cache.store.timeline()
                self._last_trace = self._trace(stats)
            if park:
                cache.park(self.pool)
            self._last_stats = dataclasses.replace(
                stats, continued_tokens=prefix, returned_cache_host_bytes=cache.parked_bytes
            )
        finally:
            cache.close()

    def _parked_of(
        self, past: Any, shape: tuple[int, ...], embeds: bool
    ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], bool, int]:
        """Note [A returned cache] (kv_cache.py): the K/V of a cache to continue from, per layer
        [batch, kv_heads, tokens, D] (fp8 rows for an fp8 RevivaCache), whether fp8, and its
        tokens; raises naming what does not fit the model or the call."""
        lay = self.layout
        if embeds:
            raise ValueError(
                "RevivaManager.generate: past_key_values with inputs_embeds is not supported; "
                "continue from the cache with token ids"
            )
        if isinstance(past, RevivaCache):
            if past.parked is None:
                raise ValueError(
                    "RevivaManager.generate: the RevivaCache passed as past_key_values holds no "
                    "K/V: a call's cache is kept (parked in pinned host memory) only when the "
                    "call returns it, with return_dict_in_generate=True"
                )
            parked, fp8, length = past.parked, past.fp8, past.parked_length
        elif isinstance(past, Cache) and getattr(past, "layers", None):
            length = past.get_seq_length()
            parked = []
            for i, layer in enumerate(past.layers):
                keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
                if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
                    raise ValueError(
                        f"RevivaManager.generate: layer {i} of the {type(past).__name__} passed "
                        "as past_key_values holds no keys and values"
                    )
                window = lay.windows[i]
                if keys.shape[2] < length and (
                    window is None or keys.shape[2] < min(length, window - 1)
                ):
                    raise ValueError(
                        f"RevivaManager.generate: layer {i} of the {type(past).__name__} passed "
                        f"as past_key_values holds {keys.shape[2]} of its {length} tokens"
                        + (
                            f", fewer than its sliding window's last {window - 1}"
                            if window is not None
                            else " (a full-attention layer needs every token)"
                        )
                    )
                # (a sliding layer of HF's cache keeps its window's last tokens alone: they are
                # written at their positions, RevivaCache.load_parked)
                parked.append((keys[:, :, :length], values[:, :, :length]))
            fp8 = False
        else:
            raise ValueError(
                "RevivaManager.generate: past_key_values must be a cache a RevivaManager call "
                "returned (return_dict_in_generate=True) or an HF Cache with keys and values per "
                f"layer (e.g. DynamicCache), got {type(past).__name__}"
            )
        if len(parked) != lay.num_layers:
            raise ValueError(
                f"RevivaManager.generate: the cache passed as past_key_values has {len(parked)} "
                f"layers, the model {lay.num_layers}"
            )
        k = parked[0][0]
        width = fp8rows_width(lay.head_dim) if fp8 else lay.head_dim
        if k.dim() != 4 or k.shape[1] != lay.num_kv_heads or k.shape[3] != width:
            raise ValueError(
                "RevivaManager.generate: the cache passed as past_key_values holds K/V of shape "
                f"{tuple(k.shape)}, the model's is [batch, {lay.num_kv_heads}, tokens, {width}]"
            )
        if k.shape[0] != shape[0]:
            raise ValueError(
                f"RevivaManager.generate: the cache passed as past_key_values holds {k.shape[0]} "
                f"rows, the call's prompt {shape[0]}"
            )
        if length < 1 or shape[1] <= length:
            raise ValueError(
                f"RevivaManager.generate: the prompt ({shape[1]} tokens) must extend the {length} "
                "tokens the cache passed as past_key_values holds (the tokens it holds, then "
                "at least one more)"
            )
        return parked, fp8, length

    # --- statistics ------------------------------------------------------------------------------

    def _phase_counters(self, cache: RevivaCache | None) -> dict[str, float]:
        """The call's copy and stall counters so far (the engine's are reset at its start; the
        weight store's are its manager's, counted from weights_before)."""
        eng = self.engine.stats()
        out = {
            "to_device": eng["to_device"]["bytes_submitted"],
            "to_host": eng["to_host"]["bytes_submitted"],
            "stall_s": cache.store.stats()["compute_stall_s"] if cache is not None else 0.0,
        }
        before = self._phase.get("weights_before")
        if self.weights is not None and before is not None:
            out["stall_s"] += self.weights.stats()["compute_stall_s"] - before["compute_stall_s"]
        return out

    def _collect(self, cache: RevivaCache, plan: Plan) -> GenerateStats:
        st = cache.store.stats()
        eng = self.engine.stats()
        arena = self.arena.stats()
        ph = self._phase
        prefill_end = ph.get("prefill_end", ph["end"])
        prefill_s = self._elapsed_s(ph["start"], prefill_end)
        decode_s = self._elapsed_s(prefill_end, ph["end"])
        steps = ph.get("decode_steps", 0)
        layer_kv = plan.layer_kv_bytes
        # (rings hold their rows alone: Note [Window rings] in kv_cache.py)
        kv_total = sum(plan.kv_tokens(i) for i in range(plan.num_layers)) * plan.kv_token_bytes
        # Compute's waits for K/V fetches: the store's manager's meter (the one stall meter of
        # the residency engine; the store is the call's own).
        stall_s = st["compute_stall_s"]
        prefill_peak = ph.get("prefill_peak")
        decode_peak = self._phase_peak()
        peaks = [p for p in (prefill_peak, decode_peak) if p is not None]
        weights = self._weight_stats(plan)
        end = self._phase_counters(cache)
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
            device=str(self.layout.device),
            backend=self.runtime.backend,
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
            kv_dtype="fp8" if plan.kv_fp8 else str(self.layout.dtype).replace("torch.", ""),
            kv_cache_bytes=kv_total,
            kv_device_bytes=st["device_bytes"],
            kv_device_peak_bytes=st["peak_device_bytes"],
            device_bytes_saved=max(kv_total - st["device_bytes"], 0),
            host_bytes=st["host_bytes"],
            pinned_reserved_bytes=self.pool.stats()["bytes_reserved"],
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
            attention_kernel=self._call_kernel,
            prefill_s=prefill_s,
            # where prefill's time went: before the first layer (planning, pinning what is
            # pinned first, embeddings), the first layer (a process's first call loads its
            # kernels there), and after the last layer (final norm, decode graphs captured
            # ahead, the head, the first token); on the device's clock, None if not reached
            prefill_before_first_layer_s=self._phase_s("start", "layer0_start"),
            prefill_first_layer_s=self._phase_s("layer0_start", "layer1_start"),
            prefill_after_layers_s=self._phase_s("layers_end", "prefill_end"),
            # (host clock, from the set-up's start: pinned, weights_placed, cache_made,
            # first_layer)
            prefill_setup_host_s={k: v / 1e3 for k, v in ph.get("setup_host_ms", {}).items()},
            arena_map_s=arena["map_s"] - ph["map_s"],
            host_copy_wait_s=st["host_copy_wait_s"],
            pin_s=ph.get("pin_s", 0.0),
            pin_mode=ph.get("pin_mode", _pin_mode()),
            pin_background_s=ph.get("pin_background_s", 0.0),
            pin_error=ph.get("pin_error"),
            decode_steps=steps,
            decode_s=decode_s,
            decode_tok_s=steps / decode_s if steps and decode_s > 0 else None,
            own_decode_attention=ph.get("own_decode_steps", 0) == steps > 0,
            # Note [Decode graphs]: layer steps replayed as CUDA graphs and run eagerly (before
            # the layer's capture), the layers captured in this call and the host time it took,
            # and "on", or why they are off.
            decode_graphs=self._graphs_state(),
            decode_graph_replays=self._graphs.replays if self._graphs else 0,
            decode_graph_capture_s=self._graphs.capture_ms / 1e3 if self._graphs else 0.0,
            decode_graph_captures=self._graphs.captured if self._graphs else 0,
            decode_graph_captures_ahead=self._graphs.captured_ahead if self._graphs else 0,
            decode_graph_captures_in_prefill_layers=(
                self._graphs.captured_in_layers if self._graphs else 0
            ),
            decode_graph_eager_steps=self._graphs.eager_steps if self._graphs else 0,
            decode_graph_uncaptured=dict(self._graphs.uncaptured) if self._graphs else {},
            **weights,
        )

    def _weight_stats(self, plan: Plan) -> dict[str, Any]:
        """Note [Streamed weights]: what the call's weights did (zeros when they do not stream)."""
        w = self.weights
        before = self._phase.get("weights_before")
        if w is None or before is None:
            return {"weights_streamed": False, "weight_resident_layers": self.layout.num_layers}
        now = w.stats()
        return {
            "weights_streamed": True,
            "embedding_on_host": self.host_embedding is not None,
            "weight_resident_layers": now["resident_layers"],
            "weight_streamed_layers": now["streamed_layers"],
            "weight_slots": now["slots"],
            "weight_prefetch_layers": plan.weight_prefetch_layers,
            "weight_prefetch_blocks": now["prefetch_blocks"],  # (Note [Layers in parts])
            # decode's room for streamed weights (Note [Layers in parts]), and what lowering the
            # slot to it gave back for K/V promotions
            "weight_slot_bytes": w.store.slot_bytes,
            "weight_bytes_given_back": self._phase.get("weight_bytes_given_back", 0),
            "weight_host_bytes": now["host_bytes"],
            "weight_resident_bytes": now["resident_bytes"],
            "weight_bytes_to_device": now["bytes_to_device"] - before["bytes_to_device"],
            "weight_bytes_to_host": now["bytes_to_host"] - before["bytes_to_host"],
            "weight_fills": now["fills"] - before["fills"],
            "weight_prefetched_fills": now["prefetched_fills"] - before["prefetched_fills"],
            "weight_stall_s": now["compute_stall_s"] - before["compute_stall_s"],
        }

    def _graphs_state(self) -> str:
        if self._graphs is None:
            if not self.config.cuda_graphs:
                return "off: RevivaConfig(cuda_graphs=False)"
            return "not used: only the CUDA half-precision decode path has them"
        if self._graphs.failed is not None:
            return f"off: {self._graphs.failed}"
        return "on"

    def _trace(self, stats: GenerateStats) -> dict[str, Any]:
        """The call's Chrome trace (Note [Traces]): compute spans from the phase events, the
        stores' copies and stalls from the core's timelines."""
        ph = self._phase

        def at(e: Any) -> float:  # ms from the call's start
            return self._elapsed_s(ph["start"], e) * 1e3

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
            spans += store_spans(self._last_timeline, "K/V", (ph["store_host"] - t0) * 1e3)
        if self.weights is not None:
            offset = (self.weights.origin_host - t0) * 1e3
            spans += store_spans(self.weights.store.take_timeline(), "weights", offset)
        return chrome_trace(
            spans,
            {
                "device": stats.device,
                "backend": stats.backend,
                "prompt_tokens": stats.prompt_tokens,
                "decode_steps": stats.decode_steps,
                "clock": "CUDA events" if self.layout.device.type == "cuda" else "host",
                "stats": stats.to_dict(),
            },
        )

    def trace(self, path: str | os.PathLike[str]) -> str:
        """Writes the last generate call as a Chrome/Perfetto trace (JSON) at `path`: compute
        (prefill layers, decode steps), each copy of K/V and weights each way, and compute's
        stalls, one track each (Note [Traces] in reviva/trace.py). Returns the path."""
        return write_trace(path, self._last_trace, "RevivaManager")

    def get_memory_stats(self) -> GenerateStats | None:
        """What the last generate call did (reviva.stats, Note [One naming scheme]): peak device
        memory, K/V kept off the device, bytes each way, stalls, layers resident and streamed,
        and per phase (`.prefill`, `.decode`) what happened in it. A typed object that reads as
        a mapping too (`stats["streamed_layers"]`, `stats.to_dict()` for JSON). None before any
        call."""
        return self._last_stats


def _reserve_host_copies(pool: Any, plan: Plan, layers: Iterable[int]) -> None:
    """Pins the host copies of these streamed layers now, each of its own size (a ring's or the
    call's: Note [Window rings] in kv_cache.py)."""
    for size, count in Counter(plan.kv_tokens(i) * plan.kv_token_bytes for i in layers).items():
        pool.reserve(count, size)
