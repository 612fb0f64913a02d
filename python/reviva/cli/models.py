"""The models `python -m reviva plan` takes (with or without --train): the presets' shapes, a
config.json or a folder holding one, or a model id whose config is in the Hugging Face cache;
configs beyond what can be planned refused by name; the model built on the meta device."""

from __future__ import annotations

import argparse
import sys

import torch

# Shapes for `plan` (HF config fields; bf16). Any other: a config.json or a folder holding one.
PRESETS = {
    "llama3-8b": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        rope_theta=500000.0,
    ),
    "llama3.2-1b": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        rope_theta=500000.0,
        tie_word_embeddings=True,
    ),
    "llama3-70b": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=128256,
        rope_theta=500000.0,
    ),
    "mistral-7b": dict(  # v0.1: every layer slides over a 4096-token window
        architectures=["MistralForCausalLM"],
        model_type="mistral",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=32000,
        sliding_window=4096,
    ),
    "qwen2.5-32b": dict(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        hidden_size=5120,
        intermediate_size=27648,
        num_hidden_layers=64,
        num_attention_heads=40,
        num_key_value_heads=8,
        vocab_size=152064,
        use_sliding_window=False,
    ),
    "mixtral-8x7b": dict(  # 8 experts, 2 routed per token (Note [Routed experts])
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=32000,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=None,
    ),
    "qwen3-30b-a3b": dict(  # 128 small experts, 8 routed per token, every layer sparse
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=151936,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        rope_theta=1000000.0,
        use_sliding_window=False,
    ),
}


# What a config's sizes may be for `plan` to build the model's shape on the meta device: a
# config beyond them is refused by name (10^9 layers took forever to build).
_CONFIG_LIMITS = {
    "num_hidden_layers": 4096,
    "hidden_size": 1 << 17,
    "intermediate_size": 1 << 20,
    "num_attention_heads": 4096,
    "num_key_value_heads": 4096,
    "vocab_size": 1 << 24,
    "head_dim": 4096,
}


# Other numbers the plan reads where a config gives them (None: not used by this model): a
# window, a count of layers or experts of 0 or less planned nonsense ("rings of 3578 tokens").
# key -> (least, most); max_window_layers may be 0 (every layer slides, Qwen2's meaning).
_OPTIONAL_LIMITS = {
    "sliding_window": (1, 1 << 31),
    "max_window_layers": (0, 1 << 31),
    "max_position_embeddings": (1, 1 << 31),
    "num_local_experts": (1, 1 << 16),
    "num_experts": (1, 1 << 16),
    "num_experts_per_tok": (1, 1 << 16),
    "moe_intermediate_size": (1, 1 << 20),
    "sliding_window_pattern": (1, 4096),
    "no_rope_layer_interval": (1, 4096),
}

# The keys the plan's sizes come from: a config.json must give each one its model's config
# class has a default for (HF would plan that default silently: a config of a model_type alone
# planned transformers' Llama-7B); one whose default is None HF derives (num_key_value_heads:
# the heads; head_dim: hidden_size / heads). The window's keys only where the model slides.
_PLAN_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "num_local_experts",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
)
_WINDOW_KEYS = ("sliding_window", "max_window_layers")


def _int_error(name: str, value: object, least: int, most: int) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most:
        return f"{name} must be an integer in [{least}, {most}], got {value!r}"
    return None


def _missing_keys(cfg: object, given: dict) -> list[str]:
    """The keys the plan needs (_PLAN_KEYS, _WINDOW_KEYS where the model slides) that the
    config file does not give and the config class would fill with a default of its own."""
    import dataclasses

    if not dataclasses.is_dataclass(cfg):
        return []  # (no defaults to tell apart: a config class of another kind)
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
    keys = list(_PLAN_KEYS)
    if getattr(cfg, "sliding_window", None) is not None:
        keys += _WINDOW_KEYS
    text = given.get("text_config") if isinstance(given.get("text_config"), dict) else {}
    aliases = getattr(cfg, "attribute_map", {})  # (an alias -> the key it stands for)
    names = {k: {k} | {a for a, real in aliases.items() if real == k} for k in keys}
    return [
        k
        for k in keys
        if defaults.get(k, dataclasses.MISSING) not in (None, dataclasses.MISSING)
        and not names[k] & (given.keys() | text.keys())
    ]


