"""One layer's causal attention, forward and backward, at Llama-3-8B's heads (32 query heads over 8
K/V heads, head_dim 128, bf16, batch 1) on the GPU: whole-sequence causal SDPA against query
chunks, each in two kernel calls merged by log-sum-exp (chunked_layer._attention, what
LayerChunks runs), or in one call under the lower-right causal mask, one GQA call a chunk
(chunked_layer._attend_group) or one K/V head a call (chunked_layer._attend); dK/dV accumulated
in fp32; and the chunks' forward alone. The whole call and the two-call chunks also run with
SDPA's cuDNN and flash backends forced. Prints each variant's time (the second of two runs, the
device synchronized), torch's peak allocated memory, and the kernel SDPA chooses.

    python benchmarks/diagnostics/diag_attention_chunks.py TOKENS CHUNK      e.g. 65536 4096

Results: benchmarks/results/attention-chunks-h200-2026-12-07-0c15a95.json (Note [Layers by chunks
of query tokens] in python/reviva/train/chunked_layer.py).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from reviva.train.chunk_attention import _attend, _attend_group, _kernel, _takes_gqa
from reviva.train.chunk_attention import chunk_attention as _attention

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
GROUPS = HEADS // KV_HEADS
SCALE = HEAD_DIM**-0.5


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("tokens", type=int, help="the sequence's length, e.g. 65536")
    parser.add_argument("chunk", type=int, help="query tokens a chunk, e.g. 4096")
    args = parser.parse_args()
    tokens, chunk = args.tokens, args.chunk
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(1, HEADS, tokens, HEAD_DIM, device=dev, dtype=dt)
    k = torch.randn(1, KV_HEADS, tokens, HEAD_DIM, device=dev, dtype=dt)
    v = torch.randn_like(k)
    do = torch.randn_like(q)
    spans = [(s, min(s + chunk, tokens)) for s in range(0, tokens, chunk)]

    def whole() -> None:
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=SCALE, enable_gqa=True)
        o.backward(do)

    def by_chunks(attend: Callable[..., torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            dk = torch.zeros(k.shape, dtype=torch.float32, device=dev)
            dv = torch.zeros_like(dk)
            for s, e in reversed(spans):
                qq = q[:, :, s:e].detach().requires_grad_()
                kk = k[:, :, :e].detach().requires_grad_()
                vv = v[:, :, :e].detach().requires_grad_()
                attend(qq, kk, vv, SCALE, GROUPS).backward(do[:, :, s:e])
                dk[:, :, :e] += kk.grad
                dv[:, :, :e] += vv.grad

        return run

    def forward_only(attend: Callable[..., torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            with torch.no_grad():
                for s, e in spans:
                    attend(q[:, :, s:e], k[:, :, :e], v[:, :, :e], SCALE, GROUPS)

        return run

    def forced(backend: SDPBackend, fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            with sdpa_kernel([backend]):
                fn()

        return run

    variants = {
        "whole": whole,
        "chunks_two_calls": by_chunks(_attention),
        "whole_cudnn": forced(SDPBackend.CUDNN_ATTENTION, whole),
        "chunks_two_calls_cudnn": forced(SDPBackend.CUDNN_ATTENTION, by_chunks(_attention)),
        "whole_flash": forced(SDPBackend.FLASH_ATTENTION, whole),
        "chunks_two_calls_flash": forced(SDPBackend.FLASH_ATTENTION, by_chunks(_attention)),
        "forward_only_chunks_two_calls": forward_only(_attention),
        "chunks_gqa": by_chunks(_attend_group),
        "chunks_per_kv_head": by_chunks(_attend),
        "forward_only_chunks_gqa": forward_only(_attend_group),
        "forward_only_chunks_per_kv_head": forward_only(_attend),
    }
    for name, fn in variants.items():
        try:
            fn()
        except RuntimeError as e:
            print(f"T={tokens} chunk={chunk} {name}: failed: {str(e)[:200]}", flush=True)
            continue
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        took = time.perf_counter() - t
        peak = torch.cuda.max_memory_allocated() / 1e9
        print(f"T={tokens} chunk={chunk} {name}: {took:.3f} s, peak {peak:.2f} GB", flush=True)
    kernel = _kernel(q[:, :, chunk : 2 * chunk], k[:, :, : 2 * chunk], v[:, :, : 2 * chunk], SCALE)
    print("the two-call chunks' kernel:", None if kernel is None else kernel.name)
    print(
        "whole causal SDPA's backend:",
        {int(b): b.name for b in SDPBackend.__members__.values()}.get(
            torch._fused_sdp_choice(q, k, v, is_causal=True, scale=SCALE, enable_gqa=True)
        ),
    )
    print(
        "flash takes GQA for a chunk:",
        _takes_gqa(q[:, :, :chunk], k[:, :, : 2 * chunk], v[:, :, : 2 * chunk]),
    )


if __name__ == "__main__":
    main()
