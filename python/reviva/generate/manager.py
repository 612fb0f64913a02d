"""RevivaManager: long-context generation with a HuggingFace causal LM under a device budget.

Prefill runs layer by layer over the whole prompt in token chunks (reviva.generate.llama_layer),
writing each layer's K/V into a RevivaCache: layers that fit stay resident, the others leave for
pinned host memory chunk by chunk while compute goes on. Decode runs HF's own decoder layers (or
Reviva's own attention call on CUDA in half precision); the cache hands each layer its K/V,
streamed ones filled `prefetch_layers` ahead, and appends the new token to the host copy alone.
Everything plugs in through a `Cache` and per-instance `forward` wrappers of the decoder layers
and the final norm, so `model.generate` keeps its logits processors, sampling, stopping criteria
and streamers. The plan of each call comes from reviva.plan.planner, against what the device can
give at that moment; the call gives its device memory back before it returns, whatever happens.

    manager = RevivaManager(model, RevivaConfig(vram_budget="24GB"))
    out = manager.generate(input_ids, max_new_tokens=64)
    manager.get_memory_stats()
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from reviva.adapters import DecoderLayout, base_model_of, inspect_model
from reviva.cache import saved
from reviva.cache.block_attention import resolve_kernel
from reviva.cache.kv_cache import RevivaCache
from reviva.cache.window_rings import rings_wanted
from reviva.config import RevivaConfig
from reviva.generate.call import GenerateCall
from reviva.generate.decode_graphs import DecodeGraphs
from reviva.generate.graph_capture import take_matmul_workspaces
from reviva.generate.hf_surface import _MISSING, HFSurface
from reviva.generate.host_copies import _reserve_host_copies
from reviva.generate.llama_layer import LlamaLayerPath
from reviva.generate.phases import CallPhases
from reviva.hf_versions import check_transformers, layer_cache
from reviva.placement import Placement
from reviva.plan.call_plan import Plan
from reviva.plan.decode_placement import DecodePlacement
from reviva.plan.memory_state import device_state, host_state
from reviva.plan.planner import budget_for, make_plan
from reviva.resources import device_resources
from reviva.stats import GenerateStats
from reviva.trace import PrefillProgress, Ranges, write_trace
from reviva.weights.host_embedding import HostEmbedding
from reviva.weights.routed_experts import routed_expert_sizes
from reviva.weights.streamed import StreamedWeights

log = logging.getLogger("reviva.manager")  # (the name users filter on)

# The StreamedWeights holding a model's decoder layers' weights (Note [Streamed weights]): a
# second manager would pack the host views of the first into a copy of its own.
_WEIGHTS_OF = "_reviva_streamed_weights"


class RevivaManager(HFSurface, CallPhases, DecodePlacement, GenerateCall):
    """Wraps a HF causal LM (Llama layout) to generate under a device memory budget.

    The public surface lives here (construction, plan, budget_for, prepare, generate,
    get_memory_stats, trace, the with-block); the rest is in one module each: the model's
    wrapped modules (generate/hf_surface.py), one generate call (generate/call.py, its arguments
    in generate/inputs.py, its pinned host copies in generate/host_copies.py), its phases
    (generate/phases.py), decode's placement after prefill (plan/decode_placement.py), its
    statistics (generate/call_stats.py)."""

    def __init__(
        self,
        model: nn.Module,
        config: RevivaConfig | None = None,
        fill_layer: Callable[[int, nn.Module], None] | None = None,
    ) -> None:
        """fill_layer(i, layer): for a model whose decoder layers are on the meta device (built
        without memory), writes layer i's parameter values once they have their place in pinned
        host memory (RevivaConfig.stream_weights; reviva.weights.streamed)."""
        check_transformers("RevivaManager")  # Note [Tested transformers]
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
        # where each of the model's tensors was before anything moved: close() puts it back
        self._placement = Placement(model)
        self._closed = False
        # Note [Streamed weights] (reviva/weights/streamed.py): the decoder layers' weights in
        # pinned host memory, streamed to the device by each call's plan; None: they stay where they
        # are.
        self.weights: StreamedWeights | None = self._take_weights(config, fill_layer)
        # Note [Embedding on the host] (reviva/weights/host_embedding.py): with streamed weights, an
        # untied input embedding's table in pinned host memory.
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
                self.host_embedding = HostEmbedding(
                    embed, self.pool, self.runtime, device, self._placement.origin(embed.weight)
                )
        self.layers = LlamaLayerPath(self.layout)
        # Note [Prefill attention kernel] (cache/block_attention.py): "flash", "cudnn" or
        # "reference" for the device; each call's (call_kernel) in _call_kernel.
        self._device_kernel = resolve_kernel(config.attention_kernel, device)
        self._call_kernel = self._device_kernel
        self._saved_forwards: dict[int, tuple[nn.Module, Any]] = {}
        # Note [generate inside the with-block] (generate/hf_surface.py): the model's own generate
        # while entered, and whether the manager's call is running it (then it is HF's, with the
        # manager's cache)
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
        # Note [Residual stream on the host] (generate/llama_layer.py): the prompt's hidden states
        # on the host for this call's prefill, the placeholder the model's forward passes around
        # instead, the prompt's positions, and the rotary module's own forward (each chunk's cos and
        # sin).
        self._residual: torch.Tensor | None = None
        self._placeholder: torch.Tensor | None = None
        self._positions: torch.Tensor | None = None
        self._rotary_forward: Any = None
        self._rotary_by_type = False  # its forward takes a layer_type
        # Layers return new tensors instead of updating the hidden states in place, when HF
        # records each layer's output (output_hidden_states): else every entry aliases one.
        self._copy_hidden = False
        # Note [Shared prompt K/V] (cache/sequence_rows.py): this call's rows per prompt whose
        # prompt K/V is held once (1: every row its own).
        self._share = 1
        # Note [A returned cache] (cache/returned.py): the tokens this call's cache took from the
        # cache it continues from (its prefill starts after them); 0 for a call from an empty
        # cache.
        self._prefix = 0
        # Decode with Reviva's own attention call where a fused kernel reads the cache's layout
        # in place (CUDA, half precision); elsewhere HF's layers run unchanged (exact numbers).
        self._own_decode = device.type == "cuda" and self.layout.dtype in (
            torch.float16,
            torch.bfloat16,
        )
        # Note [Decode graphs] (generate/decode_graphs.py): the own decode path's compute as CUDA
        # graphs.
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
        self._check_open()
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
        """How a generate call of this shape would use the budget now (reviva.plan.planner); raises
        RevivaOutOfMemoryError naming the numbers when even one layer's K/V cannot fit.
        past_tokens: the tokens of a returned cache the call continues from, before its
        prompt_tokens. rings: sliding layers kept as rings of their window (Note [Window rings]
        in cache/window_rings.py); None: as generate decides (yes, unless REVIVA_WINDOW_RINGS=0)."""
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
        """Activation offload for a training step of the wrapped model (reviva.activations.offload)
        under this manager's budget (the config's vram_budget or vram_threshold: its peak is kept
        under it), on the process's shared engine and pinned pool. The layers are found by
        ActivationOffload itself (the same model.model.layers), so that the head region is
        offloaded as on the path bench_train measured."""
        from reviva.activations.offload import ActivationOffload

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
            self._check_open()
            return self._generate(inputs, kwargs)

    def save_cache(
        self,
        cache_or_output: Any,
        path: str | os.PathLike[str],
        *,
        input_ids: torch.Tensor | None = None,
        overwrite: bool = False,
    ) -> int:
        """Writes a call's K/V to `path` (Note [Saved caches] in cache/saved.py), for another
        process to continue from: `reviva.load_cache(path)` reads it back, and `generate(ids,
        past_key_values=loaded)` continues from it when `ids` starts with the tokens it holds.
        `cache_or_output` is a generate output (return_dict_in_generate=True: its sequences say
        which tokens the cache holds) or the cache it returned, then with `input_ids` (those
        tokens, [batch, >= the cache's length]). Returns the file's size in bytes."""
        self._check_open()
        cache = cache_or_output
        if not isinstance(cache_or_output, RevivaCache):
            # (an output is a mapping; its cache under either name, as HF's version calls it)
            cache = layer_cache(cache_or_output) if isinstance(cache_or_output, Mapping) else None
            if input_ids is None:
                input_ids = getattr(cache_or_output, "sequences", None)
        if not isinstance(cache, RevivaCache) or cache.parked is None:
            raise ValueError(
                "RevivaManager.save_cache: needs a cache a call returned (generate(..., "
                "return_dict_in_generate=True)) or that call's output, got "
                f"{type(cache_or_output).__name__}"
            )
        length = cache.parked_length
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ValueError(
                "RevivaManager.save_cache: the tokens the cache holds are needed: pass the "
                "call's output, or input_ids=[batch, tokens]"
            )
        rows = cache.parked[0][0].shape[0]
        if input_ids.shape[0] != rows or input_ids.shape[1] < length:
            raise ValueError(
                f"RevivaManager.save_cache: input_ids of shape {tuple(input_ids.shape)} for a "
                f"cache of {rows} rows and {length} tokens"
            )
        return saved.save(
            self.layout.model, cache.parked, cache.fp8, input_ids[:, :length], path, overwrite
        )

    def close(self) -> None:
        """Gives the model back as it was: every parameter and buffer where it was before this
        manager (its values now: a streamed layer's from its pinned host copy, the input
        embedding's from its host table; Note [The user's streamed parameters] in
        weights/writes.py), the same Parameter objects, HF's own forwards and generate. The
        manager cannot be used after; closing twice does nothing."""
        if self._closed:
            return
        if self._entered:
            raise RuntimeError("RevivaManager.close: inside its with-block; leave it first")
        with self._generate_lock:
            self._closed = True
            model = self.layout.model
            if self.weights is not None:
                self.weights.close()
                if model.__dict__.get(_WEIGHTS_OF) is not None:
                    del model.__dict__[_WEIGHTS_OF]
            if self.host_embedding is not None:
                self.host_embedding.close()
            self._placement.restore()
            self.weights, self.host_embedding = None, None
            for m in {id(model): model, id(self.model): self.model}.values():
                generate = m.__dict__.get("generate")
                if getattr(generate, "_reviva_manager", None) is self:  # (reviva.from_pretrained's)
                    del m.__dict__["generate"]
                    m.__dict__.pop("reviva", None)
            if self.layout.device.type == "cuda":
                torch.cuda.empty_cache()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(
                "RevivaManager: closed (close() gave the model back); make a new manager"
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
