"""reviva.finetune(..., attention_chunk_tokens=N): each layer's attention in a training step by
chunks of query tokens (Note [Chunked attention] in chunked_attention.py): the loss and the LoRA
gradients as a plain run's, the chunked function against HF's attention module (fp64, GQA, a
per-head norm, a dropout replayed), the bytes autograd saves, and where HF's own attention runs
instead."""

from __future__ import annotations

import copy
import gc
import logging
from typing import Any

import pytest
import torch
from test_finetune import (
    assert_bf16_as_close_as_plain,
    assert_close,
    batch,
    layer_budget,
    lora,
    one_thread,  # noqa: F401  (the module's fixture: one thread)
    step,
    tiny_llama,
)
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen3Config

import reviva
from reviva.chunked_attention import ChunkedAttention, _forward, refusal
from reviva.token_chunks import chunk_spans

peft = pytest.importorskip("peft", reason="peft (a dev requirement) is needed for LoRA models")

ALL = ("q_proj", "k_proj", "v_proj", "o_proj")


class Calls:
    """Counts q_proj's calls in each layer: HF's attention calls it once a pass, the chunked one
    once a chunk (forward, recompute, backward)."""

    def __init__(self, tuner: reviva.Finetune) -> None:
        self.n = [0] * len(tuner.layers)
        self.handles = [
            layer.self_attn.q_proj.register_forward_pre_hook(self._count(i))
            for i, layer in enumerate(tuner.layers)
        ]

    def _count(self, i: int) -> Any:
        def hook(module: nn.Module, args: object) -> None:
            self.n[i] += 1

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


@pytest.mark.parametrize("resident", [0, 1])
@pytest.mark.parametrize("tokens", [50, 96])
def test_lora_gradients_equal_a_plain_runs(resident: int, tokens: int) -> None:
    """Three steps (SGD between them) of a LoRA model on q, k, v and o, two rows of 50 or 96
    tokens, attention by chunks of 16 (50: the last chunk 2 tokens): the loss and every LoRA
    gradient as a plain PEFT run's within fp32 rounding (test_finetune's tolerances), with 0 and
    1 of 3 layers' weights resident; each layer's attention ran by chunks (q_proj once a chunk:
    forward, recompute, backward)."""
    base = tiny_llama(seed=21)
    plain = lora(copy.deepcopy(base), ALL)
    ours = lora(copy.deepcopy(base), ALL)
    kw: dict[str, Any] = dict(chunk_tokens=16, loss_chunk_tokens=8, attention_chunk_tokens=16)
    budget = layer_budget(ours, tokens * 2, resident, **kw)
    tuner = reviva.finetune(ours, budget=budget, device="cpu", **kw)
    calls = Calls(tuner)
    try:
        for s in range(3):
            data = batch(seed=30 + s, rows=2, tokens=tokens)
            ref_loss, ref = step(plain, data)
            got_loss, got = step(ours, data)
            assert got_loss == pytest.approx(ref_loss, rel=1e-6)
            assert_close(ref, got, rtol=1e-5, atol=1e-7, what=f"step {s}")
            assert tuner.stats().resident_layers == resident
        chunks = len(chunk_spans(tokens, 16))
        assert calls.n == [3 * 3 * chunks] * 3, calls.n
    finally:
        calls.remove()
        tuner.close()
    assert all("forward" not in layer.self_attn.__dict__ for layer in tuner.layers)


def attention_module(kind: str, dtype: torch.dtype) -> tuple[nn.Module, nn.Module, Any]:
    """(an attention module of 6 heads over 2 K/V heads, its rotary embedding, the config)."""
    torch.manual_seed(3)
    common = dict(
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=64,
        max_position_embeddings=128,
    )
    cfg = (Qwen3Config if kind == "qwen3" else LlamaConfig)(**common)
    cfg._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    attn = model.model.layers[0].self_attn
    if kind == "qwen3":  # (norms that are not all ones: their gradients mean something)
        with torch.no_grad():
            attn.q_norm.weight.normal_(1, 0.2)
            attn.k_norm.weight.normal_(1, 0.2)
    return attn, model.model.rotary_emb, cfg


