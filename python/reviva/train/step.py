"""A streamed fine-tuning step's beginning: when the decoder's forward starts, the last step's
working set is measured (CUDA), this step planned (train_plan.plan_step: which layers' frozen
weights stay on the device) and the plan applied to the weights, its checkpoints started afresh;
HF's gradient checkpointing is served by Reviva's own (_run_directly); packed sequences get HF's
masks (Note [Packed sequences]).

FinetuneStepPlan is a mixin of Finetune (train/finetune.py). State it reads: the tuner's dims,
layers, weights, model, budget, device, chunk_tokens, loss_chunk_tokens, prefetch_layers,
return_logits, memory_model, chunked_memory_model, attention_chunk_tokens and _chunks_refused. State
it writes: _plan, _held, _measured, _step_tokens, _hf_checkpointing, stats_ (steps, tokens, plan,
layers), the weights' residency, and the checkpoints' step (begin_step).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from reviva.hf_versions import layer_cache
from reviva.plan.memory_state import host_state
from reviva.sizes import format_bytes
from reviva.train import plan as train_plan
from reviva.train.plan import (
    AUTO,
    ChunkSetting,
    FinetuneOutOfMemoryError,
    TrainMemoryModel,
    TrainPlan,
    describe,
    host_shortfall,
    plan_layers,
)

# (the finetune's logger: what a user filters on stays reviva.finetune's)
log = logging.getLogger("reviva.finetune")


# Note [Packed sequences]
# ~~~~~~~~~~~~~~~~~~~~~~~
# Packed rows (TRL's packing, DataCollatorWithFlattening: position_ids restarting inside a row,
# no attention_mask) are one sequence or several by HF's create_causal_mask, which looks for
# restarts (find_packed_sequence_indices) only where attention_mask and past_key_values are both
# None. A training step here runs without a cache (use_cache=False, as HF's gradient
# checkpointing does), so the decoder sees no cache; but HF's own forward with use_cache on (the
# config's default, unless gradient checkpointing turns it off in training) builds a
# DynamicCache first, and then attends across the restarts: one causal mask over the row. So
# where HF would have built that cache, the step passes the all-ones attention_mask, which gives
# HF's mask for that case exactly (the causal mask; flash attention's is None, as without a
# mask); where HF would not (use_cache=False, gradient checkpointing in training), the decoder
# gets position_ids alone and HF's block-diagonal masks, one sequence per restart. Either way
# the loss and gradients are the plain model's; for separate sequences pass use_cache=False
# (or turn on gradient checkpointing), as without Reviva.


def _hf_caches(module: nn.Module, kwargs: dict[str, Any]) -> bool:
    """Whether HF's forward of the decoder `module` would build a DynamicCache of its own for
    this call (transformers' merge_with_config_defaults: use_cache as given, else the config's,
    off in training under gradient checkpointing; then `use_cache and past_key_values is
    None`, `cache` from transformers 5.25 on)."""
    use_cache = kwargs.get("use_cache")
    if use_cache is None:
        use_cache = getattr(getattr(module, "config", None), "use_cache", None)
    if use_cache and getattr(module, "gradient_checkpointing", False) and module.training:
        use_cache = False
    return bool(use_cache) and layer_cache(kwargs) is None


def with_hf_packing(decoder: nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The decoder's keyword arguments `kwargs` (the caller's use_cache still in them), with
    the all-ones attention_mask where HF's forward would read packed position_ids as one
    sequence (Note [Packed sequences]): no attention_mask, HF's own cache, and restarts that
    find_packed_sequence_indices finds. Changes `kwargs` in place and returns it."""
    positions = kwargs.get("position_ids")
    if kwargs.get("attention_mask") is not None or not isinstance(positions, torch.Tensor):
        return kwargs
    ids, embeds = kwargs.get("input_ids"), kwargs.get("inputs_embeds")
    source = ids if isinstance(ids, torch.Tensor) else embeds
    if not isinstance(source, torch.Tensor) or source.dim() < 2 or positions.dim() != 2:
        return kwargs
    if not _hf_caches(decoder, kwargs):
        return kwargs
    from transformers.masking_utils import find_packed_sequence_indices

    rows, tokens = source.shape[:2]
    if positions.shape[0] != rows:  # (unsqueezed, not expanded: as HF reads it)
        positions = positions.expand(rows, -1)
    if find_packed_sequence_indices(positions) is not None:
        kwargs["attention_mask"] = torch.ones(
            (rows, tokens), dtype=torch.long, device=positions.device
        )
    return kwargs


def _run_directly(fn: Callable[..., Any], *args: Any) -> Any:
    """A layer's gradient-checkpointing function under reviva.finetune: the layer itself (its
    checkpointing is Reviva's: Finetune._serve_hf_checkpointing)."""
    return fn(*args)


