"""fp8 K/V (RevivaConfig(kv_dtype="fp8"), Note [fp8 K/V rows]): the round trip within its stated
bound, generate against plain HF (lossy: the tiny
models' logits within a few percent, flips only at near-ties), half the bytes, and the errors
it refuses."""

from __future__ import annotations

import pytest
import torch
from test_generate import FAMILIES, MOE_FAMILIES, budget_for, gpu_llama, tiny_model

import reviva
from reviva import RevivaConfig, RevivaManager, kv_fp8
from reviva.planner import device_state, make_plan, smallest_budget


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_within_the_stated_bound(dtype: torch.dtype) -> None:
    """Gaussian rows, rows with one outlier, tiny values, zeros and exact e4m3 values: every
    element within round_trip_bound; exact values and zero rows come back exactly."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 50, 64, generator=g)
    x[0, 0, 0, 5] = 300.0  # an outlier: its row's scale grows, the others' do not
    x[1, 2, 3] = 1e-6 * torch.randn(64, generator=g)  # tiny: relative to their own amax
    x[2, 1, 7] = 0.0
    x = x.to(dtype)
    rows = kv_fp8.quantize(x)
    assert rows.dtype == torch.uint8 and rows.shape == (3, 4, 50, 68)
    back = kv_fp8.dequantize(rows, dtype)
    assert back.dtype == dtype
    err = (back.float() - x.float()).abs()
    bound = kv_fp8.round_trip_bound(x, dtype)
    assert bool((err <= bound).all()), float((err - bound).max())
    assert torch.equal(back[2, 1, 7], torch.zeros(64, dtype=dtype))
    # the bound is not vacuous: the error reaches a good part of it somewhere
    assert float((err / bound.clamp_min(1e-30)).max()) > 0.2
    exact = torch.tensor([[448.0, -448.0, 1.0, 0.5, 0.0, 2.0, 3.5, -0.25]]).to(dtype)
    assert torch.equal(kv_fp8.dequantize(kv_fp8.quantize(exact), dtype), exact)
    assert 0.005 < kv_fp8.relative_error(x[0]) < 0.05


def test_strided_rows_as_the_store_holds_them() -> None:
    """Rows seen through the store's token-major layout (strided views) dequantize as their
    contiguous copies do."""
    x = torch.randn(2, 30, 3, 16, generator=torch.Generator().manual_seed(1))  # [B, T, H, D]
    rows = kv_fp8.quantize(x)  # [B, T, H, 20]
    strided = rows.transpose(1, 2)  # [B, H, T, 20], not contiguous
    assert not strided.is_contiguous()
    a = kv_fp8.dequantize(strided, torch.float32)
    b = kv_fp8.dequantize(strided.contiguous(), torch.float32)
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="head_dim must be a multiple of 4, got 6"):
        kv_fp8.quantize(torch.randn(2, 6))


def store_rows(device: str, tokens: int = 53) -> torch.Tensor:
    """fp8 rows laid out as the store holds them, [tokens, 2 (K, V), batch 2, kv heads 3, row],
    values of every magnitude (e4m3 subnormals too) and an all-zero vector."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(tokens, 2, 2, 3, 64, generator=g) * torch.logspace(-6, 3, 64)
    x[0, 0, 0, 0] = 0.0
    return kv_fp8.quantize(x).to(device)


def check_dequantize_kernel(device: str) -> None:
    runtime = reviva.device_resources(device).runtime
    rows = store_rows(device)
    for dtype in (torch.bfloat16, torch.float16):
        for view in (rows[:, 0], rows[:, 1], rows[5:40, 0, 1], rows[:, 0, :, 2], rows[7, 1]):
            want = kv_fp8.dequantize(view, dtype)  # torch's ops
            got = kv_fp8.dequantize(view, dtype, runtime)  # the core's kernel
            assert got.dtype == dtype and got.shape == want.shape
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (dtype, view.shape)