def rope(rotary: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.arange(x.shape[1])[None].expand(x.shape[0], -1)
    return rotary(x, positions)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("chunk", [5, 16, 37])
def test_chunked_attention_equals_hf_attention_in_fp64(kind: str, chunk: int) -> None:
    """ChunkedAttention against HF's attention module (sdpa, GQA 6 heads over 2, Qwen3's q/k
    norms) in fp64, two rows of 37 tokens by chunks of 5, 16 and 37: the output, the input's
    gradient and every parameter's (projections with biases, norms) within 1e-10."""
    attn, rotary, _ = attention_module(kind, torch.float64)
    for p in attn.parameters():
        p.requires_grad_(True)
    mine = copy.deepcopy(attn)
    x = torch.randn(2, 37, 48, dtype=torch.float64)
    cos, sin = rope(rotary, x)
    dy = torch.randn(2, 37, 48, dtype=torch.float64)

    xr = x.clone().requires_grad_(True)
    ref, _ = attn(xr, position_embeddings=(cos, sin), attention_mask=None)
    ref.backward(dy)
    xo = x.clone().requires_grad_(True)
    anchor = torch.zeros((), dtype=torch.float64, requires_grad=True)
    got = ChunkedAttention.apply(xo, anchor, cos, sin, mine, chunk)
    got.backward(dy)
    assert torch.allclose(got, ref, rtol=0, atol=1e-10), (got - ref).abs().max()
    assert torch.allclose(xo.grad, xr.grad, rtol=0, atol=1e-10), (xo.grad - xr.grad).abs().max()
    theirs = dict(attn.named_parameters())
    for name, p in mine.named_parameters():
        err = (p.grad - theirs[name].grad).abs().max().item()
        assert err < 1e-10, (name, err)
    with torch.no_grad():  # (a layer's forward in a step: the same function without a graph)
        whole = _forward(mine, x, cos, sin, chunk_spans(37, chunk), None)[0]
    assert torch.allclose(whole, ref, rtol=0, atol=1e-10)


def test_lora_dropout_masks_replayed_in_the_backward() -> None:
    """A LoRA dropout (p=0.5) in q, v and o, fp64, chunks of 8 of 29 tokens: ChunkedAttention's
    output and gradients equal the same chunks run with a plain graph from the same generator
    state (each chunk's masks drawn again in its recompute, not fresh ones)."""
    attn, rotary, _ = attention_module("llama", torch.float64)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"])
    cfg.lora_dropout = 0.5
    holder = nn.Module()
    holder.attn = attn
    model = peft.get_peft_model(holder, cfg, autocast_adapter_dtype=False)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.3)
    attn = model.base_model.model.attn
    attn.train()
    x = torch.randn(1, 29, 48, dtype=torch.float64)
    cos, sin = rope(rotary, x)
    dy = torch.randn(1, 29, 48, dtype=torch.float64)
    trained = [p for p in attn.parameters() if p.requires_grad]

    def run(chunked: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        for p in trained:
            p.grad = None
        torch.manual_seed(11)
        if chunked:
            anchor = torch.zeros((), dtype=torch.float64, requires_grad=True)
            y = ChunkedAttention.apply(x, anchor, cos, sin, attn, 8)
        else:
            y = _forward(attn, x, cos, sin, chunk_spans(29, 8), None)[0]
        y.backward(dy)
        return y.detach(), [p.grad.clone() for p in trained]

    got, got_grads = run(True)
    ref, ref_grads = run(False)
    assert torch.allclose(got, ref, rtol=0, atol=1e-12)
    for a, b in zip(got_grads, ref_grads, strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-12), (a - b).abs().max()
    assert len(trained) == 6


def saved_bytes(tuner: reviva.Finetune, model: nn.Module, data: dict, layer: int) -> int:
    """Bytes of the distinct storages autograd saves inside layer `layer`'s attention module
    while the layer is recomputed in its backward (saved_tensors_hooks around the module's
    call with autograd on)."""
    storages: dict[int, int] = {}
    attn = tuner.layers[layer].self_attn
    hooks: list[Any] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    def enter(module: nn.Module, args: object) -> None:
        if torch.is_grad_enabled():
            ctx = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
            ctx.__enter__()
            hooks.append(ctx)

    def leave(module: nn.Module, args: object, out: object) -> None:
        if hooks:
            hooks.pop().__exit__(None, None, None)

    handles = [attn.register_forward_pre_hook(enter), attn.register_forward_hook(leave)]
    try:
        step(model, data, lr=0.0)
    finally:
        for h in handles:
            h.remove()
    assert storages, "the recompute saved nothing in the attention"
    return sum(storages.values())


def test_attention_saves_its_input_k_and_v_only() -> None:
    """Memory proxy: layer 1's attention at 1024 tokens (hidden 64, 8 heads over 2 K/V heads of
    8: Llama-3-8B's GQA ratio), LoRA on q, k, v and o, fp32, distinct storages that autograd
    saves while the layer is recomputed in its backward. Measured: HF's attention saves
    1,129,472 bytes (its input 262,144; q with RoPE 262,144; the output projection's input
    262,144; k and v 65,536 each; cos, sin, the log-sum-exp 32,768 each; LoRA's [T, r]
    intermediates 4 x 16,384; weights); by chunks of 128 it saves 458,752: the same input, K and V
    (65,536 each), cos and sin (32,768 each). Beside the input (the input norm's output, a
    full-length tensor either way): 196,608 against 867,328 bytes, 0.23 of HF's. (The
    backward's full-length gradients, which this proxy does not see, shrink likewise: dK and dV
    beside the input's gradient, no dq, d(attention output) or d(o_proj input); the GPU
    measures the step's peak.)"""
    tokens = 1024
    torch.manual_seed(4)
    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=101,
        tie_word_embeddings=False,
    )
    base = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    measured = {}
    for chunk in (None, 128):
        model = lora(copy.deepcopy(base), ALL)
        tuner = reviva.finetune(
            model,
            device="cpu",
            chunk_tokens=256,
            loss_chunk_tokens=256,
            attention_chunk_tokens=chunk,
        )
        try:
            measured[chunk] = saved_bytes(tuner, model, batch(seed=5, tokens=tokens), 1)
        finally:
            tuner.close()
    kv = 2 * tokens * 2 * 8 * 4  # K and V: 2 heads of 8, fp32
    rope_bytes = 2 * tokens * 8 * 4  # cos and sin: [1, tokens, 8]
    given = tokens * 64 * 4  # (the input: the input norm's output)
    assert measured[128] == given + kv + rope_bytes, measured
    assert measured[128] - given < 0.25 * (measured[None] - given), measured


