"""The decode row operations (Runtime.rms_norm, rotary, silu_mul; Note [Decode row ops]) against
the HF modules they replace, on the host backend and CUDA; a layer's step on them
(reviva.generate.decode_ops.RowOpsStep) against LlamaLayerPath's with HF's modules, and which layers
are refused; on the GPU, fp8 generate with and without them in the decode graphs."""

from __future__ import annotations

import logging

import pytest
import torch
from test_generate import gpu_llama, tiny_model
from test_kv_fp8 import assert_close_to_exact
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from reviva import RevivaConfig, RevivaManager
from reviva.adapters import inspect_model
from reviva.generate.decode_ops import RowOpsStep, unsupported
from reviva.generate.llama_layer import LlamaLayerPath

DTYPES = [torch.bfloat16, torch.float16]


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The most units in the last place between two 16-bit tensors of one dtype."""
    ia = a.contiguous().view(torch.int16).int()
    ib = b.contiguous().view(torch.int16).int()
    ia = torch.where(ia < 0, -(ia & 0x7FFF), ia)
    ib = torch.where(ib < 0, -(ib & 0x7FFF), ib)
    return int((ia - ib).abs().max())


def close_in_rounding(a: torch.Tensor, b: torch.Tensor) -> bool:
    """a within two units of its dtype's rounding of b, relative (a weight times a normalized
    value one unit off can be a few units off)."""
    eps = 2.0**-7 if a.dtype == torch.bfloat16 else 2.0**-10
    a, b = a.float(), b.float()
    return bool(((a - b).abs() <= 2 * eps * b.abs() + 1e-6).all())


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_is_hfs_rmsnorm_with_the_residual_folded_in(runtime, device, dtype) -> None:  # noqa: ANN001
    """Weights of +-0.5, 1, 2 (their products exact): within one unit of HF's LlamaRMSNorm (the
    sum of squares in another order); then random weights: within rounding."""
    g = torch.Generator().manual_seed(0)
    norm = LlamaRMSNorm(4096, eps=1e-5).to(device, dtype)
    choices = torch.tensor([0.5, 1.0, 2.0, -1.0, -0.5])
    with torch.no_grad():
        norm.weight.copy_(choices[torch.randint(0, 5, (4096,), generator=g)].to(device, dtype))
    # rows of a larger buffer: strided
    x = (torch.randn(3, 4100, generator=g) * 3).to(device, dtype)[:, :4096]
    residual = (torch.randn(3, 4096, generator=g) * 2).to(device, dtype)
    out = torch.empty(3, 4096, dtype=dtype, device=device)
    runtime.rms_norm(x, norm.weight, norm.variance_epsilon, out)
    assert ulps(out, norm(x)) <= 1
    want_sum = residual + x
    want = norm(want_sum)
    runtime.rms_norm(x, norm.weight, norm.variance_epsilon, out, residual=residual)
    assert torch.equal(residual, want_sum)  # (the sum written back, rounded as torch rounds)
    assert ulps(out, want) <= 1
    # in place: out is x
    y = x.clone()
    runtime.rms_norm(y, norm.weight, norm.variance_epsilon, y)
    assert ulps(y, norm(x)) <= 1
    with torch.no_grad():
        norm.weight.copy_(torch.randn(4096, generator=g).to(device, dtype))
    runtime.rms_norm(x, norm.weight, norm.variance_epsilon, out)
    assert close_in_rounding(out, norm(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_is_hfs_apply_rotary_pos_emb_to_the_bit(runtime, device, dtype) -> None:  # noqa: ANN001
    g = torch.Generator().manual_seed(1)
    batch, heads, kv, dim = 2, 8, 2, 128
    # q and k as views of one projection's output, as a fused q/k/v layer would give them
    qkv = torch.randn(batch, 1, (heads + 2 * kv) * dim, generator=g).to(device, dtype)
    q = qkv[..., : heads * dim].view(batch, 1, heads, dim)
    k = qkv[..., heads * dim : (heads + kv) * dim].view(batch, 1, kv, dim)
    cos = torch.randn(batch, 1, dim, generator=g).to(device, dtype)
    sin = torch.randn(batch, 1, dim, generator=g).to(device, dtype)
    want_q, want_k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    runtime.rotary(q[:, 0], k[:, 0], cos[:, 0], sin[:, 0])
    assert torch.equal(q.transpose(1, 2), want_q)
    assert torch.equal(k.transpose(1, 2), want_k)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_is_the_gated_mlps_activation(runtime, device, dtype) -> None:  # noqa: ANN001
    g = torch.Generator().manual_seed(2)
    gate = (torch.randn(2, 1, 14336, generator=g) * 4).to(device, dtype)
    up = torch.randn(2, 1, 14336, generator=g).to(device, dtype)
    want = torch.nn.functional.silu(gate) * up
    out = torch.empty_like(gate)
    runtime.silu_mul(gate, up, out)
    assert ulps(out, want) <= 1
    runtime.silu_mul(gate, up, gate)  # into gate
    assert ulps(gate, want) <= 1


def test_row_ops_name_bad_tensors(runtime, device) -> None:  # noqa: ANN001
    x = torch.randn(2, 64, device=device, dtype=torch.bfloat16)
    w = torch.ones(64, device=device, dtype=torch.bfloat16)
    out = torch.empty_like(x)
    with pytest.raises(ValueError, match="rms_norm: x must be bfloat16 or float16"):
        runtime.rms_norm(x.float(), w, 1e-6, out)
    with pytest.raises(ValueError, match=r"rms_norm: out must have shape \[2, 64\]"):
        runtime.rms_norm(x, w, 1e-6, out[:1])
    with pytest.raises(ValueError, match="rms_norm: weight must be a dense"):
        runtime.rms_norm(x, w[:32], 1e-6, out)
    with pytest.raises(ValueError, match="out must not be the residual"):
        runtime.rms_norm(x, w, 1e-6, out, residual=out)
    with pytest.raises(ValueError, match="eps must be >= 0"):
        runtime.rms_norm(x, w, -1.0, out)
    with pytest.raises(ValueError, match="last dimension must be dense"):
        runtime.rms_norm(x.t(), w[:2], 1e-6, torch.empty(64, 2, device=device, dtype=x.dtype))
    q = torch.randn(1, 4, 7, device=device, dtype=torch.bfloat16)
    cs = torch.randn(1, 7, device=device, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="head_dim must be even"):
        runtime.rotary(q, q[:, :1], cs, cs)
    q = torch.randn(1, 4, 8, device=device, dtype=torch.bfloat16)
    with pytest.raises(
        ValueError, match=r"rotary: cos must be a .* tensor \[batch 1, head_dim 8\]"
    ):
        runtime.rotary(q, q[:, :1], cs, cs)
    with pytest.raises(ValueError, match="silu_mul: up must have shape"):
        runtime.silu_mul(x, x[:1], out)
    other = "cpu" if device != "cpu" else None
    if other is None and torch.cuda.is_available():
        other = "cuda"
    if other is not None:
        with pytest.raises(ValueError, match="silu_mul: up must be a"):
            runtime.silu_mul(x, x.to(other), out)


def layer_steps(family: str, dtype: torch.dtype):  # noqa: ANN201
    """A tiny model's layout, its first layer, a step's hidden state and position embedding."""
    model = tiny_model(family).to(dtype)
    layout = inspect_model(model)
    g = torch.Generator().manual_seed(3)
    h = torch.randn(2, 1, layout.hidden_size, generator=g).to(dtype)
    pos = torch.tensor([[37], [5]])
    cos, sin = layout.rotary_emb(h, pos)
    return model, layout, h, cos, sin


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "qwen3", "smollm3"])
def test_a_layers_step_on_row_ops_is_hfs(family: str) -> None:
    """q, k, v and the finished hidden state of every layer against LlamaLayerPath's with HF's
    modules (Qwen3's q/k norms and SmolLM3's NoPE layers included): q, k, v to one unit of bf16
    (the input norm's sum order), h close; agrees() says so."""
    model, layout, h, cos, sin = layer_steps(family, torch.bfloat16)
    path = LlamaLayerPath(layout)
    step = RowOpsStep(layout, torch.device("cpu"))
    att = torch.randn(2, 1, layout.num_heads, layout.head_dim).to(torch.bfloat16)
    with torch.no_grad():
        for i, layer in enumerate(layout.layers):
            assert unsupported(layer, layout, torch.bfloat16, cos) is None
            theirs = path._qkv(layer, h, 0, 1, cos, sin)
            ours = step.qkv(layer, h, cos, sin)
            for a, b in zip(ours, theirs, strict=True):
                assert a.shape == b.shape
                scale = float(b.float().abs().max())
                assert float((a.float() - b.float()).abs().max()) <= 0.02 * scale, (i, family)
            h1, h2 = h.clone(), h.clone()
            path._finish(layer, h1, 0, 1, att)
            step.finish(layer, h2, att)
            assert float((h1.float() - h2.float()).abs().max()) <= 0.02 * float(h1.abs().max())
            assert step.agrees(path, layer, h, cos, sin, att) is None


def test_layers_the_row_ops_do_not_fit_are_named() -> None:
    _, layout, h, cos, _ = layer_steps("gemma2", torch.bfloat16)
    why = unsupported(layout.layers[0], layout, torch.bfloat16, cos)
    assert why is not None and "Gemma" in why
    _, layout, h, cos, _ = layer_steps("phi3", torch.bfloat16)
    assert "one q/k/v projection" in unsupported(layout.layers[0], layout, torch.bfloat16, cos)
    _, layout, h, cos, _ = layer_steps("llama", torch.float32)
    assert "float32" in unsupported(layout.layers[0], layout, torch.float32, cos)
    _, layout, h, cos, _ = layer_steps("mixtral", torch.bfloat16)
    assert "gated MLP" in unsupported(layout.layers[0], layout, torch.bfloat16, cos)
    # RoPE over part of a head
    _, layout, h, cos, _ = layer_steps("llama", torch.bfloat16)
    assert "part of a head" in unsupported(layout.layers[0], layout, torch.bfloat16, cos[..., :8])


def test_agrees_finds_a_norm_of_another_formula() -> None:
    """A layer whose norm has Llama's attributes but another formula (Gemma's 1 + weight) is
    found by the check on random input, naming what differed."""
    model, layout, h, cos, sin = layer_steps("llama", torch.bfloat16)
    layer = layout.layers[0]

    class OnePlusWeight(LlamaRMSNorm):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x32 = x.float()
            x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            return ((1.0 + self.weight.float()) * x32).to(x.dtype)

    norm = OnePlusWeight(layout.hidden_size, eps=1e-6).to(torch.bfloat16)
    layer.input_layernorm = norm
    assert unsupported(layer, layout, torch.bfloat16, cos) is None  # (its attributes fit)
    att = torch.randn(2, 1, layout.num_heads, layout.head_dim).to(torch.bfloat16)
    step = RowOpsStep(layout, torch.device("cpu"))
    with torch.no_grad():
        why = step.agrees(LlamaLayerPath(layout), layer, h, cos, sin, att)
    assert why is not None and why.startswith("q differs from HF's modules'"), why


@pytest.mark.gpu
def test_gpu_fp8_decode_graphs_on_row_ops_against_hfs_modules(monkeypatch, caplog) -> None:  # noqa: ANN001
    """CUDA, bf16, fp8 K/V, 2k prompt, decode graphs: with the row ops (every layer's graph
    runs them) and without (REVIVA_DECODE_ROW_OPS=off): logits within fp8's tolerance of each
    other while the tokens agree, twice in a row each; then a model whose norms have another
    formula keeps HF's modules, named in the log, and gives what the switch's off gives."""
    model = gpu_llama(4, 4096, torch.bfloat16)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    ids = torch.randint(1, 32000, (2, 2048), generator=torch.Generator().manual_seed(4)).cuda()
    kw = dict(max_new_tokens=24, do_sample=False, output_logits=True, return_dict_in_generate=True)
    outs = {}
    for mode in ("off", "on"):
        monkeypatch.setenv("REVIVA_DECODE_ROW_OPS", mode)
        m = RevivaManager(model, RevivaConfig(kv_dtype="fp8"))
        runs = [m.generate(ids, **kw) for _ in range(2)]
        assert torch.equal(runs[0].sequences, runs[1].sequences)
        graphs = m._graphs
        assert graphs is not None and len(graphs.fused) == 4, m.get_memory_stats()["decode_graphs"]
        assert len(graphs.row_ops) == (4 if mode == "on" else 0)
        outs[mode] = runs[0]
        del m, runs, graphs
    assert assert_close_to_exact(outs["on"], outs["off"], 2048, 0.02) >= 24

    class OnePlusWeight(LlamaRMSNorm):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) + x * 0.5

    # (as a model's own class: uncapturable() lets graphs replay transformers' modules alone)
    OnePlusWeight.__module__ = LlamaRMSNorm.__module__

    for layer in model.model.layers:
        old = layer.post_attention_layernorm
        layer.post_attention_layernorm = OnePlusWeight(old.weight.shape[0], old.variance_epsilon)
        layer.post_attention_layernorm.to("cuda", torch.bfloat16).eval()
    monkeypatch.setenv("REVIVA_DECODE_ROW_OPS", "off")
    ref = RevivaManager(model, RevivaConfig(kv_dtype="fp8")).generate(ids, **kw)
    monkeypatch.setenv("REVIVA_DECODE_ROW_OPS", "on")
    m = RevivaManager(model, RevivaConfig(kv_dtype="fp8"))
    with caplog.at_level(logging.INFO, logger="reviva.decode_graphs"):
        out = m.generate(ids, **kw)
    assert len(m._graphs.fused) == 4 and not m._graphs.row_ops
    assert "keeps HF's modules (h differs from HF's modules'" in caplog.text
    # refused, the step is the one REVIVA_DECODE_ROW_OPS=off runs (fp8 against plain HF is
    # judged by test_kv_fp8; these norms' scale moves fp8's error beyond its 5% there)
    assert torch.equal(out.sequences, ref.sequences)
    assert assert_close_to_exact(out, ref, 2048, 0.01) >= 24
