"""The model bench_generate measures and what it is measured against: a Llama-3-8B-shaped model
with random weights (a tiny one of the same layout for --dry-run), its K/V bytes per token, the
PCIe rate of the roofline and the anchors measured on the H200. Other benchmarks and the
diagnostics build the same model from here."""

from __future__ import annotations

from typing import Any

PCIE_GBPS = 55.0  # pinned H2D, DESIGN.md's performance model (and bench_transfer's measurement)
ANCHORS = {  # DESIGN.md, measured on the same H200 kind
    "hf_64k_decode_tok_s": 8.99,
    "hf_64k_peak_gb": 32.5,
    "hf_64k_prefill_s": 3.73,
    "hf_offload_64k_decode_tok_s": 1.31,
    "hf_offload_64k_peak_gb": 24.2,
    # card mode, N = 24 (DESIGN.md): the longest prompts that ran
    "card24_hf_max_tokens": 20 * 1024,
    "card24_hf_offload_max_tokens": 40 * 1024,
}
SHAPE = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    rope_theta=500000.0,
    max_position_embeddings=1_100_000,  # (rope computed per position: no table of this size)
)
# --dry-run: a tiny model of the same layout on the CPU (fp32, host backend), to run every path.
DRY_SHAPE = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    rope_theta=10000.0,
    max_position_embeddings=4096,
)


def build_model(layers: int, dry_run: bool = False, dtype: Any = None) -> Any:
    """The benchmark's Llama-shaped model with random weights: bf16 on the GPU (or `dtype`), or a
    tiny fp32 one on the CPU (dry_run)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    shape = DRY_SHAPE if dry_run else SHAPE
    cfg = LlamaConfig(**{**shape, "num_hidden_layers": layers}, attn_implementation="sdpa")
    cfg.pad_token_id, cfg.eos_token_id = 0, None
    torch.manual_seed(0)
    if dry_run:
        return AutoModelForCausalLM.from_config(cfg).eval()
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype or torch.bfloat16)
    return model.eval()


def kv_bytes_per_token_per_layer(shape: dict, itemsize: int) -> int:
    """K and V of one token in one layer."""
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    return 2 * shape["num_key_value_heads"] * head_dim * itemsize
