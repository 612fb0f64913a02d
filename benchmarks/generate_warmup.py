"""Before bench_generate's first worker: the workers' shared libraries read into the page cache,
and cuDNN's attention kernels compiled into the CUDA JIT cache by a process of its own
(--prime-attention), so that call 1 of the first worker does not pay for what the later workers
find cached."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from generate_model import SHAPE


def warm_page_cache() -> dict[str, Any]:
    """Reads the shared libraries that every worker loads (torch's, the NVIDIA wheels', Triton's,
    Reviva's) once, before the first worker. Kernels load lazily, inside a worker's first call:
    on a freshly started machine the first worker would read them from disk there and the later
    workers would find them in the page cache, so call 1 of whichever contender runs first
    (Reviva on the card) paid for a cold disk that the no-card references did not. Returns what
    was read and how long it took (seconds near the disk's rate: the cache was cold)."""
    import importlib.util

    roots: list[str] = []
    for name in ("torch", "nvidia", "triton", "reviva"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            roots += list(spec.submodule_search_locations)
    t = time.perf_counter()
    files = size = 0
    for root in roots:
        for folder, _, names in os.walk(root):
            for name in names:
                if not (name.endswith(".so") or ".so." in name or name.endswith(".cubin")):
                    continue
                try:
                    with open(os.path.join(folder, name), "rb", buffering=0) as f:
                        while chunk := f.read(8 << 20):
                            size += len(chunk)
                except OSError:
                    continue
                files += 1
    seconds = time.perf_counter() - t
    return {
        "roots": roots,
        "files": files,
        "bytes": size,
        "seconds": round(seconds, 3),
        "gb_per_s": round(size / seconds / 1e9, 2) if seconds > 0 else None,
    }


def warm_jit_cache(contexts: list[int], script: Path) -> dict[str, Any]:
    """Makes HF's attention call (transformers' sdpa_attention_forward, which plain HF's prefill
    and Reviva's whole-prompt prefill both make) once at each context, in a process of its own,
    before the first worker. cuDNN compiles its attention kernels at run time and the CUDA
    driver keeps the result in its JIT cache on disk (~/.nv/ComputeCache): the first process on
    a freshly started machine pays the compile inside its first call (H200, 64k: 0.88 s against
    0.11 s in each later process, benchmarks/results/jit-cache-2026-12-01-a19b83d.json), so
    call 1 of whichever contender ran first (Reviva on the card) paid what the no-card
    references did not. `script`: bench_generate.py, run with --prime-attention. Returns
    each context's first-call seconds in that process."""
    cmd = [sys.executable, str(script), "--prime-attention"]
    cmd.append(",".join(str(c) for c in contexts))
    t = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    except subprocess.TimeoutExpired:
        return {"error": "timed out after 900 s"}
    out: dict[str, Any] = {"seconds": round(time.perf_counter() - t, 3)}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        out["error"] = (done.stderr or done.stdout)[-500:]
        return out
    out["first_call_s"] = json.loads(lines[-1])
    return out


def prime_attention(contexts: list[int]) -> None:
    """--prime-attention: HF's attention call at each context (the model's shape, bf16,
    causal, no mask), first-call seconds printed as JSON (warm_jit_cache)."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    heads, kv_heads = SHAPE["num_attention_heads"], SHAPE["num_key_value_heads"]
    head_dim = SHAPE["hidden_size"] // heads
    module = torch.nn.Module()
    module.is_causal = True
    module.num_key_value_groups = heads // kv_heads
    seconds = {}
    for tokens in contexts:
        kw = dict(dtype=torch.bfloat16, device="cuda")
        q = torch.randn(1, heads, tokens, head_dim, **kw)
        k = torch.randn(1, kv_heads, tokens, head_dim, **kw)
        v = torch.randn(1, kv_heads, tokens, head_dim, **kw)
        torch.cuda.synchronize()
        t = time.perf_counter()
        sdpa_attention_forward(module, q, k, v, None, dropout=0.0, scaling=head_dim**-0.5)
        torch.cuda.synchronize()
        seconds[str(tokens)] = round(time.perf_counter() - t, 4)
        del q, k, v
    print(json.dumps(seconds))
