"""Note [Block-merged attention]: a query chunk's attention over K/V blocks, merged by
log-sum-exp, against one call of torch's attention over all keys."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from reviva.cache.block_attention import block_attention, merge, split_blocks


def one_call(q, k, v, query_start, scale):  # noqa: ANN001, ANN201
    """Torch's attention of queries [query_start, query_start + n) to keys [0, query_start + n),
    bottom-right causal, grouped heads expanded: the reference."""
    n, end = q.shape[2], query_start + q.shape[2]
    group = q.shape[1] // k.shape[1]
    k = k[:, :, :end].repeat_interleave(group, dim=1)
    v = v[:, :, :end].repeat_interleave(group, dim=1)
    seen = torch.ones(n, end, dtype=torch.bool).tril(diagonal=query_start)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=seen, scale=scale)


def cache_views(batch: int, kv_heads: int, tokens: int, dim: int, dtype: torch.dtype, seed: int):  # noqa: ANN201
    """K and V as Reviva's cache holds them: token-major ([batch, tokens, kv_heads, dim]) and
    seen through transposed views (strided, not contiguous)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(batch, tokens, kv_heads, dim, generator=g).to(dtype)
    v = torch.randn(batch, tokens, kv_heads, dim, generator=g).to(dtype)
    return k.transpose(1, 2), v.transpose(1, 2)


@pytest.mark.parametrize("block_tokens", [1, 7, 64, 100, 1000])
@pytest.mark.parametrize(("query_start", "n"), [(0, 96), (130, 70), (199, 1), (57, 1)])
def test_block_merged_equals_one_call_fp32(block_tokens: int, query_start: int, n: int) -> None:
    """fp32, grouped heads (8 query heads on 2 K/V heads), strided views: every split of the
    keys into blocks gives torch's one-call attention (prefill chunks and decode)."""
    k, v = cache_views(2, 2, 200, 16, torch.float32, seed=block_tokens + n)
    q = torch.randn(2, 8, n, 16, generator=torch.Generator().manual_seed(query_start))
    scale = 16**-0.5
    ref = one_call(q, k, v, query_start, scale)
    blocks = split_blocks(k, v, query_start, n, block_tokens)
    assert blocks[-1][2] + blocks[-1][0].shape[2] == query_start + n
    assert all(b[0].shape[2] <= max(block_tokens, n) for b in blocks)
    got = block_attention(q, blocks, query_start, scale)
    torch.testing.assert_close(got, ref, atol=2e-6, rtol=2e-5)


def test_block_merged_bf16_within_rounding() -> None:
    """bf16 (the reference path computes in fp32 and rounds once; blocks merged in fp32)."""
    k, v = cache_views(1, 2, 512, 32, torch.bfloat16, seed=3)
    q = torch.randn(1, 4, 128, 32, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    ref = one_call(q.float(), k.float(), v.float(), 384, 32**-0.5)
    got = block_attention(q, split_blocks(k, v, 384, 128, 96), 384, 32**-0.5)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref, atol=1e-2, rtol=1e-2)


def test_last_block_shorter_than_the_chunk() -> None:
    """A bottom-right block shorter than the query chunk: its first rows see none of its keys
    and take their whole attention from the earlier blocks (no NaN)."""
    k, v = cache_views(1, 1, 40, 8, torch.float32, seed=5)
    q = torch.randn(1, 2, 10, 8, generator=torch.Generator().manual_seed(6))
    ref = one_call(q, k, v, 30, 0.3)
    blocks = [(k[:, :, :31], v[:, :, :31], 0), (k[:, :, 31:40], v[:, :, 31:40], 31)]
    got = block_attention(q, blocks, 30, 0.3)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, ref, atol=2e-6, rtol=2e-5)


def test_merge_order_does_not_matter() -> None:
    """The merge is the same whichever block comes first (up to fp32 rounding)."""
    k, v = cache_views(1, 2, 90, 8, torch.float32, seed=7)
    q = torch.randn(1, 4, 1, 8, generator=torch.Generator().manual_seed(8))
    blocks = split_blocks(k, v, 89, 1, 25)
    a = block_attention(q, blocks, 89, 0.5)
    b = block_attention(q, list(reversed(blocks)), 89, 0.5)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_merge_rows_that_saw_nothing() -> None:
    """A block's rows whose lse is -inf (no key seen) contribute nothing, even if its output
    there is NaN; a row that saw nothing anywhere yet stays at zero weight."""
    out = torch.ones(1, 1, 2, 4)
    lse = torch.tensor([[[0.0, float("-inf")]]])
    o_b = torch.full((1, 1, 2, 4), float("nan"))
    l_b = torch.tensor([[[float("-inf"), 1.0]]])
    o_b[0, 0, 1] = 3.0
    got, total = merge(out, lse, o_b, l_b)
    assert torch.equal(got[0, 0, 0], torch.ones(4)) and torch.equal(
        got[0, 0, 1], torch.full((4,), 3.0)
    )
    assert total[0, 0, 0] == 0.0 and total[0, 0, 1] == 1.0