def padded(data: dict) -> dict:
    """The batch with row 0 left-padded by 5 tokens (HF's mask: not the causal one)."""
    mask = torch.ones_like(data["input_ids"])
    mask[0, :5] = 0
    labels = data["labels"].clone()
    labels[0, :5] = -100
    return {**data, "attention_mask": mask, "labels": labels}


@pytest.mark.parametrize("case", ["padding", "sliding_window", "eager", "eager_padding"])
def test_where_chunks_apply_and_where_hf_runs(case: str, caplog: pytest.LogCaptureFixture) -> None:
    """A padding mask, Mistral's sliding window of 8 tokens (shorter than the sequence), eager
    with padding: HF's attention runs (q_proj once a pass), said once in the log, and the
    gradients are a plain run's. Eager without padding (its causal [T, T] mask is recognized):
    by chunks, the gradients a plain (eager) run's."""
    if case == "sliding_window":
        torch.manual_seed(8)
        cfg = MistralConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=101,
            sliding_window=8,
        )
        base = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    else:
        extra = {"attn_implementation": "eager"} if case.startswith("eager") else {}
        base = tiny_llama(seed=8, layers=2, **extra)
    plain = lora(copy.deepcopy(base), ALL)
    ours = lora(copy.deepcopy(base), ALL)
    tuner = reviva.finetune(ours, device="cpu", chunk_tokens=16, attention_chunk_tokens=16)
    calls = Calls(tuner)
    chunked = case == "eager"
    try:
        with caplog.at_level(logging.INFO, logger="reviva.finetune"):
            for s in range(2):
                data = batch(seed=40 + s, rows=2, tokens=48)
                if "padding" in case:
                    data = padded(data)
                ref_loss, ref = step(plain, data)
                got_loss, got = step(ours, data)
                assert got_loss == pytest.approx(ref_loss, rel=1e-6)
                assert_close(ref, got, rtol=1e-5, atol=1e-7, what=f"{case}, step {s}")
        said = [r.getMessage() for r in caplog.records if "runs as HF runs it" in r.message]
        if chunked:
            assert calls.n == [2 * 3 * 3] * 2 and not said, (calls.n, said)
        else:
            assert calls.n == [2 * 2] * 2, calls.n  # (forward and recompute, whole)
            assert len(said) == 1, said
            why = "sliding window of 8" if case == "sliding_window" else "other than the causal"
            assert why in said[0], said
    finally:
        calls.remove()
        tuner.close()


