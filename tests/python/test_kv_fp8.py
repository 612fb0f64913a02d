"""fp8 K/V (RevivaConfig(kv_dtype="fp8"), Note [fp8 K/V rows]): the round trip within its stated
bound, generate against plain HF (lossy: the tiny
models' logits within a few percent, flips only at near-ties), half the bytes, and the errors
it refuses."""

from __future__ import annotations

import contextlib

import pytest
import torch
from test_generate import FAMILIES, MOE_FAMILIES, budget_for, gpu_llama, tiny_model

import reviva
from reviva import RevivaConfig, RevivaManager
from reviva.cache import fp8 as kv_fp8
from reviva.plan.memory_state import device_state
from reviva.plan.planner import make_plan, smallest_budget


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


def fp8_cache(device: str, batch: int, kv_heads: int, head_dim: int, capacity: int, **kw):  # noqa: ANN003, ANN201
    """A one-layer fp8 RevivaCache on the device's shared resources, the layer resident."""
    from reviva.cache.kv_cache import RevivaCache

    res = reviva.device_resources(device)
    return RevivaCache(
        res.engine,
        res.arena,
        1,
        batch,
        kv_heads,
        head_dim,
        torch.bfloat16,
        capacity,
        [0],
        0,
        1,
        kv_fp8=True,
        block_tokens=64,
        runtime=res.runtime,
        device=torch.device(device),
        **kw,
    )


def check_fused_decode(device: str) -> None:
    """Note [fp8 decode attention]: prompts written as rows, then decode steps through the core's
    fused call against the same steps through the blocks of dequantized rows (write, then
    attend_cache's block merge): the new token's rows to the bit (kv_fp8.quantize's, on the
    device's own torch ops), the output within bf16/fp16 rounding of fp32 attention, with and
    without a sliding window, GQA groups of 1, 3 and 4, head_dim 64 and 128, many keys."""
    from reviva.generate.layer_attention import attend_cache

    g = torch.Generator().manual_seed(3)
    for batch, heads, kv_heads, dim, prompt, window, dtype in [
        (2, 6, 2, 64, 300, None, torch.bfloat16),
        (1, 8, 2, 128, 2100, None, torch.float16),
        (1, 4, 4, 64, 90, 33, torch.bfloat16),
    ]:
        fused = fp8_cache(device, batch, kv_heads, dim, prompt + 4)
        blocks = fp8_cache(device, batch, kv_heads, dim, prompt + 4)
        k = torch.randn(batch, kv_heads, prompt, dim, generator=g).to(device, dtype)
        v = torch.randn(batch, kv_heads, prompt, dim, generator=g).to(device, dtype)
        for c in (fused, blocks):
            c.acquire(0)
            c.write(0, 0, k, v)
            c.release(0)
        scale = dim**-0.5
        for step in range(3):
            first = prompt + step
            q = torch.randn(batch, heads, 1, dim, generator=g).to(device, dtype)
            kn = 3 * torch.randn(batch, kv_heads, 1, dim, generator=g).to(device, dtype)
            vn = torch.randn(batch, kv_heads, 1, dim, generator=g).to(device, dtype)
            fused.acquire(0)
            assert fused.attends_fp8_in_place(0, q, None)
            got = fused.attend_fp8_decode(0, first, q, kn, vn, scale, window)
            rows = [r.clone() for r in fused.rows(0, first + 1)]
            fused.release(0)
            blocks.acquire(0)
            blocks.write(0, first, kn, vn)
            lo = 0 if window is None else max(first + 1 - window, 0)
            k_all, v_all = blocks.rows(0, first + 1)
            want_rows = [r.clone() for r in (k_all, v_all)]
            kd = kv_fp8.dequantize(k_all[:, :, lo:], torch.float32)
            vd = kv_fp8.dequantize(v_all[:, :, lo:], torch.float32)
            ref = torch.nn.functional.scaled_dot_product_attention(
                q.float(), kd, vd, scale=scale, enable_gqa=True
            )
            if window is None:
                merged = attend_cache(blocks, 0, q, first, first + 1, scale, None)
                assert (merged.float() - ref).abs().max() <= 0.02 * ref.abs().max()
            blocks.release(0)
            assert got.shape == q.shape and got.dtype == dtype
            for mine, theirs in zip(rows, want_rows, strict=True):
                assert torch.equal(mine.cpu(), theirs.cpu()), "the new token's rows"
            eps = 2**-8 if dtype == torch.bfloat16 else 2**-11
            err = (got.float() - ref).abs()
            assert bool((err <= eps * ref.abs() + 1e-3 * ref.abs().max()).all()), float(err.max())
        fused.close()
        blocks.close()


