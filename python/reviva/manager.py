"""RevivaManager: long-context generation with a HuggingFace causal LM under a device budget.

Prefill runs layer by layer over the whole prompt in token chunks (projections, attention of the
chunk's queries against the keys so far, MLP), writing each layer's K/V into a RevivaCache: layers
that fit stay resident, the others leave for pinned host memory chunk by chunk while compute goes
on. Decode runs HF's own decoder layers; the cache hands each layer its K/V, streamed ones filled
`prefetch_layers` ahead, and appends the new token to the host copy alone. Everything plugs in
through a `Cache` and per-instance `forward` wrappers of the decoder layers and the final norm, so
`model.generate` keeps its logits processors, sampling, stopping criteria and streamers.

    manager = RevivaManager(model, RevivaConfig(vram_budget="24GB"))
    out = manager.generate(input_ids, max_new_tokens=64)
    manager.get_memory_stats()
"""

from __future__ import annotations

import copy
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from reviva._C import PinnedHostPool, RevivaOutOfMemoryError, Runtime, TransferEngine
from reviva.adapters import DecoderLayout, inspect_model
from reviva.config import RevivaConfig
from reviva.kv_cache import RevivaCache
from reviva.sizes import format_bytes as _fmt

log = logging.getLogger(__name__)

_MiB = 1 << 20
_MISSING = object()


@dataclass(frozen=True)
class Plan:
    """How one generate call uses the budget (all figures in bytes)."""

    budget: int
    baseline: int  # held before the call (weights, buffers)
    batch: int
    prompt_tokens: int
    capacity: int  # prompt + new tokens
    chunk_tokens: int
    # Attention over the whole prompt in one call (queries and output held whole) while the
    # projections and the MLP go by chunks; else attention by query chunks too.
    whole_attention: bool
    layer_kv_bytes: int  # K and V of one layer at full capacity
    working_set: int  # estimated transient peak (prefill or decode), margin included
    decode_working_set: int  # the same for decode alone (after prefill), margin included
    margin: int  # part of the working set kept for allocator rounding and fragmentation
    num_layers: int
    resident_layers: tuple[int, ...]
    slots: int
    prefetch_layers: int

    @property
    def streamed_layers(self) -> int:
        return self.num_layers - len(self.resident_layers)