def test_bad_blocks_are_named() -> None:
    k, v = cache_views(1, 2, 50, 8, torch.float32, seed=9)
    q = torch.randn(1, 4, 10, 8)
    with pytest.raises(
        ValueError, match=r"keys \[0, 35\) must end at or before 31 .* exactly at 40"
    ):
        block_attention(q, [(k[:, :, :35], v[:, :, :35], 0)], 30, 1.0)
    with pytest.raises(ValueError, match="kv_heads dividing heads"):
        block_attention(torch.randn(1, 3, 10, 8), [(k[:, :, :40], v[:, :, :40], 0)], 30, 1.0)
    with pytest.raises(ValueError, match="no keys"):
        block_attention(q, [], 30, 1.0)
    with pytest.raises(ValueError, match="block_tokens must be > 0, got 0"):
        split_blocks(k, v, 30, 10, 0)
    with pytest.raises(ValueError, match="50 keys, queries up to 60"):
        split_blocks(k, v, 50, 10, 8)


@pytest.mark.gpu
def test_gpu_block_merged_flash_within_bf16_rounding() -> None:
    """CUDA, bf16: flash attention per block (grouped heads read in place, bottom-right causal)
    merged by lse, against one flash call over all keys, within bf16 rounding; prefill chunk and
    decode, at 8k keys in blocks of 1000."""
    g = torch.Generator(device="cuda").manual_seed(11)
    tokens, dim = 8192, 128
    k = torch.randn(1, tokens, 8, dim, device="cuda", generator=g, dtype=torch.bfloat16)
    v = torch.randn(1, tokens, 8, dim, device="cuda", generator=g, dtype=torch.bfloat16)
    k, v = k.transpose(1, 2), v.transpose(1, 2)
    for query_start, n in ((6144, 2048), (8191, 1)):
        q = torch.randn(1, 32, n, dim, device="cuda", generator=g, dtype=torch.bfloat16)
        end = query_start + n
        ref = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k[:, :, :end], v[:, :, :end], 0.0, n > 1, False, scale=dim**-0.5
        )[0]
        got = block_attention(q, split_blocks(k, v, query_start, n, 1000), query_start, dim**-0.5)
        err = (got.float() - ref.float()).abs().max().item()
        assert err <= 2**-7 * ref.float().abs().max().item(), (query_start, n, err)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 2])
def test_gpu_cudnn_chunk_attention_against_fp32(batch: int) -> None:
    """Note [Prefill attention kernel]: cuDNN's attention (grouped heads read in place from the
    cache's token-major views; a chunk's earlier keys and its own square causal block merged by
    lse) and flash's, both against an fp32 reference, for chunks at the start, in the middle,
    shorter than CUDNN_MIN_QUERIES (flash then), and blocks of fp8's kind (a last block longer
    than the queries): cuDNN's error within 2x flash's and within bf16 rounding."""
    from reviva.cache.block_attention import CUDNN_MIN_QUERIES, resolve_kernel
    from reviva.generate.layer_attention import chunk_attention

    dev = torch.device("cuda")
    if resolve_kernel("auto", dev) != "cudnn":
        pytest.skip("cuDNN attention not chosen on this device (needs compute capability 9.0+)")
    g = torch.Generator(device="cuda").manual_seed(5)
    tokens, dim, scale = 6000, 128, 128**-0.5
    k = torch.randn(batch, tokens, 8, dim, device="cuda", generator=g, dtype=torch.bfloat16)
    v = torch.randn(batch, tokens, 8, dim, device="cuda", generator=g, dtype=torch.bfloat16)
    k, v = k.transpose(1, 2), v.transpose(1, 2)  # token-major, as the cache's views
    for start, n in ((0, 1024), (2000, 1500), (4000, 2000), (5900, CUDNN_MIN_QUERIES - 28)):
        q = torch.randn(batch, 32, n, dim, device="cuda", generator=g, dtype=torch.bfloat16)
        end = start + n
        ref = one_call(q.float().cpu(), k.float().cpu(), v.float().cpu(), start, scale)
        errs = {}
        for kernel in ("flash", "cudnn"):
            got = chunk_attention(q, k[:, :, :end], v[:, :, :end], None, start, end, scale, kernel)
            errs[kernel] = (got.float().cpu() - ref).abs().max().item()
            blocks = split_blocks(k, v, start, n, 1700)  # the last block longer than the queries
            got_b = block_attention(q, blocks, start, scale, kernel)
            errs[kernel + "_blocks"] = (got_b.float().cpu() - ref).abs().max().item()
        bound = 2**-7 * ref.abs().max().item()
        assert all(e <= bound for e in errs.values()), (start, n, errs, bound)
        assert errs["cudnn"] <= 2 * errs["flash"] + 1e-3, (start, n, errs)


def test_merging_at_the_end_equals_merging_as_they_come() -> None:
    """block_attention keeps a few queries' block outputs and merges them at once (merge_all):
    the same as the running merge within fp32 rounding, rows that saw no key of a block taking
    nothing from it (their output there may be anything), a row that saw no key at all 0."""
    from reviva.cache.block_attention import merge_all

    g = torch.Generator().manual_seed(3)
    parts = []
    for b in range(5):
        o = torch.randn(2, 4, 3, 8, generator=g)
        lse = torch.randn(2, 4, 3, generator=g) * 3
        if b in (1, 3):  # row 2 saw no key of these blocks
            lse[:, :, 2] = float("-inf")
            o[:, :, 2] = float("nan")
        parts.append((o.to(torch.bfloat16), lse))
    out = lse_run = None
    for o_b, l_b in parts:
        out, lse_run = merge(out, lse_run, o_b, l_b)
    assert out is not None
    torch.testing.assert_close(merge_all(parts), out, rtol=1e-5, atol=1e-6)
    nothing = [(torch.full((1, 1, 1, 2), float("nan")), torch.full((1, 1, 1), float("-inf")))]
    assert torch.equal(merge_all(nothing), torch.zeros(1, 1, 1, 2))