def _config_error(cfg: object, given: dict) -> str | None:
    """Why a model config cannot be planned (a size missing, not a positive integer, beyond
    _CONFIG_LIMITS, heads that do not divide, or another number the plan reads out of
    _OPTIONAL_LIMITS, named as `given`, the config file's keys, spells it), or None."""
    for name, most in _CONFIG_LIMITS.items():
        value = getattr(cfg, name, None)
        if value is None and name in ("num_key_value_heads", "head_dim", "intermediate_size"):
            continue  # (optional: HF derives them)
        why = _int_error(name, value, 1, most)
        if why is not None:
            return why
    aliases = getattr(cfg, "attribute_map", {})  # (an alias -> the key it stands for)
    checked = set()
    for name, (least, most) in _OPTIONAL_LIMITS.items():
        key = aliases.get(name, name)
        if key in checked:
            continue  # (one key under two names: said once, as the file spells it)
        checked.add(key)
        value = getattr(cfg, name, None)
        spelled = [n for n in (name, key, *aliases) if aliases.get(n, n) == key and n in given]
        why = None if value is None else _int_error(next(iter(spelled), name), value, least, most)
        if why is not None:
            return why
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    routed = getattr(cfg, "num_experts_per_tok", None)
    if experts and routed and routed > experts:
        return f"num_experts_per_tok {routed} is more than the model's {experts} experts"
    heads, kv = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or 0
    if kv and heads % kv:
        return f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}"
    if getattr(cfg, "head_dim", None) is None and cfg.hidden_size % heads:
        return f"hidden_size {cfg.hidden_size} is not a multiple of num_attention_heads {heads}"
    return None


def _config(args: argparse.Namespace) -> object | None:
    """The model's config: a preset, a config.json or a folder holding one, or a model id whose
    config is in the Hugging Face cache (nothing is downloaded); None (said on stderr) if none,
    or if it cannot be read or planned (_config_error)."""
    import os

    from transformers import AutoConfig

    try:
        if args.model in PRESETS:
            fields = dict(PRESETS[args.model])
            cfg = AutoConfig.for_model(fields.pop("model_type"), **fields)
        elif os.path.exists(args.model):
            cfg = AutoConfig.from_pretrained(args.model)
        else:  # a model id whose config is in the HF cache (nothing is downloaded)
            try:
                cfg = AutoConfig.from_pretrained(args.model, local_files_only=True)
            except (OSError, ValueError):
                print(
                    f"reviva plan: --model {args.model!r} is neither a preset "
                    f"({', '.join(PRESETS)}), nor a config.json or a folder holding one, nor a "
                    "model id whose config is in the Hugging Face cache",
                    file=sys.stderr,
                )
                return None
        given = _given_keys(args.model)
    except Exception as e:  # noqa: BLE001 (any config transformers cannot read: said, not raised)
        print(
            f"reviva plan: --model {args.model!r}: its config cannot be read: {e}", file=sys.stderr
        )
        return None
    why = None
    missing = _missing_keys(cfg, given)
    if missing:
        why = (
            f"the config does not give {', '.join(missing)}: the plan would take "
            f"transformers' defaults for a {getattr(cfg, 'model_type', '?')} model; give "
            "them in the config"
        )
    why = why or _config_error(cfg, given)
    if why is not None:
        print(f"reviva plan: --model {args.model!r}: {why}", file=sys.stderr)
        return None
    return cfg


def _given_keys(model: str) -> dict:
    """The keys the model's config file gives (a preset: its fields), read as transformers reads
    them (a config.json, a folder holding one, a model id in the Hugging Face cache)."""
    if model in PRESETS:
        return dict(PRESETS[model])
    from transformers import PretrainedConfig

    return PretrainedConfig.get_config_dict(model, local_files_only=True)[0]


def _dtype_of(cfg: object) -> torch.dtype:
    """The model's dtype as its config gives it (bf16 where it gives none, or not a float)."""
    # (torch_dtype only where the config holds one: transformers 5 warns at every read of it)
    given = getattr(cfg, "dtype", None) or vars(cfg).get("torch_dtype")
    if isinstance(given, str):
        given = getattr(torch, given, None)
    return given if given in (torch.bfloat16, torch.float16, torch.float32) else torch.bfloat16


def _meta_model(args: argparse.Namespace, cfg: object) -> torch.nn.Module | None:
    """The model of `cfg` on the meta device in its own dtype; None (said on stderr) where
    transformers cannot build it or Reviva does not take its layout."""
    from transformers import AutoModelForCausalLM

    from reviva.adapters import inspect_model

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg, dtype=_dtype_of(cfg))
        inspect_model(model)
    except Exception as e:  # noqa: BLE001 (a config transformers or Reviva refuses: said)
        print(f"reviva plan: --model {args.model!r}: {e}", file=sys.stderr)
        return None
    return model