class RevivaManager:
    """Wraps a HF causal LM (Llama layout) to generate under a device memory budget."""

    def __init__(self, model: nn.Module, config: RevivaConfig | None = None) -> None:
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
        self.model = model
        self.layout: DecoderLayout = inspect_model(model)
        device = self.layout.device
        if device.type not in ("cuda", "cpu"):
            raise ValueError(f"RevivaManager: model on unsupported device {device}")
        self.runtime = Runtime(str(device))
        self.pool = PinnedHostPool(self.runtime, config.host_memory_bytes())
        self.engine = TransferEngine(self.runtime, self.pool)
        self._saved_forwards: dict[int, tuple[nn.Module, Any]] = {}
        self._entered = 0
        self._cache: RevivaCache | None = None
        self._plan: Plan | None = None
        self._phase: dict[str, Any] = {}
        self._last_stats: dict[str, Any] = {}
        # Decode with Reviva's own attention call where a fused kernel reads the cache's layout
        # in place (CUDA, half precision); elsewhere HF's layers run unchanged (exact numbers).
        self._own_decode = device.type == "cuda" and self.layout.dtype in (
            torch.float16,
            torch.bfloat16,
        )

    # --- enabling and restoring ------------------------------------------------------------------

    def __enter__(self) -> RevivaManager:
        if self._entered == 0:
            self._install()
        self._entered += 1
        return self

    def __exit__(self, *exc: object) -> None:
        self._entered -= 1
        if self._entered == 0:
            self._restore()

    def _install(self) -> None:
        for i, layer in enumerate(self.layout.layers):
            self._wrap(layer, self._make_layer_forward(i, layer))
        self._wrap(self.layout.final_norm, self._make_norm_forward(self.layout.final_norm))

    def _wrap(self, module: nn.Module, forward: Any) -> None:
        # An instance attribute shadows the class's forward; restoring puts back exactly what
        # was there (an instance forward of someone else's hooks, or nothing).
        self._saved_forwards[id(module)] = (module, module.__dict__.get("forward", _MISSING))
        module.forward = forward

    def _restore(self) -> None:
        for module, saved in self._saved_forwards.values():
            if saved is _MISSING:
                del module.forward
            else:
                module.forward = saved
        self._saved_forwards.clear()

    # --- the wrappers ----------------------------------------------------------------------------

    def _make_layer_forward(self, i: int, layer: nn.Module) -> Any:
        original = layer.forward

        def forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            cache = kwargs.get("past_key_values")
            if cache is not self._cache or cache is None:
                return original(hidden_states, *args, **kwargs)
            if hidden_states.shape[1] > 1 and cache.get_seq_length(i) == 0:
                return self._prefill_layer(i, layer, hidden_states, kwargs)
            if i == 0:
                self._mark_decode_step()
            if (
                self._own_decode
                and kwargs.get("attention_mask") is None
                and "position_embeddings" in kwargs
            ):
                return self._decode_layer(i, layer, hidden_states, kwargs)
            cache.acquire(i)
            try:
                return original(hidden_states, *args, **kwargs)
            finally:
                cache.release(i)

        return forward

    def _make_norm_forward(self, norm: nn.Module) -> Any:
        original = norm.forward

        def forward(hidden_states: torch.Tensor) -> torch.Tensor:
            plan = self._plan
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

    def _prefill_layer(
        self, i: int, layer: nn.Module, h: torch.Tensor, kwargs: dict[str, Any]
    ) -> torch.Tensor:
        """One decoder layer over the whole prompt, by token chunks, in place on `h`."""
        if torch.is_grad_enabled():
            raise RuntimeError("RevivaManager prefill runs under torch.no_grad() (generate does)")
        cache = self._cache
        assert cache is not None and self._plan is not None
        attn = layer.self_attn
        mask = kwargs.get("attention_mask")
        if "position_embeddings" not in kwargs:
            raise ValueError(
                "RevivaManager: the decoder layer was called without position_embeddings "
                "(the Llama layout passes them from model.model.rotary_emb)"
            )
        cos, sin = kwargs["position_embeddings"]
        whole = self._plan.chunk_tokens >= h.shape[1]
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, None)
        if (whole or self._plan.whole_attention) and interface is None:
            raise ValueError(
                f"RevivaManager: attention implementation {attn.config._attn_implementation!r} "
                "is not registered with transformers"
            )
        cache.acquire(i)
        try:
            if whole or not self._plan.whole_attention:
                self._prefill_fused(i, layer, h, cos, sin, mask, interface)
            else:
                self._prefill_whole_attention(i, layer, h, cos, sin, mask, interface)
        finally:
            cache.release(i)
        return h

    def _qkv(
        self,
        layer: nn.Module,
        h: torch.Tensor,
        s: int,
        e: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys (both with RoPE) and values of tokens [s, e), [B, heads, n, D]."""
        attn = layer.self_attn
        x = layer.input_layernorm(h[:, s:e])
        shape = (h.shape[0], e - s, -1, self.layout.head_dim)
        q = attn.q_proj(x).view(shape)
        k = attn.k_proj(x).view(shape)
        if hasattr(attn, "q_norm"):
            q = attn.q_norm(q)
        if hasattr(attn, "k_norm"):
            k = attn.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = attn.v_proj(x).view(shape).transpose(1, 2)
        q, k = self.layout.apply_rotary_pos_emb(q, k, cos[:, s:e], sin[:, s:e])
        return q, k, v

    def _finish(self, layer: nn.Module, h: torch.Tensor, s: int, e: int, out: torch.Tensor) -> None:
        """o_proj of the attention output [B, n, heads, D], residual, MLP: h[:, s:e] in place."""
        o = layer.self_attn.o_proj(out.reshape(h.shape[0], e - s, -1))
        r = h[:, s:e] + o
        h[:, s:e] = r + layer.mlp(layer.post_attention_layernorm(r))

    def _attend_hf(self, attn: nn.Module, q, k, v, mask, interface) -> torch.Tensor:  # noqa: ANN001
        # Exactly HF's call (same function, same arguments): the same numbers.
        out, _ = interface(
            attn,
            q,
            k,
            v,
            mask,
            dropout=0.0,
            scaling=attn.scaling,
            sliding_window=getattr(attn, "sliding_window", None),
        )
        return out

    def _prefill_fused(self, i, layer, h, cos, sin, mask, interface) -> None:  # noqa: ANN001
        """Chunk by chunk: a chunk's queries attend to the keys of all tokens up to its end, which
        this and earlier chunks have written, so one pass suffices and a chunk's input rows are
        dead once its output is written."""
        tokens, chunk = h.shape[1], self._plan.chunk_tokens
        for s in range(0, tokens, chunk):
            e = min(tokens, s + chunk)
            whole = s == 0 and e == tokens
            self._rows(i, layer, h, s, e, s, cos, sin, mask, interface if whole else None)

    def _rows(self, i, layer, h, s, e, first, cos, sin, mask, interface) -> None:  # noqa: ANN001
        """Rows [s, e) of h are tokens [first, first + e - s): their projections, their K/V into
        the cache, their attention to every token up to the last of them, o_proj and the MLP, in
        place. With `interface`, attention is HF's own call (the whole prompt at once: the same
        numbers as HF); else Reviva's bottom-right causal call on the cache's layout."""
        q, k, v = self._qkv(layer, h, s, e, cos, sin)
        last = first + e - s
        self._cache.write(i, first, k, v)
        k_all, v_all = self._cache.view(i, last)
        if interface is not None:
            out = self._attend_hf(layer.self_attn, q, k_all, v_all, mask, interface)
        else:
            out = _chunk_attention(q, k_all, v_all, mask, first, last, layer.self_attn.scaling)
            out = out.transpose(1, 2)
        self._finish(layer, h, s, e, out)

    def _prefill_whole_attention(self, i, layer, h, cos, sin, mask, interface) -> None:  # noqa: ANN001
        """Projections by chunks into whole-prompt queries and the cache, one attention call
        over the prompt, then o_proj and the MLP by chunks."""
        cache = self._cache
        tokens, chunk = h.shape[1], self._plan.chunk_tokens
        lay = self.layout
        q_all = torch.empty(
            h.shape[0], lay.num_heads, tokens, lay.head_dim, dtype=h.dtype, device=h.device
        )
        for s in range(0, tokens, chunk):
            e = min(tokens, s + chunk)
            q, k, v = self._qkv(layer, h, s, e, cos, sin)
            cache.write(i, s, k, v)
            q_all[:, :, s:e] = q
        k_all, v_all = cache.view(i, tokens)
        out = self._attend_hf(layer.self_attn, q_all, k_all, v_all, mask, interface)
        del q_all
        for s in range(0, tokens, chunk):
            e = min(tokens, s + chunk)
            self._finish(layer, h, s, e, out[:, s:e])

    def _decode_layer(
        self, i: int, layer: nn.Module, h: torch.Tensor, kwargs: dict[str, Any]
    ) -> torch.Tensor:
        """A decode step of one layer with Reviva's own attention call: the new tokens' queries
        against the cache's token-major K/V, grouped heads read in place (no concatenation, no
        expansion). Used on CUDA in half precision without a padding mask."""
        cache = self._cache
        past = cache.get_seq_length(i)
        cos, sin = kwargs["position_embeddings"]
        if i == 0:
            self._phase["own_decode_steps"] = self._phase.get("own_decode_steps", 0) + 1
        cache.acquire(i)
        try:
            self._rows(i, layer, h, 0, h.shape[1], past, cos, sin, None, None)
        finally:
            cache.release(i)
        return h

    def _promote_after_prefill(self) -> None:
        """Prefill's working set is gone: streamed layers that now fit become resident."""
        plan, cache = self._plan, self._cache
        if plan is None or cache is None or plan.streamed_layers == 0:
            return
        held = (len(plan.resident_layers) + plan.slots) * plan.layer_kv_bytes
        room = plan.budget - plan.baseline - plan.decode_working_set - held
        count = min(max(room, 0) // plan.layer_kv_bytes, plan.streamed_layers)
        if count <= 0:
            return
        streamed = [i for i in range(plan.num_layers) if i not in plan.resident_layers]
        for k in _spread(int(count), len(streamed)):
            cache.promote(streamed[k])
        log.info("reviva: %d streamed layers promoted to resident after prefill", count)

    # --- phases ----------------------------------------------------------------------------------

    def _event(self) -> Any:
        if self.layout.device.type == "cuda":
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def _mark_decode_step(self) -> None:
        if "prefill_end" not in self._phase:
            self._phase["prefill_end"] = self._event()
            self._promote_after_prefill()
        self._phase["decode_steps"] = self._phase.get("decode_steps", 0) + 1

    def _elapsed_s(self, a: Any, b: Any) -> float:
        if isinstance(a, float):
            return b - a
        return a.elapsed_time(b) / 1000.0

    # --- planning --------------------------------------------------------------------------------

    def _device_total(self) -> int:
        if self.layout.device.type == "cuda":
            return torch.cuda.get_device_properties(self.layout.device).total_memory
        return self.runtime.device_memory_info()[1]

    def _baseline(self) -> int:
        if self.layout.device.type == "cuda":
            return torch.cuda.memory_allocated(self.layout.device)
        model = self.layout.model
        return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))

    def plan(self, batch: int, prompt_tokens: int, new_tokens: int, padded: bool = False) -> Plan:
        """How a generate call of this shape would use the budget; raises RevivaOutOfMemoryError
        naming the numbers when the weights and the minimum working set do not fit."""
        lay, cfg = self.layout, self.config
        e = lay.dtype.itemsize
        budget = cfg.budget_bytes(self._device_total())
        baseline = self._baseline()
        capacity = prompt_tokens + new_tokens
        layer_kv = 2 * capacity * batch * lay.num_kv_heads * lay.head_dim * e
        # Transient bytes per prompt token of one chunk: RMSNorm's fp32 copies, q/k/v with RoPE
        # temporaries, attention output, o_proj, residual and the MLP's three wide tensors.
        per_token = batch * (
            lay.hidden_size * 8
            + lay.num_heads * lay.head_dim * e * 5
            + lay.num_kv_heads * lay.head_dim * e * 4
            + lay.intermediate_size * e * 3
            + lay.hidden_size * e * 3
        )
        # Without a fused attention kernel, attention materializes its scores: fp32, with softmax
        # temporaries, for every (query, key) pair of a call. Fused: CUDA in half precision
        # (flash, cuDNN), and the CPU's flash kernel, unless a padding mask forces the math path.
        fused = (lay.device.type == "cuda" and lay.dtype in (torch.float16, torch.bfloat16)) or (
            lay.device.type == "cpu" and not padded
        )
        score = 0 if fused else batch * lay.num_heads * 4 * 3
        free_for_work = max(budget - baseline, 0)
        if cfg.chunk_tokens is not None:
            chunk = cfg.chunk_tokens
        else:
            target = min(max(free_for_work // 10, 32 * _MiB), 4096 * _MiB)
            chunk = max(256, target // (per_token + score * prompt_tokens) // 256 * 256)
        chunk = min(chunk, prompt_tokens) if prompt_tokens > 0 else chunk
        hidden = batch * prompt_tokens * lay.hidden_size * e
        rotary = batch * prompt_tokens * lay.head_dim * (2 * e + 8)
        mask = batch * prompt_tokens * capacity if padded else 0
        logits = batch * lay.vocab_size * (e + 12)
        # Whole-prompt attention needs the queries and the output of all tokens at once (and,
        # without a fused kernel, the scores); one call over the prompt runs the fastest kernel,
        # while a chunk's queries need a bottom-right causal mask (measured ~30% slower on the
        # H200). It is chosen when it fits beside a full set of staging slots: layers it keeps
        # off the device during prefill are promoted back after it.
        q_and_out = 2 * batch * prompt_tokens * lay.num_heads * lay.head_dim * e
        q_and_out += score * prompt_tokens * prompt_tokens
        base = hidden + rotary + mask + chunk * per_token + logits
        margin = 8 * _MiB + budget // 50  # allocator rounding and fragmentation
        window = 2 if cfg.prefetch_layers == "auto" else int(cfg.prefetch_layers)
        if chunk >= prompt_tokens or cfg.prefill_attention == "whole":
            whole_attention = True
        elif cfg.prefill_attention == "chunked":
            whole_attention = False
        else:
            fits = base + q_and_out + margin + (window + 1) * layer_kv
            whole_attention = fits <= budget - baseline
        if whole_attention and chunk < prompt_tokens:
            prefill = base + q_and_out  # whole queries and output, and the scores
        elif whole_attention:
            prefill = base + score * prompt_tokens * prompt_tokens  # q and out are in per_token
        else:
            prefill = base + score * chunk * prompt_tokens
        decode = logits + batch * capacity * 8 + per_token + 4 * _MiB
        working = max(prefill, decode) + margin
        avail = budget - baseline - working
        n = lay.num_layers
        prefetch = window
        if avail >= n * layer_kv:
            resident, slots = n, 0
        else:
            slots = prefetch + 1
            while slots > 1 and avail < slots * layer_kv:
                slots -= 1  # a narrower window before failing: still correct, less overlap
            if avail < slots * layer_kv:
                raise RevivaOutOfMemoryError(
                    f"RevivaManager: the budget of {_fmt(budget)} cannot hold what is already on "
                    f"the device ({_fmt(baseline)}: weights and buffers) plus the working set of "
                    f"a {prompt_tokens}-token prompt ({_fmt(working)} at {chunk}-token chunks) "
                    f"plus one layer's K/V ({_fmt(layer_kv)} for {capacity} tokens, batch "
                    f"{batch}): {_fmt(baseline + working + layer_kv)} needed. Raise vram_budget, "
                    "lower chunk_tokens, or shorten the prompt."
                )
            resident = min(n, (avail - slots * layer_kv) // layer_kv)
            prefetch = min(prefetch, slots - 1)
        return Plan(
            budget=budget,
            baseline=baseline,
            batch=batch,
            prompt_tokens=prompt_tokens,
            capacity=capacity,
            chunk_tokens=int(chunk),
            whole_attention=whole_attention,
            layer_kv_bytes=layer_kv,
            working_set=working,
            decode_working_set=decode + margin,
            margin=margin,
            resident_layers=_spread(int(resident), n),
            slots=slots,
            prefetch_layers=prefetch,
            num_layers=n,
        )

    def prepare(
        self, batch: int, prompt_tokens: int, new_tokens: int, padded: bool = False
    ) -> Plan:
        """Plans a generate call of this shape and pins the host memory its streamed layers
        will need, now rather than inside the call (pinning costs ~0.35 ms per MB on the H200
        host and can synchronize the device). The pool keeps it for later calls."""
        plan = self.plan(batch, prompt_tokens, new_tokens, padded=padded)
        if plan.streamed_layers:
            self.pool.reserve(2 * plan.streamed_layers, plan.layer_kv_bytes // 2)
        return plan

    def offload_activations(self, budget: int | str | None = None, min_bytes: int = 1 << 20) -> Any:
        """Activation offload for a training step of the wrapped model (reviva.training), on
        this manager's engine and pinned pool, with its prefetch window. The layers are found
        by ActivationOffload itself (the same model.model.layers), so that the head region is
        offloaded as on the path bench_train measured."""
        from reviva.training import ActivationOffload

        prefetch = 2 if self.config.prefetch_layers == "auto" else int(self.config.prefetch_layers)
        return ActivationOffload(self.model, budget, prefetch, min_bytes, engine=self.engine)

    # --- generate --------------------------------------------------------------------------------

    def generate(self, inputs: Any = None, **kwargs: Any) -> Any:
        """`model.generate(inputs, **kwargs)` under the budget; returns what it returns."""
        model = self.layout.model
        if isinstance(inputs, dict) or hasattr(inputs, "keys"):  # a BatchEncoding
            kwargs = {**dict(inputs), **kwargs}
            inputs = kwargs.pop("input_ids", None)
        if inputs is None:
            inputs = kwargs.pop("input_ids", None)
        if not isinstance(inputs, torch.Tensor) or inputs.dim() != 2:
            raise ValueError(
                "RevivaManager.generate needs token ids as a [batch, tokens] tensor (or a "
                f"tokenizer's BatchEncoding), got {type(inputs).__name__}"
                + (f" of shape {tuple(inputs.shape)}" if isinstance(inputs, torch.Tensor) else "")
            )
        for unsupported in (
            "past_key_values",
            "inputs_embeds",
            "assistant_model",
            "prompt_lookup_num_tokens",
        ):
            if kwargs.get(unsupported) is not None:
                raise ValueError(f"RevivaManager.generate does not support {unsupported}=")
        gen = copy.deepcopy(kwargs.get("generation_config") or model.generation_config)
        gen_kwargs = {k: v for k, v in kwargs.items() if hasattr(gen, k)}
        gen.update(**gen_kwargs)
        if (gen.num_beams or 1) > 1 or (gen.num_return_sequences or 1) > 1:
            raise ValueError(
                f"RevivaManager.generate: num_beams={gen.num_beams}, num_return_sequences="
                f"{gen.num_return_sequences}: beam search and several sequences per prompt are "
                "not supported"
            )
        batch, tokens = inputs.shape
        if gen.max_new_tokens is not None:
            new_tokens = gen.max_new_tokens
        else:
            new_tokens = max((gen.max_length or 20) - tokens, 0)
        mask = kwargs.get("attention_mask")
        padded = mask is not None and not bool(mask.all())
        plan = self.plan(batch, tokens, new_tokens, padded=padded)
        log.info(
            "reviva plan: %d of %d layers resident, %d slots, chunk %d tokens, K/V %.1f MB/layer",
            len(plan.resident_layers),
            plan.num_layers,
            plan.slots,
            plan.chunk_tokens,
            plan.layer_kv_bytes / _MiB,
        )
        cache = RevivaCache(
            self.engine,
            plan.num_layers,
            batch,
            self.layout.num_kv_heads,
            self.layout.head_dim,
            self.layout.dtype,
            self.layout.device,
            plan.capacity,
            list(plan.resident_layers),
            plan.slots,
            plan.prefetch_layers,
        )
        self._cache, self._plan = cache, plan
        cuda = self.layout.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.layout.device)
        self.engine.reset_stats()
        self._phase = {"start": self._event()}
        try:
            with self:
                out = model.generate(inputs, past_key_values=cache, **kwargs)
        finally:
            self._phase["end"] = self._event()
            if cuda:
                torch.cuda.synchronize(self.layout.device)
            cache.store.synchronize()
            self._last_stats = self._collect(cache, plan)
            self._cache, self._plan = None, None
            del cache
        return out

    # --- statistics ------------------------------------------------------------------------------

    def _collect(self, cache: RevivaCache, plan: Plan) -> dict[str, Any]:
        st = cache.store.stats()
        eng = self.engine.stats()
        ph = self._phase
        prefill_end = ph.get("prefill_end", ph["end"])
        prefill_s = self._elapsed_s(ph["start"], prefill_end)
        decode_s = self._elapsed_s(prefill_end, ph["end"])
        steps = ph.get("decode_steps", 0)
        layer_kv = plan.layer_kv_bytes
        kv_on_device = (st["resident_layers"] + plan.slots) * layer_kv
        kv_total = plan.num_layers * layer_kv
        copy_ms = eng["h2d"]["busy_ms"]
        stall_ms = st["compute_stall_ms"]
        cuda = self.layout.device.type == "cuda"
        return {
            "device": str(self.layout.device),
            "backend": self.runtime.backend,
            "budget_mb": plan.budget / _MiB,
            "peak_vram_mb": torch.cuda.max_memory_allocated(self.layout.device) / _MiB
            if cuda
            else None,
            "kv_cache_mb": kv_total / _MiB,
            "kv_device_mb": kv_on_device / _MiB,
            "vram_saved_mb": max(kv_total - kv_on_device, 0) / _MiB,
            "bytes_to_host": eng["d2h"]["bytes_completed"],
            "bytes_to_device": eng["h2d"]["bytes_completed"],
            "h2d_gbps": eng["h2d"]["bandwidth_gbps"],
            "copy_to_device_ms": copy_ms,
            "stall_ms": stall_ms,
            "overlap_ratio": 1.0 if copy_ms <= 0 else min(max(1.0 - stall_ms / copy_ms, 0.0), 1.0),
            "resident_layers": st["resident_layers"],
            "streamed_layers": st["streamed_layers"],
            "resident_layers_in_prefill": len(plan.resident_layers),
            "promoted_layers": st["promotions"],
            "slots": plan.slots,
            "prefetch_window": plan.prefetch_layers,
            "chunk_tokens": plan.chunk_tokens,
            "prompt_tokens": plan.prompt_tokens,
            "decode_steps": steps,
            "own_decode_attention": ph.get("own_decode_steps", 0) == steps > 0,
            "prefill_s": prefill_s,
            "decode_s": decode_s,
            "decode_tok_s": steps / decode_s if steps and decode_s > 0 else None,
            "fills": st["fills"],
            "prefetched_fills": st["prefetched_fills"],
            "slot_hits": st["slot_hits"],
            "host_mb": st["host_bytes"] / _MiB,
        }

    def get_memory_stats(self) -> dict[str, Any]:
        """What the last generate call did: peak VRAM, VRAM saved, bytes each way, overlap ratio,
        stall time, resident layers, prefetch window, per-phase times. Empty before any call."""
        return dict(self._last_stats)


def _spread(count: int, total: int) -> tuple[int, ...]:
    """`count` layer indices out of `total`, evenly spread, so that streamed layers' copies
    overlap the compute of resident layers between them."""
    if count >= total:
        return tuple(range(total))
    if count <= 0:
        return ()
    return tuple(sorted({math.floor((k + 0.5) * total / count) for k in range(count)}))


def _chunk_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    start: int,
    end: int,
    scale: float,
) -> torch.Tensor:
    """Attention of the queries of tokens [start, end) to the keys of tokens [0, end):
    causal aligned at the bottom right (query j sees keys <= start + j). [B, H, n, D] out."""
    if mask is not None:  # HF's 4D mask (padding): its rows of this chunk
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask[:, :, start:end, :end], scale=scale, enable_gqa=True
        )
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256:
        # Flash attention's causal mask is bottom-right aligned when queries and keys differ in
        # length, and it reads grouped K/V heads without expanding them.
        return torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, True, False, scale=scale
        )[0]
    n = end - start
    causal = torch.ones(n, end, dtype=torch.bool, device=q.device).tril(diagonal=start)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal, scale=scale, enable_gqa=True)
