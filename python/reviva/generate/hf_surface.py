"""The HF surface of RevivaManager: the model's modules as HF runs them, with Reviva's forwards
put in their place while the manager is entered, and exactly what was there put back after.

HFSurface (a mixin of RevivaManager) wraps each decoder layer, the final norm, and (when the
model has them) the input embedding and the rotary module with per-instance `forward`s, and
routes the model's own `generate` to the manager's (Note [generate inside the with-block]). The
wrappers decide, per call of HF's forward, whether Reviva's path runs (prefill by chunks,
Reviva's own decode attention, the prompt's hidden states on the host) or HF's own forward
does, around the cache's acquire and release.

State it reads: the manager's layout, config, weights, layers (LlamaLayerPath), pool, and the
call's _in_own_call, _cache, _plan, _phase, _share, _prefix, _copy_hidden, _own_decode,
_graphs, _residual, _placeholder. State it writes: _saved_forwards, _saved_generate,
_rotary_forward, _rotary_by_type, and, for a prompt whose hidden states stay on the host,
_residual, _placeholder and _positions; the model's `forward`/`generate` instance attributes and its
_WRAPPED_BY mark. The call's phase events it hands to CallPhases (generate/phases.py).
"""

from __future__ import annotations

import functools
import inspect
import threading
import weakref
from typing import Any

import torch
from torch import nn

from reviva.hf_versions import layer_cache

_MISSING = object()
# Which manager has wrapped a model's layers: a second one on the same model (in this thread or
# another) is refused rather than left to interleave its wrappers with the first's.
_WRAPPED_BY = "_reviva_wrapped_by"
_WRAP_LOCK = threading.Lock()


class HFSurface:
    """Wrapping and unwrapping the model's modules (RevivaManager's mixin; see the module)."""

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
            self._wrap(model, self._make_model_forward(model))
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

    # Note [No mask read in decode steps]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # HF's decode step builds its causal mask from the call's 2D attention mask, and asks whether
    # it masks anything (masking_utils._ignore_causal_mask_sdpa: `mask.sum() == mask.numel()` read
    # as a bool): the host waits there for the device every step, so a stop decided a step late
    # (generate/stop_check.py) still found the host waiting there (10.9 ms a step under cProfile at
    # 20f78a6 on the H200). A call whose mask masks nothing was read once at its
    # start (call_inputs: `padded`), and the steps only append ones to it: for such a call the
    # model's forwards of one token a row (decode's) get no mask, which HF reads as "nothing
    # masked": the same masks and tokens. A padded call keeps its mask.
    def _make_model_forward(self, model: nn.Module) -> Any:
        original = model.forward

        # (HF's generate reads the forward's signature to choose its inputs: the original's)
        @functools.wraps(original)
        def forward(*args: Any, **kwargs: Any) -> Any:
            ids = kwargs.get("input_ids")
            if ids is None:
                ids = kwargs.get("inputs_embeds")
            if (
                self._in_own_call
                and self._phase.get("padded") is False
                and kwargs.get("attention_mask") is not None
                and ids is not None
                and ids.shape[1] == 1
            ):
                kwargs["attention_mask"] = None  # Note [No mask read in decode steps]
            return original(*args, **kwargs)

        return forward

    def _make_layer_forward(self, i: int, layer: nn.Module) -> Any:
        original = layer.forward

        def forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            weights = self.weights
            if weights is None:
                return run(hidden_states, *args, **kwargs)
            # (Note [Streamed weights]: its parameters on the device; a decode step's layer
            # takes them one block at a time, Note [Layers in parts])
            cache = layer_cache(kwargs)
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
            cache = layer_cache(kwargs)
            if cache is not self._cache or cache is None:
                return original(hidden_states, *args, **kwargs)
            if hidden_states is self._placeholder and self._residual is not None:
                # (No padding here, call_inputs.check_host_residual: a mask HF passes is the
                # causal one, which the chunks' attention applies itself.)
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
                # (after a returned cache's tokens: Note [A returned cache] in cache/returned.py)
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
