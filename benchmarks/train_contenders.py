"""What bench_train measures: the Llama-shaped model (1.2B, bf16; a tiny one for --dry-run), the
contender names and what each runs, and the anchors measured on the H200."""

from __future__ import annotations

from typing import Any

import torch

import reviva

SHAPE = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=32000,
    max_position_embeddings=16384,
)
DRY_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=2048,
)
ANCHORS = {
    "plain_step_s": 0.158,
    "plain_peak_gb": 19.8,
    "save_on_cpu_step_s": 1.07,
    "save_on_cpu_peak_gb": 5.4,
}
CONTENDERS = (
    "plain,save_on_cpu,reviva_all,reviva_all_min1024K,"
    "reviva_6GB,reviva_8GB,reviva_10GB,reviva_12GB,reviva_16GB,growth"
)
DRY_CONTENDERS = "plain,save_on_cpu,reviva_all,reviva_all_min0K,reviva_2MB,growth"


def contender_spec(name: str) -> dict[str, Any]:
    """What a contender name runs; ValueError naming it when unknown."""
    if name in ("plain", "save_on_cpu", "growth"):
        return {"kind": name}
    if name == "reviva_all":
        return {"kind": "reviva", "budget": None, "min_bytes": None}
    if name == "reviva_all_arena":  # the blocks brought back in Reviva's arena
        return {"kind": "reviva", "budget": None, "min_bytes": None, "memory": "arena"}
    if name.startswith("reviva_all_min") and name.endswith("K"):
        kib = name[len("reviva_all_min") : -1]
        if kib.isdigit():
            return {"kind": "reviva", "budget": None, "min_bytes": int(kib) << 10}
    elif name.startswith("reviva_"):
        budget = name[len("reviva_") :]
        reviva.parse_bytes(budget)  # ValueError naming it
        return {"kind": "reviva", "budget": budget, "min_bytes": None}
    raise ValueError(
        f"unknown contender {name!r}: use plain, save_on_cpu, growth, reviva_all, "
        "reviva_all_arena, reviva_all_min<N>K or reviva_<budget> (e.g. reviva_8GB)"
    )


def build_model(dry_run: bool = False) -> Any:
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(**(DRY_SHAPE if dry_run else SHAPE), attn_implementation="sdpa")
    torch.manual_seed(0)
    if dry_run:
        return AutoModelForCausalLM.from_config(cfg).train()
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    return model.train()