def check_graphed_decode(device: str) -> None:
    """Note [fp8 attention in the decode graphs]: the graphed call (the step's length and the
    rows' addresses read from device memory when the kernels run), captured in a CUDA graph on
    CUDA and replayed step after step, gives the eager call's rows and outputs to the bit."""
    g = torch.Generator().manual_seed(9)
    batch, heads, kv_heads, dim, prompt, steps = 1, 8, 2, 64, 700, 4
    eager = fp8_cache(device, batch, kv_heads, dim, prompt + steps)
    graphed = fp8_cache(device, batch, kv_heads, dim, prompt + steps)
    k = torch.randn(batch, kv_heads, prompt, dim, generator=g).to(device, torch.bfloat16)
    for c in (eager, graphed):
        c.acquire(0)
        c.reserve(0, prompt + steps)
        c.write(0, 0, k, k.flip(-1))
    qs = torch.randn(steps, batch, heads, 1, dim, generator=g).to(device, torch.bfloat16)
    ks = torch.randn(steps, batch, kv_heads, 1, dim, generator=g).to(device, torch.bfloat16)
    vs = torch.randn(steps, batch, kv_heads, 1, dim, generator=g).to(device, torch.bfloat16)
    q, kn, vn = qs[0].clone(), ks[0].clone(), vs[0].clone()  # the graph's static inputs
    out = torch.empty_like(q)
    length = torch.ones(1, dtype=torch.int64, device=device)
    rows = torch.tensor(graphed.store.rows_address(0), dtype=torch.int64, device=device)
    scale = dim**-0.5

    def call() -> None:
        graphed.store.attend_fp8_decode_graphed(0, q, kn, vn, scale, 0, length, rows, out)

    graph = None
    if device == "cuda":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=side):
                call()
        torch.cuda.current_stream().wait_stream(side)
    for step in range(steps):
        first = prompt + step
        want = eager.attend_fp8_decode(0, first, qs[step], ks[step], vs[step], scale)
        q.copy_(qs[step])
        kn.copy_(ks[step])
        vn.copy_(vs[step])
        length.fill_(first + 1)
        if graph is not None:
            graph.replay()
        else:
            call()
        graphed.store.wrote(0, first, 1)
        assert torch.equal(out, want), step
        for a, b in zip(graphed.rows(0, first + 1), eager.rows(0, first + 1), strict=True):
            assert torch.equal(a, b), step
    for c in (eager, graphed):
        c.release(0)
        c.close()


def test_fused_fp8_decode_attention_against_blocks_and_names_bad_input() -> None:
    """The host backend's fused fp8 decode attention (the CUDA kernel's reference) against the
    block path; bad tensors are refused by name."""
    check_fused_decode("cpu")
    check_graphed_decode("cpu")
    c = fp8_cache("cpu", 1, 2, 64, 16)
    q = torch.zeros(1, 4, 1, 64, dtype=torch.bfloat16)
    kv = torch.zeros(1, 2, 1, 64, dtype=torch.bfloat16)
    c.acquire(0)
    with pytest.raises(ValueError, match="q must be bfloat16 or float16"):
        c.attend_fp8_decode(0, 0, q.float(), kv, kv, 1.0)
    with pytest.raises(ValueError, match="key and value must be \\[1, 2, 1, 64\\]"):
        c.attend_fp8_decode(0, 0, q, kv.half(), kv, 1.0)
    with pytest.raises(ValueError, match="17 tokens exceed layer 0's capacity of 16"):
        c.attend_fp8_decode(0, 16, q, kv, kv, 1.0)
    with pytest.raises(ValueError, match="out must be \\[1, 4, 1, 64\\]"):
        c.attend_fp8_decode(0, 0, q, kv, kv, 1.0, out=torch.empty(1, 4, 1, 32, dtype=q.dtype))
    length, rows = torch.ones(1, dtype=torch.int64), torch.tensor(c.store.rows_address(0))
    out = torch.empty_like(q)
    graphed = c.store.attend_fp8_decode_graphed
    with pytest.raises(ValueError, match="length must be one int64"):
        graphed(0, q, kv, kv, 1.0, 0, length.int(), rows, out)
    with pytest.raises(ValueError, match="rows must be two contiguous int64"):
        graphed(0, q, kv, kv, 1.0, 0, length, rows[:1], out)
    with pytest.raises(ValueError, match="window must be >= 0"):
        graphed(0, q, kv, kv, 1.0, -1, length, rows, out)
    # (a length read when the step runs, beyond the capacity: NaN out, rows left as they were)
    c.reserve(0, 16)
    before = [r.clone() for r in c.rows(0, 16)]
    graphed(0, q, kv, kv, 1.0, 0, torch.tensor([17]), rows, out)
    assert bool(out.isnan().all())
    assert all(torch.equal(a, b) for a, b in zip(c.rows(0, 16), before, strict=True))
    assert not c.attends_fp8_in_place(0, q.float(), None)
    assert not c.attends_fp8_in_place(0, torch.zeros(1, 4, 2, 64, dtype=q.dtype), None)
    c.release(0)
    c.close()


