"""What a generate call asks for, read from its arguments as HF's generate reads them: the prompt
(token ids, a tokenizer's BatchEncoding, or inputs_embeds), the generation config with the call's
kwargs over it, the rows per prompt, the new tokens, the padding, and a cache to continue from;
and what Reviva refuses, by name, before it plans (kwargs it cannot honour) and once it has a
plan (what that plan's prefill or K/V format cannot give). Plain functions of the manager's
layout and config: nothing here touches the device.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import Cache

from reviva import switches
from reviva.adapters import DecoderLayout
from reviva.cache.fp8 import row_bytes as fp8rows_width
from reviva.cache.kv_cache import RevivaCache
from reviva.cache.saved import SavedCache
from reviva.config import RevivaConfig
from reviva.hf_versions import pop_cache
from reviva.plan.call_plan import Plan

# A returned cache's K/V per layer, whether fp8 rows, and its tokens (Note [A returned cache]).
Parked = tuple[Sequence[tuple[torch.Tensor, torch.Tensor]], bool, int]


@dataclasses.dataclass
class CallRequest:
    """One generate call's arguments, read (read_call): what its plan and its run need."""

    inputs: Any  # token ids [batch, tokens], or None with inputs_embeds
    kwargs: dict[str, Any]  # for the model's generate (an inferred attention_mask added)
    embeds: torch.Tensor | None  # inputs_embeds [batch, tokens, hidden], or None
    continued: Parked | None  # Note [A returned cache]: the cache the call continues from
    gen: Any  # the GenerationConfig the call runs with
    beams: int
    rows: int  # sequences per prompt: beams, or num_return_sequences
    batch: int  # the cache's rows: the prompts' times rows
    tokens: int  # the prompt's tokens (a continued cache's included)
    new_tokens: int
    padded: bool  # an attention mask that masks something
    returns_cache: bool  # HF's generate would return a cache (use_cache, or inputs_embeds)


def read_call(layout: DecoderLayout, inputs: Any, kwargs: dict[str, Any]) -> CallRequest:
    """The call's arguments as HF's generate reads them; raises ValueError naming what the
    manager cannot take (before any plan)."""
    model = layout.model
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
                + (f" of shape {tuple(embeds.shape)}" if isinstance(embeds, torch.Tensor) else "")
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
    if param.dtype != layout.dtype:
        raise ValueError(
            f"RevivaManager.generate: the model's parameters are {param.dtype} now, "
            f"{layout.dtype} when the manager wrapped it; change the dtype before "
            "wrapping (e.g. model.half() then RevivaManager(model))"
        )
    # Note [A returned cache] (cache/returned.py): a cache to continue from, as parked K/V
    past = pop_cache(kwargs, "RevivaManager.generate")
    if isinstance(past, Cache) and not isinstance(past, RevivaCache):
        if not getattr(past, "layers", None) or past.get_seq_length() == 0:
            # (an HF cache holding no token, e.g. a DynamicCache made before a chat's first
            # turn: HF runs the whole prompt into it, as into the cache it makes itself; the
            # call's own cache holds its K/V and is the one returned: Note [A returned cache])
            past = None
    continued = (
        None
        if past is None
        else parked_of(layout, past, shape, embeds is not None, inputs if embeds is None else None)
    )
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
    # Without a cache (use_cache=False, in the call or a generation config) HF recomputes the
    # whole sequence at every step and returns no cache; the manager's cache is what bounds the
    # call's memory: the call runs with it (the same tokens) and returns none, as HF (HF caches
    # anyway for inputs_embeds, and returns that cache).
    returns_cache = gen.use_cache is not False or embeds is not None
    kwargs["use_cache"] = True
    if gen.output_attentions:
        raise ValueError(
            "RevivaManager.generate does not support output_attentions=True: prefill runs "
            "attention by token chunks (or in a fused kernel), which never forms the "
            "attention weights"
        )
    batch, tokens = shape
    # Several sequences per prompt (sampling) or beams: generate repeats each prompt's row
    # that many times before prefill, so the cache holds that many rows (Note [Beams] in
    # cache/sequence_rows.py).
    beams = gen.num_beams or 1
    rows = max(beams, gen.num_return_sequences or 1)
    batch *= rows
    new_tokens = new_tokens_of(layout, gen, kwargs, tokens)
    if kwargs.get("attention_mask") is None and embeds is None:
        inferred = inferred_mask(model, gen, inputs)
        if inferred is not None:  # (HF's generate takes it as it would infer it)
            kwargs["attention_mask"] = inferred
    mask = kwargs.get("attention_mask")
    padded = mask is not None and not bool(mask.all())
    return CallRequest(
        inputs,
        kwargs,
        embeds,
        continued,
        gen,
        beams,
        rows,
        batch,
        tokens,
        new_tokens,
        padded,
        returns_cache,
    )


def refuse_for_plan(
    layout: DecoderLayout, config: RevivaConfig, plan: Plan, request: CallRequest
) -> None:
    """Refuses, by name, what the call's plan cannot give it: its prompt's hidden states on the
    host (Note [Residual stream on the host]), paged or fp8 K/V (attended by blocks or pages:
    no beams, no padding, no sliding window yet)."""
    gen, kwargs, padded, beams = request.gen, request.kwargs, request.padded, request.beams
    embeds = request.embeds
    if plan.residual_on_host:
        check_host_residual(layout, config, gen, kwargs, padded)
        if embeds is not None:
            raise ValueError(
                "RevivaManager.generate: inputs_embeds while the prompt's hidden states stay "
                f"on the host through prefill (RevivaConfig(prefill_residual="
                f"{config.prefill_residual!r}) and a plan that needs it): the "
                "embeddings are already the prompt's size on the device; pass token ids"
            )
    if plan.page_tokens and beams > 1:
        raise ValueError(
            f"RevivaManager.generate: num_beams={beams} with RevivaConfig(kv_page_tokens="
            f"{config.kv_page_tokens!r}) and a plan that pages layers: beams reorder "
            "each layer's generated rows, which pages would spread; use kv_page_tokens=0"
        )
    if plan.page_tokens and padded:
        raise ValueError(
            "RevivaManager.generate: a padded batch with RevivaConfig(kv_page_tokens="
            f"{config.kv_page_tokens}): paged K/V is attended by pages without a padding "
            "mask; pass prompts without padding"
        )
    # (a window as long as the call's tokens never leaves a key out: Gemma's 4096 or
    # Mistral's over a shorter call attend as full layers do)
    windows = set(layout.windows_shorter_than(plan.capacity).values())
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