def test_attention_dropout_and_other_refusals_named() -> None:
    """What refusal() names: attention dropout in training, a cache, cos/sin needing a gradient,
    eager without a mask (no mask there is no causal mask), a module of another layout; the
    plain causal call is taken (None)."""
    attn, rotary, cfg = attention_module("llama", torch.float32)
    x = torch.randn(1, 20, 48)
    cos, sin = rope(rotary, x)
    assert refusal(attn, x, (cos, sin), None, None, {}) is None
    attn.train()
    attn.attention_dropout = 0.1
    assert "attention dropout" in refusal(attn, x, (cos, sin), None, None, {})
    attn.eval()
    assert refusal(attn, x, (cos, sin), None, None, {}) is None  # (no dropout in eval)
    assert "cache" in refusal(attn, x, (cos, sin), None, object(), {})
    grad_cos = cos.clone().requires_grad_(True)
    assert "require a gradient" in refusal(attn, x, (grad_cos, sin), None, None, {})
    assert "non-causal" in refusal(attn, x, (cos, sin), None, None, {"is_causal": False})
    cfg._attn_implementation = "eager"
    assert "no mask under" in refusal(attn, x, (cos, sin), None, None, {})
    causal = torch.full((20, 20), torch.finfo(torch.float32).min).triu(1)[None, None]
    assert refusal(attn, x, (cos, sin), causal, None, {}) is None
    assert "other than the causal" in refusal(
        attn, x, (cos, sin), causal.transpose(-1, -2), None, {}
    )
    assert "not one of" in refusal(nn.Linear(2, 2), x, (cos, sin), None, None, {})


def test_attention_dropout_runs_hfs_attention() -> None:
    """A model with attention dropout in training: HF's attention runs in the step (q_proj once
    a pass), and the step runs."""
    model = lora(tiny_llama(seed=9, layers=2, attention_dropout=0.2), ALL)
    tuner = reviva.finetune(model, device="cpu", chunk_tokens=16, attention_chunk_tokens=16)
    calls = Calls(tuner)
    try:
        loss, grads = step(model, batch(seed=2, tokens=48))
        assert calls.n == [2, 2] and all(torch.isfinite(g).all() for g in grads.values())
    finally:
        calls.remove()
        tuner.close()


@pytest.mark.parametrize("bad", [0, -16, 1.5, True, "512"])
def test_bad_attention_chunk_tokens_refused_by_name(bad: object) -> None:
    model = lora(tiny_llama(seed=1, layers=1))
    with pytest.raises(ValueError, match="attention_chunk_tokens must be an int >= 1"):
        reviva.finetune(model, device="cpu", attention_chunk_tokens=bad)  # type: ignore[arg-type]


def gpu_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=101,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


@pytest.mark.gpu
def test_gpu_causal_lower_right_with_gqa_equals_the_rows_of_whole_attention() -> None:
    """CUDA, bf16, head_dim 32, 8 heads over 2: each chunk's attention (flash under
    causal_lower_right with enable_gqa, or K/V expanded) equals the same rows of SDPA's causal
    attention over the whole sequence (fp32), within bf16 rounding."""
    from reviva.chunked_attention import _attend

    torch.manual_seed(0)
    q = torch.randn(1, 8, 1500, 32, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 2, 1500, 32, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, 2, 1500, 32, device="cuda", dtype=torch.bfloat16)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), is_causal=True, enable_gqa=True
    )
    for s, e in chunk_spans(1500, 512):
        got = _attend(q[:, :, s:e], k[:, :, :e], v[:, :, :e], 32**-0.5, 4)
        err = (got.float() - ref[:, :, s:e]).abs().max().item()
        assert err < 2e-2, (s, e, err)


@pytest.mark.gpu
def test_gpu_bf16_chunked_attention_close_to_plain_and_to_fp32() -> None:
    """CUDA, bf16, 4 layers (hidden 256, 8 heads over 2 K/V heads), LoRA on q, k, v, o and
    down_proj, 3072 tokens with the attention by chunks of 512: the LoRA gradients of two steps
    no further from an fp32 run's than 1.5 times the plain bf16 run's distance plus a bf16
    rounding of the largest; the attention ran by chunks."""
    targets = (*ALL, "down_proj")
    fp32 = lora(gpu_model(seed=12), targets).cuda()
    runs = {
        "fp32": fp32,
        "plain": copy.deepcopy(fp32).to(torch.bfloat16),
        "ours": copy.deepcopy(fp32).to(torch.bfloat16),
    }
    tokens = 3072
    tuner = reviva.finetune(
        runs["ours"], chunk_tokens=1024, loss_chunk_tokens=512, attention_chunk_tokens=512
    )
    calls = Calls(tuner)
    try:
        for s in range(2):
            data = batch(seed=60 + s, tokens=tokens, device="cuda")
            grads = {name: step(m, data, lr=0.0)[1] for name, m in runs.items()}
            assert_bf16_as_close_as_plain(grads, s)
        assert calls.n == [2 * 3 * 6] * 4, calls.n
    finally:
        calls.remove()
        tuner.close()
        runs.clear()
        gc.collect()
