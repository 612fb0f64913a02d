"""Shared fixtures for the reviva._C tests: every test that takes `device` runs on the host
backend ("cpu": threads as streams, CPU tensors stand in for device tensors) and on CUDA.

The CUDA half carries the `gpu` marker (declared in pyproject.toml). On a machine without a usable
GPU those tests are reported as skipped with the reason, never collected away or passed silently.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterator

# Deterministic cuBLAS for the tests that require it (torch.use_deterministic_algorithms refuses
# cuBLAS calls without it); read by cuBLAS when its first handle is made, so set before any test.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pytest  # noqa: E402
import torch  # noqa: E402

import reviva

GPU_SKIP_REASON = (
    "needs a CUDA device (torch.cuda.is_available() is False); "
    "runs on the GPU machine via scripts/gpu-check"
)


def _gpu_skip_reason() -> str | None:
    """Why `gpu` tests cannot run here, or None when they can."""
    if not torch.cuda.is_available():
        return GPU_SKIP_REASON
    # torch may see a GPU that the Reviva core does not (a core built without CUDA, or a driver
    # it cannot use); the CUDA runtime would then fail in every test instead of saying why once.
    if not reviva.cuda_available():
        return (
            "needs a CUDA device (reviva.cuda_available() is False although torch sees one); "
            "runs on the GPU machine via scripts/gpu-check"
        )
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = _gpu_skip_reason()
    if reason is None:
        return
    skip_gpu = pytest.mark.skip(reason=reason)
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip_gpu)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def runtime(device: str) -> reviva.Runtime:
    return reviva.Runtime(device)


@pytest.fixture
def pool(runtime: reviva.Runtime) -> reviva.PinnedHostPool:
    return reviva.PinnedHostPool(runtime)


@pytest.fixture
def engine(runtime: reviva.Runtime, pool: reviva.PinnedHostPool) -> Iterator[reviva.TransferEngine]:
    eng = reviva.TransferEngine(runtime, pool)
    yield eng
    # Copies still in flight must not outlive the tensors of the test that queued them.
    eng.synchronize()


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    """A CPU generator seeded from the test's id: fresh data per test, reproducible per test."""
    g = torch.Generator()
    g.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    return g


@pytest.fixture(autouse=True)
def _small_ring_slack(monkeypatch: pytest.MonkeyPatch) -> None:
    """Note [Window rings] (reviva/cache/window_rings.py): a ring holds its window and at least
    RING_SLACK_TOKENS (256) more, longer than the tiny models' calls; 8 here, so that every test
    of a sliding family (windows of 16, calls of ~200 tokens) runs its sliding layers as rings
    that wrap. (test_plan_cli checks the planner's own value.)"""
    import reviva.cache.window_rings

    monkeypatch.setattr(reviva.cache.window_rings, "RING_SLACK_TOKENS", 8)


# SmolLM2-135M-Instruct, a real trained model (test_real_model.py, test_finetune_real.py)
@pytest.fixture(scope="module")
def smollm2():  # noqa: ANN201
    from reviva.cli.demo import load_smollm2, smollm2_unavailable

    # (REVIVA_SMOLLM2_GGUF on the GPU machine: scripts/real-model-parts; reviva/cli/demo.py's
    # loader)
    reason = smollm2_unavailable()
    if reason is not None:
        given = os.environ.get("REVIVA_SMOLLM2_GGUF")
        if os.environ.get("REVIVA_REAL_MODEL") == "required" or (given and "not a file" in reason):
            pytest.fail(f"SmolLM2 cannot be loaded: {reason} (requirements-dev.txt has it)")
        pytest.skip(f"SmolLM2 cannot be loaded: {reason}")
    return load_smollm2("cpu", torch.float32)