@pytest.mark.gpu
def test_gpu_fused_fp8_decode_attention_against_blocks() -> None:
    """The CUDA kernel: the same checks as on the host backend (its rows to torch's bits), and
    the graphed call captured in a CUDA graph."""
    check_fused_decode("cuda")
    check_graphed_decode("cuda")


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


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2"])
def test_generate_bf16_with_fp8_kv_decodes_through_the_fused_call(family: str) -> None:
    """A bf16 model (its decode steps take the fused call, Note [fp8 decode attention]; an fp32
    model's take the blocks), all resident and streamed: tokens and logits against plain HF in
    bf16 as the fp32 test above holds them, twice in a row."""
    model = tiny_model(family).to(torch.bfloat16)
    ids = torch.randint(1, 211, (2, 150), generator=torch.Generator().manual_seed(1))
    kwargs = dict(max_new_tokens=24, do_sample=False, output_logits=True)
    ref = model.generate(ids, return_dict_in_generate=True, **kwargs)
    calls = []
    from reviva.cache.kv_cache import RevivaCache

    fused = RevivaCache.attend_fp8_decode

    def counted(self, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        calls.append(a[0])
        return fused(self, *a, **kw)

    for layers in (99, 2):
        budget = budget_for(model, 2, 150, 24, layers, 48, kv_dtype="fp8", kv_block_tokens=40)
        cfg = RevivaConfig(vram_budget=budget, kv_dtype="fp8", chunk_tokens=48, kv_block_tokens=40)
        manager = RevivaManager(model, cfg)
        RevivaCache.attend_fp8_decode = counted
        try:
            outs = [manager.generate(ids, return_dict_in_generate=True, **kwargs) for _ in range(2)]
        finally:
            RevivaCache.attend_fp8_decode = fused
        assert torch.equal(outs[0].sequences, outs[1].sequences)
        assert assert_close_to_exact(outs[0], ref, 150, 0.08) >= 24
        # every layer of every decode step after the first (the prompt's step is prefill)
        assert len(calls) == 2 * 23 * model.config.num_hidden_layers, len(calls)
        calls.clear()
        st = manager.get_memory_stats()
        if layers < 5:
            assert st["streamed_layers"] > 0
        else:  # (all resident: the shadow costs no residency, Note [fp8 prefill shadow])
            cfg = model.config
            dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
            kv = cfg.num_key_value_heads * dim  # values of a token's K (or V) per row
            assert st["kv_fp8_prefill_shadow_bytes"] == 2 * 2 * 150 * kv * 2, st


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
        # returned cache] in cache/returned.py; nothing else of the call stays there)
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


def test_fp8_prefill_shadow_only_where_it_costs_no_residency() -> None:
    """Note [fp8 prefill shadow]: a bf16 model's plan keeps the prefill's layer dequantized when
    the budget holds it beside the same residency; at the least budget that keeps every layer
    resident without it, it reads by blocks instead; an fp32 model never takes it."""
    model = tiny_model("llama").to(torch.bfloat16)
    manager = RevivaManager(model)
    lay = manager.layout
    state = device_state(lay, manager.arena)
    n = 65536  # (prefill's working set is the larger one: the shadow adds to it)
    # (blocks of 64 tokens: the shadow of n takes more than the blocks it replaces)
    cfg = dict(kv_dtype="fp8", chunk_tokens=256, prefill_residual="device", kv_block_tokens=64)
    roomy = make_plan(lay, RevivaConfig(vram_budget=1 << 30, **cfg), state, 1, n, 24)
    assert roomy.kv_fp8_shadow_bytes == 2 * n * lay.num_kv_heads * lay.head_dim * 2
    assert len(roomy.resident_layers) == lay.num_layers

    def all_resident(p):  # noqa: ANN001, ANN202
        return len(p.resident_layers) == lay.num_layers

    least = smallest_budget(lay, RevivaConfig(**cfg), state, 1, n, 24, all_resident)
    tight = make_plan(lay, RevivaConfig(vram_budget=least, **cfg), state, 1, n, 24)
    assert all_resident(tight) and tight.kv_fp8_shadow_bytes == 0
    # (with the shadow's bytes more it is taken again)
    budget = least + roomy.kv_fp8_shadow_bytes + (4 << 20)
    again = make_plan(lay, RevivaConfig(vram_budget=budget, **cfg), state, 1, n, 24)
    assert all_resident(again) and again.kv_fp8_shadow_bytes > 0
    fp32 = RevivaManager(tiny_model("llama"))
    plan = make_plan(fp32.layout, RevivaConfig(vram_budget=1 << 30, **cfg), state, 1, n, 24)
    assert plan.kv_fp8 and plan.kv_fp8_shadow_bytes == 0


def test_fp8_prefill_whole_chunked_and_by_blocks_give_the_same_tokens() -> None:
    """Note [fp8 prefill shadow]: a bf16 model's fp8 prefill attending its shadow whole, by
    chunks, or (no shadow) the rows by blocks reads the same values: the same greedy tokens,
    logits within bf16's rounding of each other, twice in a row."""
    from reviva.cache.kv_cache import RevivaCache

    model = tiny_model("llama").to(torch.bfloat16)
    ids = torch.randint(1, 211, (1, 150), generator=torch.Generator().manual_seed(4))
    kw = dict(max_new_tokens=12, do_sample=False, output_logits=True, return_dict_in_generate=True)
    outs = {}
    for mode in ("whole", "chunked"):
        cfg = RevivaConfig(kv_dtype="fp8", chunk_tokens=48, prefill_attention=mode)
        manager = RevivaManager(model, cfg)
        outs[mode] = [manager.generate(ids, **kw) for _ in range(2)]
        assert manager.get_memory_stats()["kv_fp8_prefill_shadow_bytes"] > 0
    shadow = RevivaCache.prefill_shadow

    @contextlib.contextmanager
    def none(self, layer_idx, tokens):  # noqa: ANN001, ANN202
        yield

    RevivaCache.prefill_shadow = none
    try:
        cfg = RevivaConfig(kv_dtype="fp8", chunk_tokens=48, prefill_attention="chunked")
        manager = RevivaManager(model, cfg)
        outs["blocks"] = [manager.generate(ids, **kw) for _ in range(2)]
    finally:
        RevivaCache.prefill_shadow = shadow
    ref = outs["blocks"][0]
    for mode, (first, second) in outs.items():
        assert torch.equal(first.sequences, ref.sequences), mode
        assert torch.equal(second.sequences, first.sequences), mode
        for a, b in zip(first.logits, ref.logits, strict=True):
            assert float((a.float() - b.float()).norm() / b.float().norm()) < 2**-6, mode


def test_fp8_whole_attention_streams_in_prefill_where_decode_keeps_every_layer() -> None:
    """Note [fp8 whole attention]: where whole attention through the shadow fits beside the
    staging slots but not beside every layer's rows, a bf16 model's fp8 plan takes it when decode
    still holds every layer the blocks by chunks would keep: prefill streams them, decode gets
    them back (promoted), the tokens are the chunked plan's, twice in a row; "chunked" keeps
    every layer on the device through prefill at that budget."""
    model = tiny_model("llama").to(torch.bfloat16)
    manager = RevivaManager(model)
    lay = manager.layout
    state = device_state(lay, manager.arena)
    n, new = 8192, 12
    cfg = dict(kv_dtype="fp8", chunk_tokens=128, prefill_residual="device")

    def plan(budget: int, **kw) -> object:  # noqa: ANN003
        return make_plan(lay, RevivaConfig(vram_budget=budget, **cfg, **kw), state, 1, n, new)

    def streams_and_promotes(p) -> bool:  # noqa: ANN001
        return p.whole_attention and 0 < len(p.streamed_layer_ids) <= p.promotable_layers()

    every = lay.num_layers
    chunked_all = smallest_budget(
        lay,
        RevivaConfig(prefill_attention="chunked", **cfg),
        state,
        1,
        n,
        new,
        lambda p: len(p.resident_layers) == every,
    )
    whole_all = smallest_budget(
        lay,
        RevivaConfig(**cfg),
        state,
        1,
        n,
        new,
        lambda p: p.whole_attention and len(p.resident_layers) == every,
    )
    assert whole_all > chunked_all  # (whole attention's queries and output take more)
    budget = next(
        b for b in range(chunked_all, whole_all, 64 << 10) if streams_and_promotes(plan(b))
    )
    p = plan(budget)
    assert p.kv_fp8_shadow_bytes == 2 * n * lay.num_kv_heads * lay.head_dim * 2
    assert not plan(budget, prefill_attention="chunked").whole_attention
    assert len(plan(budget, prefill_attention="chunked").resident_layers) == every

    ids = torch.randint(1, 211, (1, n), generator=torch.Generator().manual_seed(6))
    kw = dict(max_new_tokens=new, do_sample=False, output_logits=True, return_dict_in_generate=True)
    outs = {}
    for mode in ("auto", "chunked"):
        m = RevivaManager(model, RevivaConfig(vram_budget=budget, prefill_attention=mode, **cfg))
        outs[mode] = [m.generate(ids, **kw) for _ in range(2)]
        st = m.get_memory_stats()
        assert st["kv_fp8_prefill_shadow_bytes"] > 0, (mode, st)
        assert st["decode"]["kv_resident_layers"] == every, (mode, st["decode"])
        if mode == "auto":
            assert st["prefill"]["kv_resident_layers"] < every, st["prefill"]
            assert st["promoted_layers"] == every - st["prefill"]["kv_resident_layers"], st
        else:
            assert st["prefill"]["kv_resident_layers"] == every and st["promoted_layers"] == 0
    ref = outs["chunked"][0]
    for first, second in (outs["auto"], outs["chunked"]):
        assert torch.equal(first.sequences, ref.sequences)
        assert torch.equal(second.sequences, first.sequences)
        for a, b in zip(first.logits, ref.logits, strict=True):
            assert float((a.float() - b.float()).norm() / b.float().norm()) < 2**-6


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


@pytest.mark.gpu
def test_gpu_fp8_graphs_of_one_call_are_not_replayed_over_another_capacity() -> None:
    """Note [fp8 attention in the decode graphs]: calls of one manager whose prompts differ in
    length (4096, 4166, 4103, then 4166 again) each give finite logits and a fresh manager's
    tokens and logits for the same call. Before the graphs were captured again for a new
    capacity, the 4166- and 4103-token calls after a 4096-token one gave NaN logits from their
    second decode step (greedy token 0) on the H100."""
    model = gpu_llama(4, 8192, torch.bfloat16)
    kw = dict(max_new_tokens=12, do_sample=False, return_dict_in_generate=True, output_logits=True)
    manager = RevivaManager(model, RevivaConfig(kv_dtype="fp8"))
    for n in (4096, 4166, 4103, 4166):
        g = torch.Generator(device="cuda").manual_seed(n)
        ids = torch.randint(1, 32000, (1, n), device="cuda", generator=g)
        out = manager.generate(ids, **kw)
        assert all(torch.isfinite(x).all() for x in out.logits), n
        fresh = RevivaManager(model, RevivaConfig(kv_dtype="fp8")).generate(ids, **kw)
        assert torch.equal(out.sequences, fresh.sequences), n
        for a, b in zip(out.logits, fresh.logits, strict=True):
            assert torch.allclose(a, b, rtol=0, atol=1e-3), n
    assert manager.get_memory_stats()["decode_graph_captures"] > 0
