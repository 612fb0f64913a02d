"""Repeated calls, one process: the same generate call run five times (whole fetches and window
fetches alternating) must give the same logits bit for bit. It fails today (benchmarks/README.md,
"Two runs of one generate call in one process can differ"): prints each run's stats fields that
differ (times aside) and each pair's relative logits difference per step, then asserts.
Reproduce on a GPU (~15 s):
    cd tests/python
    python -m pytest -s -m gpu ../../benchmarks/diagnostics/repro_repeated_calls.py
"""

from __future__ import annotations

import dataclasses
import gc
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "python"))
from test_generate import budget_keeping, gpu_mistral_512  # noqa: E402

from reviva import RevivaConfig, RevivaManager  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def fields(obj: Any, prefix: str = "") -> dict[str, str]:
    if not dataclasses.is_dataclass(obj):
        return {prefix[:-1]: repr(obj)[:300]}
    out: dict[str, str] = {}
    for f in dataclasses.fields(obj):
        out.update(fields(getattr(obj, f.name), prefix + f.name + "."))
    return out


@pytest.mark.gpu
def test_gpu_repeated_calls_same_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REVIVA_WINDOW_RINGS", "0")
    model = gpu_mistral_512()
    ids = torch.randint(1, 32000, (1, 4096), device="cuda")
    kw = dict(max_new_tokens=16, do_sample=False, output_logits=True, return_dict_in_generate=True)
    RevivaManager(model).generate(ids[:, :256], max_new_tokens=16)  # (cuBLAS's workspaces)
    torch.cuda.empty_cache()
    budget = budget_keeping(
        model,
        RevivaConfig(cuda_graphs=False),
        1,
        4096,
        16,
        lambda p: not p.residual_on_host and len(p.resident_layers) + p.promotable_layers() >= 4,
    ) + (16 << 20)
    logits, stats = {}, {}
    for name, windowed in [("wholeA", 0), ("wholeB", 0), ("winA", 1), ("winB", 1), ("wholeC", 0)]:
        monkeypatch.setenv("REVIVA_FETCH_WINDOWS", str(windowed))
        torch.cuda.empty_cache()
        manager = RevivaManager(model, RevivaConfig(vram_budget=budget, cuda_graphs=False))
        out = manager.generate(ids, **kw)
        logits[name] = [x.float().cpu() for x in out.logits]
        stats[name] = fields(manager.get_memory_stats())
        del manager, out
        gc.collect()
    for key in sorted(set().union(*stats.values())):
        values = [stats[n].get(key) for n in stats]
        if len(set(values)) > 1 and not key.endswith(("seconds", "_ms", "gbps")):
            print("stats differ:", key, values)
    rel = {
        n: [
            ((x - y).norm() / y.norm()).item()
            for x, y in zip(logits[n], logits["wholeA"], strict=True)
        ]
        for n in logits
    }
    for n, r in rel.items():
        print(n, "against wholeA:", [round(v, 5) for v in r])
    assert all(v == 0 for r in rel.values() for v in r), rel