class FinetuneStepPlan:
    """A step's beginning and its plan (Finetune's mixin; see the module docstring)."""

    def _begin(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> Any:
        """The decoder's forward starts: a step begins. The last training step's working set is
        measured (CUDA), this one's planned (which layers' weights stay), and its checkpoints
        start afresh."""
        self._serve_hf_checkpointing()
        self.sync()  # (the user's writes to the frozen weights since the last step)
        ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        shape = ids.shape if isinstance(ids, torch.Tensor) else getattr(embeds, "shape", None)
        if shape is None:
            return None
        tokens = int(shape[0] * shape[1]) if len(shape) >= 2 else int(shape[0])
        sequence = int(shape[1]) if len(shape) >= 2 else tokens
        self._measure()
        training = torch.is_grad_enabled()
        if training or self._plan is None:
            self._apply_plan(tokens, training, sequence)
        self.checkpoints.begin_step()
        if training:
            self.stats_.steps += 1
            self.stats_.tokens = tokens
            self._step_tokens = tokens
            if kwargs.get("use_cache") is not False:  # (None: the config's, True by default)
                kwargs = with_hf_packing(module, dict(kwargs))  # (Note [Packed sequences])
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
        if self._cuda and self._step_tokens is not None and self._plan is not None:
            peak = max(torch.cuda.max_memory_reserved(self.device) - self._held, 0)
            self._measured[(self._step_tokens, self._plan.attention_chunk_tokens)] = peak
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

    def _model_for(self, chunk: int | None) -> TrainMemoryModel:
        """The memory model of a step whose layers run by chunks of `chunk` query tokens (None:
        whole, HF's layers; Note [Layers by chunks of query tokens] in train/chunked_layer.py)."""
        return self.memory_model if chunk is None else self.chunked_memory_model

    def _chunks_asked(self, sequence: int) -> ChunkSetting:
        """What plan_layers is asked for rows of `sequence` tokens: attention_chunk_tokens, but
        whole layers after a refusal, and chunks where whole layers of this length or a shorter
        one ran out of memory with every layer streamed (_whole_failed)."""
        if self._chunks_refused:
            return None
        asked = self.attention_chunk_tokens
        if asked == AUTO and any(t <= sequence for t in self._whole_failed):
            return train_plan.AUTO_CHUNK_TOKENS
        return asked

    def plan(self, tokens: int, sequence: int | None = None) -> TrainPlan:
        """The plan a step of `tokens` tokens (in rows of `sequence`; default one row) would run
        with now (train_plan.plan_layers: which layers' weights stay, and whether the layers run
        whole or by chunks of query tokens), with the working set measured by the last step of
        that length and layers where one ran (CUDA), settled against the residency in place
        (Note [Residency across lengths])."""
        self._collect()
        budget, held = self._budget_now()
        # (the resident weights live in the arena, outside torch's `held`: the plan places them
        # in the room the budget leaves beside held, the working set and the margin)
        plan = plan_layers(
            self.dims,
            tokens,
            tokens if sequence is None else sequence,
            budget,
            held,
            self.chunk_tokens,
            self.loss_chunk_tokens,
            self._chunks_asked(tokens if sequence is None else sequence),
            lambda chunk: self._measured.get((tokens, chunk)),
            self.memory_model,
            self.chunked_memory_model,
            logits=self.return_logits,  # (Note [Logits with labels] in train/forwards.py)
        )
        return self._settled(plan)  # (Note [Residency across lengths] in train/retry.py)

    def _set_resident(self, layers: tuple[int, ...]) -> None:
        """The weights of `layers` stay on the device from now on; the others stream through
        the plan's slots, prefetch_layers ahead."""
        streams = len(layers) < self.dims.num_layers
        self.weights.set_residency(
            list(layers),
            self.memory_model.weight_slots if streams else 0,
            self.prefetch_layers if streams else 0,
        )

    def _apply_plan(self, tokens: int, training: bool = False, sequence: int | None = None) -> None:
        plan = self.plan(tokens, sequence)
        if training:  # (before any work: the checkpoints' pinned memory, Note [Checkpoints on
            # the host]; pinned memory cannot be paged out: past what the host can give, the
            # step would push the machine into swap or the OOM killer instead)
            host = host_state(self.resources.pool)
            short = "" if host is None else host_shortfall(plan, self.dims, host.available, True)
            if short:
                raise FinetuneOutOfMemoryError(
                    f"reviva.finetune: {short} ({format_bytes(host.system_available)} available "
                    f"to the system less {format_bytes(host.reserve)} kept for the process, plus "
                    f"{format_bytes(host.pool_cached)} pinned and unused in Reviva's pool). "
                    "Shorten the sequence, or free host memory"
                )
        self._held = plan.held
        before = self._plan
        if before is None or plan.resident_layers != before.resident_layers:
            if self._cuda:
                torch.cuda.empty_cache()  # (the arena maps its own memory: torch's cache gives)
            self._set_resident(plan.resident_layers)
            log.info("reviva.finetune: %s", describe(self.dims, plan))
        self._plan = plan
        self.stats_.plan = plan
        self.stats_.resident_layers = len(plan.resident_layers)
        self.stats_.streamed_layers = plan.streamed_layers
