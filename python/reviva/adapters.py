"""What RevivaManager needs of a HuggingFace causal LM, found once and checked up front.

Supported: the Llama decoder layout, shared by Llama, Mistral, Qwen2 and Qwen3 (and any model that
follows it): `model.model.layers[i]` with `input_layernorm`, `self_attn` (`q_proj`, `k_proj`,
`v_proj`, `o_proj`, optional `q_norm`/`k_norm`), `post_attention_layernorm` and `mlp`; a final
`model.model.norm`; a `model.model.rotary_emb`; and the modeling module's `apply_rotary_pos_emb`.
Phi-3 follows it with its projections fused: `self_attn.qkv_proj` (queries, then keys, then
values) instead of the three, and `mlp.gate_up_proj` inside its MLP, which is called whole.
Mixtral and Qwen3-MoE follow it with experts in place of the MLP (`mlp` is their sparse block,
called whole: routing included; with streamed weights every expert of a layer moves). SmolLM3
follows it with some layers' attention left without rotary embeddings (NoPE: `self_attn.use_rope`
false, every fourth layer in the released models). Gemma 2 and 3 follow it with norms around each
sublayer's output (`pre_feedforward_layernorm`, `post_feedforward_layernorm`, and
`post_attention_layernorm` on the attention's output), sliding and global layers mixed, Gemma 3
with q/k norms and a rotary base per layer type (HF passes each layer its own); Gemma 2's
attention soft-capping is not applied, as HF's "sdpa" attention does not apply it (another
attn_implementation is refused by name).
Anything else gets a ValueError naming the first missing piece.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

_LAYER_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")

# The decoder layers whose forward Reviva's own layer path (llama_layer.LlamaLayerPath) is known to
# reproduce, each a family of tests/python/test_generate.py (FAMILIES) held to HF's logits. A
# layer can have every piece above and still do more in its forward: Glm4's extra norms, Granite's
# residual multipliers, StableLM's partial rotary and parallel residual, Qwen2-MoE's shared
# expert gate; accepted by the pieces alone they ran (a tiny model's logits 0.55-0.61 off, or a
# shape error mid-call), so any other class is refused by name.
_VERIFIED_LAYERS = {
    "transformers.models.llama.modeling_llama": "LlamaDecoderLayer",
    "transformers.models.mistral.modeling_mistral": "MistralDecoderLayer",
    "transformers.models.qwen2.modeling_qwen2": "Qwen2DecoderLayer",
    "transformers.models.qwen3.modeling_qwen3": "Qwen3DecoderLayer",
    "transformers.models.phi3.modeling_phi3": "Phi3DecoderLayer",
    "transformers.models.mixtral.modeling_mixtral": "MixtralDecoderLayer",
    "transformers.models.qwen3_moe.modeling_qwen3_moe": "Qwen3MoeDecoderLayer",
    "transformers.models.smollm3.modeling_smollm3": "SmolLM3DecoderLayer",
    "transformers.models.gemma2.modeling_gemma2": "Gemma2DecoderLayer",
    "transformers.models.gemma3.modeling_gemma3": "Gemma3DecoderLayer",
}
_ATTN_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj")
_FUSED_ATTN_PARTS = ("qkv_proj", "o_proj")  # Phi-3


@dataclass(frozen=True)
class DecoderLayout:
    """The pieces of a Llama-layout model that the manager drives."""

    model: nn.Module  # the CausalLM
    layers: list[nn.Module]
    final_norm: nn.Module
    apply_rotary_pos_emb: Callable
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    dtype: torch.dtype
    device: torch.device
    embed_tokens: nn.Module | None = None  # model.model.embed_tokens
    rotary_emb: nn.Module | None = None  # model.model.rotary_emb
    fused_qkv: bool = False  # self_attn.qkv_proj (Phi-3) instead of q_proj, k_proj and v_proj
    # each layer's sliding window in tokens, None for full attention (Note [Sliding windows])
    windows: tuple[int | None, ...] = ()
    # Mixture-of-experts layers (Mixtral, Qwen3-MoE): the experts a token is routed to, the
    # experts' MLP width and their number, the widest over the layers; 0 without experts. What
    # the planner sizes HF's experts forward by (Note [The experts' working set] in
    # plan/memory_model.py).
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    num_experts: int = 0

    def windows_shorter_than(self, tokens: int) -> dict[int, int]:
        """The layers whose sliding window leaves out some of a call's `tokens` (index: window);
        a longer window never leaves a key out, so such a layer attends as a full one does."""
        return {i: w for i, w in enumerate(self.windows) if w is not None and w < tokens}


def sliding_window(attn: nn.Module) -> int | None:
    """The layer's sliding window (Note [Sliding windows] in generate/layer_attention.py), None for
    full attention: the attention module's own (Qwen2, Qwen3: per layer type), else its config's
    (Mistral, Phi-3, Mixtral)."""
    if "sliding_window" in vars(attn):
        return vars(attn)["sliding_window"]
    return getattr(getattr(attn, "config", None), "sliding_window", None)


def _need(obj: object, name: str, where: str) -> object:
    if not hasattr(obj, name):
        raise ValueError(
            f"RevivaManager supports models with the Llama decoder layout (Llama, Mistral, Qwen2, "
            f"Qwen3, Phi-3, Mixtral, Qwen3-MoE, SmolLM3, Gemma 2/3); this model has no "
            f"`{where}.{name}`"
        )
    return getattr(obj, name)


def base_model_of(model: nn.Module) -> nn.Module:
    """The HF model under wrappers that keep its modules as they run: PEFT's PeftModel (its
    adapters are modules inside the base model's layers, LoRA's around their projections, and
    run there) and torch.compile's OptimizedModule (no generate of its own)."""
    while True:
        inner = getattr(model, "_orig_mod", None)
        if type(model).__name__ == "OptimizedModule" and isinstance(inner, nn.Module):
            model = inner
            continue
        get = getattr(model, "get_base_model", None)
        if callable(get) and type(model).__module__.split(".")[0] == "peft":
            model = get()
            continue
        return model