def test_dequantize_kernel_gives_torchs_bits_and_names_bad_input() -> None:
    """The core's fp8 dequantization (the host backend's here, the CUDA kernel on the GPU):
    the same bits as kv_fp8's torch ops for every view of the store's layout, in bf16 and fp16;
    tensors it cannot take are named."""
    check_dequantize_kernel("cpu")
    runtime = reviva.device_resources("cpu").runtime
    rows = store_rows("cpu")
    out = torch.empty(53, 2, 3, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="out must be contiguous of shape"):
        runtime.dequantize_fp8_rows(rows[:, 0], out[:, :1])
    with pytest.raises(ValueError, match="out must be bfloat16 or float16"):
        runtime.dequantize_fp8_rows(rows[:, 0], out.float())
    with pytest.raises(ValueError, match="rows must be uint8"):
        runtime.dequantize_fp8_rows(rows[:, 0].to(torch.int8), out)
    with pytest.raises(ValueError, match="1 to 4 dimensions"):
        runtime.dequantize_fp8_rows(rows, torch.empty(53, 2, 2, 3, 64, dtype=torch.bfloat16))
    flat = rows.flatten()
    odd = flat[1 : 1 + 68 * 10].view(10, 68)  # rows starting one byte off
    with pytest.raises(ValueError, match="not 4-byte aligned"):
        runtime.dequantize_fp8_rows(odd, torch.empty(10, 64, dtype=torch.bfloat16))
    # kv_fp8.dequantize takes torch's ops for such a view: the same bits as the kernel's
    assert not kv_fp8._kernel_takes(odd, torch.bfloat16)
    assert kv_fp8._kernel_takes(odd.clone(), torch.bfloat16)
    got = kv_fp8.dequantize(odd, torch.bfloat16, runtime)
    assert torch.equal(got, kv_fp8.dequantize(odd.clone(), torch.bfloat16, runtime))


@pytest.mark.gpu
def test_gpu_dequantize_kernel_gives_torchs_bits() -> None:
    """The CUDA kernel against kv_fp8's torch ops, bit for bit, on the store's views."""
    check_dequantize_kernel("cuda")


def assert_close_to_exact(out, ref, prompt: int, tol: float = 0.05) -> int:  # noqa: ANN001
    """fp8 is lossy: per sequence, the logits of every step whose context is still plain HF's
    are within `tol` of HF's (relative, per step); where the greedy token first differs, HF's
    own logits had a near-tie (a margin under 2 tol ||logits||, the most such an error can
    flip). Returns the steps compared."""
    compared = 0
    for b in range(ref.sequences.shape[0]):
        differ = (out.sequences[b, prompt:] != ref.sequences[b, prompt:]).nonzero()
        last = int(differ[0]) if len(differ) else len(ref.logits) - 1
        for t in range(last + 1):
            a, r = out.logits[t][b].float(), ref.logits[t][b].float()
            err = float((a - r).norm() / r.norm())
            assert err < tol, (b, t, err)
            compared += 1
        if len(differ):
            r = ref.logits[last][b].float()
            mine, theirs = (
                int(out.sequences[b, prompt + last]),
                int(ref.sequences[b, prompt + last]),
            )
            assert float(r[theirs] - r[mine]) <= 2 * tol * float(r.norm()), (b, last)
    return compared


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("layers", "chunk", "block"), [(99, 32, 40), (2, 48, 17), (1, 150, 1000)])
def test_generate_with_fp8_kv(family: str, layers: int, chunk: int, block: int) -> None:
    """Every family, all resident down to one slot, blocks of 17 to 1000 tokens, twice in a row:
    logits within 5% of plain HF's while the context is the same (15% with experts), flips only
    at near-ties, and most of the 24 steps compared; the stats report the format and its
    error."""
    model = tiny_model(family)
    ids = torch.randint(1, 211, (2, 150), generator=torch.Generator().manual_seed(1))
    kwargs = dict(max_new_tokens=24, do_sample=False, output_logits=True)
    ref = model.generate(ids, return_dict_in_generate=True, **kwargs)
    kw = dict(chunk_tokens=chunk, kv_block_tokens=block)
    budget = budget_for(model, 2, 150, 24, layers, chunk, kv_dtype="fp8", kv_block_tokens=block)
    manager = RevivaManager(model, RevivaConfig(vram_budget=budget, kv_dtype="fp8", **kw))
    first = None
    tol = 0.15 if family in MOE_FAMILIES else 0.05  # (MOE_FAMILIES says why)
    for _ in range(2):
        out = manager.generate(ids, return_dict_in_generate=True, **kwargs)
        assert assert_close_to_exact(out, ref, 150, tol) >= 24  # at least one sequence's worth
        if first is None:
            first = out.sequences
        assert torch.equal(out.sequences, first)  # the same call gives the same tokens
        st = manager.get_memory_stats()
        assert st["kv_dtype"] == "fp8" and st["kv_block_tokens"] == block
        assert 0.005 < st["kv_fp8_rel_error"] < 0.05, st["kv_fp8_rel_error"]
        if layers < 5:
            assert st["streamed_layers"] > 0, st
        # (the returned cache's rows are parked in pinned memory until dropped: Note [A
        # returned cache] in kv_cache.py; nothing else of the call stays there)
        assert out.past_key_values.parked_bytes > 0
        del out
        assert reviva.pinned_memory_stats()["bytes_in_use"] == 0