def new_tokens_of(layout: DecoderLayout, gen: Any, kwargs: dict, tokens: int) -> int:
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
        or layout.model.generation_config.max_length is not None
    ):
        length = int(gen.max_length)
    else:
        length = tokens + 20  # (HF's "by default let's always generate 20 new tokens")
        positions = getattr(layout.model.config, "max_position_embeddings", None)
        if positions is not None:
            length = min(length, int(positions))
    if tokens >= length:
        raise ValueError(
            f"RevivaManager.generate: input length of input_ids is {tokens}, but max_length "
            f"is {length} (as transformers' generate refuses it): set max_new_tokens"
        )
    return length - tokens


def inferred_mask(model: nn.Module, gen: Any, ids: torch.Tensor) -> torch.Tensor | None:
    """The attention mask HF's generate infers for token ids given without one
    (GenerationMixin._prepare_special_tokens and _prepare_attention_mask_for_generation):
    where the pad id occurs in them and is no eos id, 0 at the pad ids; None where it masks
    nothing. The calls decide "padded" from it as from a mask given (a pad id in a prompt, or
    generated in an earlier chat turn, is masked as plain HF masks it)."""
    config = copy.deepcopy(gen)
    model._prepare_special_tokens(config, False, ids.device, ids.shape[0])
    mask = model._prepare_attention_mask_for_generation(ids, config, {})
    return None if bool(mask.all()) else mask


def share_rows(
    layout: DecoderLayout, rows: int, capacity: int, padded: bool, gen: Any, kwargs: dict[str, Any]
) -> int:
    """Note [Shared prompt K/V] (cache/sequence_rows.py): how many rows share each prompt's K/V in
    this call: `rows` (beams, or sequences per prompt) when nothing in the prompt differs between
    them and HF's head reads the last position only; else 1. REVIVA_SHARE_PROMPT=0 keeps a
    copy per row (to compare)."""
    if rows == 1 or not switches.share_prompt():
        return 1
    short_window = bool(layout.windows_shorter_than(capacity))
    keep = kwargs.get("logits_to_keep")
    if (
        padded
        or short_window
        or gen.output_hidden_states
        or keep not in (None, 1)
        or not layout.model._supports_logits_to_keep()
    ):
        return 1
    return rows


def check_host_residual(
    layout: DecoderLayout, config: RevivaConfig, gen: Any, kwargs: dict[str, Any], padded: bool
) -> None:
    """Refuses, by name, what the prompt's hidden states on the host cannot give (Note
    [Residual stream on the host]): every position's hidden states or logits, padding."""
    why = (
        "the prompt's hidden states stay on the host through prefill (RevivaConfig("
        f"prefill_residual={config.prefill_residual!r}) and a plan that needs it)"
    )
    if gen.output_hidden_states:
        raise ValueError(f"RevivaManager.generate: output_hidden_states=True while {why}")
    if padded:
        raise ValueError(f"RevivaManager.generate: a padded batch while {why}")
    keep = kwargs.get("logits_to_keep")
    if keep not in (None, 1) or not layout.model._supports_logits_to_keep():
        raise ValueError(
            f"RevivaManager.generate: logits of every prompt position (logits_to_keep={keep!r}"
            f", or a model without logits_to_keep) while {why}"
        )


def parked_of(
    layout: DecoderLayout,
    past: Any,
    shape: tuple[int, ...],
    embeds: bool,
    ids: torch.Tensor | None = None,
) -> Parked:
    """Note [A returned cache] (cache/returned.py): the K/V of a cache to continue from, per layer
    [batch, kv_heads, tokens, D] (fp8 rows for an fp8 RevivaCache), whether fp8, and its
    tokens; raises naming what does not fit the model or the call (a saved cache's model and
    first tokens too, against the call's token ids `ids`)."""
    lay = layout
    if embeds:
        raise ValueError(
            "RevivaManager.generate: past_key_values with inputs_embeds is not supported; "
            "continue from the cache with token ids"
        )
    if isinstance(past, SavedCache):
        # Note [Saved caches] (cache/saved.py): the model and the prompt's first tokens checked
        past.check(lay.model, ids)
        parked, fp8, length = past.parked, past.fp8, past.parked_length
    elif isinstance(past, RevivaCache):
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
            "returned (return_dict_in_generate=True), one reviva.load_cache read back, or an "
            "HF Cache with keys and values per "
            f"layer (e.g. DynamicCache), got {type(past).__name__}"
        )
    if len(parked) != lay.num_layers:
        raise ValueError(
            f"RevivaManager.generate: the cache passed as past_key_values has {len(parked)} "
            f"layers, the model {lay.num_layers}"
        )
    # (a saved cache's first layer by its shape: its K/V are read when the call writes them)
    k = (
        torch.empty(parked.shape(0), device="meta")
        if isinstance(past, SavedCache)
        else parked[0][0]
    )
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
