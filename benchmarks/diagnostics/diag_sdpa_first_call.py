"""First-call cost of the whole-prompt attention at 64k, per K/V layout (a diagnostic).

    python benchmarks/diagnostics/diag_sdpa_first_call.py strided|contiguous|flash

Run each layout in a fresh process (the first call in a process pays what the attention
library builds once). strided: the keys and values as views of Reviva's token-major K/V rows
([tokens, 2, batch, kv_heads, head_dim]); contiguous: as HF's cache holds them; flash:
aten._scaled_dot_product_flash_attention on the strided views. Prints three synchronized call
times. On the H200 (torch 2.11, cuDNN's attention chosen by SDPA): strided 0.89 s then 0.06 s,
contiguous 0.12 s then 0.06 s, flash 0.12 s then 0.10 s
(benchmarks/results/sdpa-first-call-2026-12-01-9c09d38.json).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("layout", choices=("strided", "contiguous", "flash"))
    mode = parser.parse_args().layout
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    tokens, heads, kv_heads, head_dim = 65536, 32, 8, 128
    torch.manual_seed(0)
    q = torch.randn(1, heads, tokens, head_dim, device="cuda", dtype=torch.bfloat16)
    rows = torch.randn(tokens, 2, 1, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    k = rows[:, 0].permute(1, 2, 0, 3)
    v = rows[:, 1].permute(1, 2, 0, 3)
    if mode == "contiguous":
        k, v = k.contiguous(), v.contiguous()
    torch.cuda.synchronize()
    times = []
    for _ in range(3):
        t = time.perf_counter()
        if mode == "flash":
            torch.ops.aten._scaled_dot_product_flash_attention(
                q, k, v, 0.0, True, False, scale=head_dim**-0.5
            )
        else:
            F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=head_dim**-0.5, enable_gqa=True
            )
        torch.cuda.synchronize()
        times.append(round(time.perf_counter() - t, 4))
    print(mode, "calls s:", times, flush=True)


if __name__ == "__main__":
    main()