def test_fp8_holds_more_layers_in_the_same_budget() -> None:
    """A budget that keeps 2 layers' fp32 K/V (and 1 MiB for fp8's block temporaries) holds
    more layers of fp8 rows (1 byte a value and 4 per 16-value head here, against 4 a value)."""
    model = tiny_model("llama")
    manager = RevivaManager(model)
    state = device_state(manager.layout, manager.arena)
    cfg = dict(chunk_tokens=32, prefill_attention="chunked", prefill_residual="device")

    def held(p):  # noqa: ANN001, ANN202
        return len(p.resident_layers) + p.slots

    # 32k tokens: a layer's K/V is many arena granules (8 MiB in fp32), so bytes, not rounding,
    # decide how many fit.
    n = 32768
    budget = smallest_budget(
        manager.layout, RevivaConfig(**cfg), state, 1, n, 24, lambda p: held(p) >= 2
    )
    budget += 1 << 20
    wide = make_plan(manager.layout, RevivaConfig(vram_budget=budget, **cfg), state, 1, n, 24)
    narrow = make_plan(
        manager.layout,
        RevivaConfig(vram_budget=budget, kv_dtype="fp8", kv_block_tokens=256, **cfg),
        state,
        1,
        n,
        24,
    )
    assert narrow.kv_token_bytes * 3 < wide.kv_token_bytes
    assert narrow.kv_fp8 and not narrow.whole_attention
    assert held(narrow) > held(wide)


def test_fp8_refusals() -> None:
    model = tiny_model("qwen2")
    ids = torch.randint(1, 211, (1, 40), generator=torch.Generator().manual_seed(5))
    manager = RevivaManager(model, RevivaConfig(kv_dtype="fp8"))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    with pytest.raises(ValueError, match="padded batch with RevivaConfig\\(kv_dtype='fp8'\\)"):
        manager.generate(ids, attention_mask=mask, max_new_tokens=4)
    with pytest.raises(ValueError, match="kv_dtype must be 'auto' or 'fp8', got 'int4'"):
        RevivaConfig(kv_dtype="int4")
    with pytest.raises(ValueError, match="kv_block_tokens must be an int > 0 or None, got 0"):
        RevivaConfig(kv_block_tokens=0)
    ref = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(manager.generate(ids, max_new_tokens=4, do_sample=False), ref)


@pytest.mark.gpu
def test_gpu_fp8_decode_logits_against_bf16() -> None:
    """CUDA, bf16, 8k prompt: fp8 K/V decode logits against bf16 K/V's (the relative errors are
    in the assertion message), flash attention per block."""
    model = gpu_llama(4, 16384, torch.bfloat16)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    ids = torch.randint(1, 32000, (1, 8192), device="cuda")
    kw = dict(max_new_tokens=16, do_sample=False, output_logits=True, return_dict_in_generate=True)
    outs = {}
    for kv in ("auto", "fp8"):
        m = RevivaManager(model, RevivaConfig(kv_dtype=kv, kv_block_tokens=3000))
        outs[kv] = m.generate(ids, **kw)
    errs = [
        float((a.float() - b.float()).norm() / b.float().norm())
        for a, b in zip(outs["fp8"].logits, outs["auto"].logits, strict=True)
    ]
    # while the context agrees, within 5%; a flip only at a near-tie of bf16's own logits
    assert assert_close_to_exact(outs["fp8"], outs["auto"], 8192) >= 1, errs