def inspect_model(model: nn.Module) -> DecoderLayout:
    """Finds the decoder pieces of `model` (under PEFT's or torch.compile's wrapper:
    base_model_of), or raises ValueError naming the first missing one."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"RevivaManager wraps a torch.nn.Module, got {type(model).__name__}")
    model = base_model_of(model)
    cfg = _need(model, "config", "model")
    inner = _need(model, "model", "model")
    layers = _need(inner, "layers", "model.model")
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise ValueError("RevivaManager: `model.model.layers` must be a non-empty nn.ModuleList")
    final_norm = _need(inner, "norm", "model.model")
    rotary_emb = _need(inner, "rotary_emb", "model.model")
    embed_tokens = _need(inner, "embed_tokens", "model.model")
    _need(model, "lm_head", "model")
    for i, layer in enumerate(layers):
        kind = type(layer)
        if _VERIFIED_LAYERS.get(kind.__module__) != kind.__name__:
            raise ValueError(
                f"RevivaManager: model.model.layers[{i}] is a {kind.__module__}.{kind.__name__}, "
                "not one of the decoder layers Reviva's own layer path is verified against ("
                + ", ".join(sorted(_VERIFIED_LAYERS.values()))
                + "); its forward may do more than the Llama layout's (a new family needs an "
                "adapter and its tests: reviva/adapters.py)"
            )
    fused = hasattr(layers[0], "self_attn") and hasattr(layers[0].self_attn, "qkv_proj")
    for i, layer in enumerate(layers):
        for part in _LAYER_PARTS:
            _need(layer, part, f"model.model.layers[{i}]")
        for part in _FUSED_ATTN_PARTS if fused else _ATTN_PARTS:
            _need(layer.self_attn, part, f"model.model.layers[{i}].self_attn")
        if getattr(layer.self_attn, "layer_idx", i) != i:
            raise ValueError(
                f"RevivaManager: layer {i} has self_attn.layer_idx {layer.self_attn.layer_idx}"
            )
    modeling = sys.modules.get(type(layers[0].self_attn).__module__)
    rope = getattr(modeling, "apply_rotary_pos_emb", None)
    if rope is None:
        raise ValueError(
            f"RevivaManager: the modeling module {type(layers[0].self_attn).__module__} has no "
            "`apply_rotary_pos_emb` (rotary position embeddings of the Llama layout)"
        )
    for name in ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size"):
        _need(cfg, name, "model.config")
    impl = getattr(cfg, "_attn_implementation", None)
    if impl != "sdpa" and not getattr(type(model), "_supports_sdpa", True):
        # (transformers 5.25 runs Gemma 2 eager only, its scores soft-capped and its sliding
        # layers masked by HF's eager masks: Reviva's paths are verified against HF's sdpa)
        raise ValueError(
            f"RevivaManager: this transformers runs {type(model).__name__} with "
            f"attn_implementation={impl!r} only (its sdpa path is gone), and Reviva's attention "
            "is verified against HF's sdpa path for it; use a transformers that runs it with "
            "sdpa (5.17)"
        )
    cap = getattr(layers[0].self_attn, "attn_logit_softcapping", None)
    if cap is not None and impl != "sdpa":
        raise ValueError(
            f"RevivaManager: attention scores soft-capped at {cap} (Gemma 2) with "
            f"attn_implementation={impl!r}: Reviva's attention calls do not cap them, as HF's "
            "'sdpa' does not; load the model with attn_implementation='sdpa' (the default)"
        )
    num_heads = cfg.num_attention_heads
    num_kv_heads = getattr(cfg, "num_key_value_heads", None) or num_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
    param = next(model.parameters())
    return DecoderLayout(
        model=model,
        layers=list(layers),
        final_norm=final_norm,
        apply_rotary_pos_emb=rope,
        num_layers=len(layers),
        hidden_size=cfg.hidden_size,
        intermediate_size=getattr(cfg, "intermediate_size", 4 * cfg.hidden_size),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        vocab_size=cfg.vocab_size,
        dtype=param.dtype,
        device=param.device,
        embed_tokens=embed_tokens,
        rotary_emb=rotary_emb,
        fused_qkv=fused,
        windows=tuple(sliding_window(layer.self_attn) for layer in layers),
        **_experts_shape(cfg, layers),
    )


def _experts_shape(cfg: object, layers: nn.ModuleList) -> dict[str, int]:
    """The widest experts of the layers whose MLP holds HF's experts module (`mlp.experts` with
    `down_proj` [E, H, I], or [E, I, H] where `is_transposed`): (k, I, E) as DecoderLayout's
    experts_per_token, expert_intermediate_size and num_experts; zeros where no layer has."""
    k = i_max = e_max = 0
    for layer in layers:
        experts = getattr(getattr(layer, "mlp", None), "experts", None)
        down = getattr(experts, "down_proj", None)
        if not isinstance(down, torch.Tensor) or down.dim() != 3:
            continue
        e = down.shape[0]
        width = down.shape[1] if getattr(experts, "is_transposed", False) else down.shape[2]
        top = (
            getattr(getattr(layer.mlp, "gate", None), "top_k", None)
            or getattr(layer.mlp, "top_k", None)
            or getattr(cfg, "num_experts_per_tok", None)
            or e
        )
        k, i_max, e_max = max(k, int(top)), max(i_max, int(width)), max(e_max, int(e))
    return dict(experts_per_token=k, expert_intermediate_size=i_max, num_experts=e_max)
