"""RevivaConfig: defaults, budgets from a fraction or an absolute size, and errors that name the
bad value."""

from __future__ import annotations

import pytest

from reviva.config import RevivaConfig


def test_defaults_take_a_fraction_of_the_device() -> None:
    c = RevivaConfig()
    assert c.budget_bytes(100 * 10**9) == 80 * 10**9
    assert c.host_memory_bytes() == 0
    assert c.prefetch_layers == 2


def test_absolute_budget_wins_over_the_threshold() -> None:
    c = RevivaConfig(vram_threshold=0.5, vram_budget="24GB", host_memory="64GiB")
    assert c.budget_bytes(141 * 10**9) == 24 * 10**9
    assert c.host_memory_bytes() == 64 * 2**30


def test_auto_prefetch_is_refused_by_name() -> None:
    # The K/V window is fixed per call: "auto" would silently mean 2, so it is refused.
    with pytest.raises(ValueError, match="prefetch_layers='auto' is not available"):
        RevivaConfig(prefetch_layers="auto")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"vram_threshold": 0.0}, "vram_threshold .* got 0.0"),
        ({"vram_threshold": 1.5}, "vram_threshold .* got 1.5"),
        ({"vram_threshold": True}, "vram_threshold .* got True"),
        ({"vram_budget": "24 parsecs"}, "24 parsecs"),
        ({"vram_budget": 0}, "vram_budget must be > 0 bytes, got 0"),
        # A bare number is bytes: 24 would be 24 bytes, refused with the hint.
        ({"vram_budget": 24}, "vram_budget=24 is 24 bytes .*'24GB'"),
        ({"prefetch_layers": 10**12}, r"prefetch_layers must be an int in \[0, 256\]"),
        ({"prefetch_layers": -1}, "prefetch_layers .* got -1"),
        ({"prefetch_layers": "sometimes"}, "prefetch_layers .* got 'sometimes'"),
        ({"offload_device": "gpu"}, "offload_device .* got 'gpu'"),
        ({"disk_path": "/tmp"}, "disk_path='/tmp' is for offload_device='disk'"),
        (
            {"offload_device": "disk", "disk_path": "/no/such/folder"},
            "disk_path must name an existing folder, got '/no/such/folder'",
        ),
        ({"pin_memory": "yes"}, "pin_memory .* got 'yes'"),
        ({"host_memory": "0GB"}, "host_memory must be > 0 bytes"),
        ({"chunk_tokens": 0}, "chunk_tokens .* got 0"),
        ({"chunk_tokens": 2.5}, "chunk_tokens .* got 2.5"),
        ({"cuda_graphs": 1}, "cuda_graphs must be True or False, got 1"),
    ],
)
def test_bad_values_are_named(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RevivaConfig(**kwargs)


def test_prefill_attention_is_validated() -> None:
    assert RevivaConfig(prefill_attention="chunked").prefill_attention == "chunked"
    with pytest.raises(ValueError, match="prefill_attention must be .* got 'fast'"):
        RevivaConfig(prefill_attention="fast")


def test_attention_kernel_is_checked_and_resolved() -> None:
    """RevivaConfig(attention_kernel=...): a bad value is refused by name; off CUDA every choice
    resolves to the reference path (the choice is of CUDA kernels)."""
    import torch

    from reviva.cache.block_attention import resolve_kernel

    with pytest.raises(ValueError, match="attention_kernel must be 'auto', 'flash' or 'cudnn'"):
        RevivaConfig(attention_kernel="fa3")
    for choice in ("auto", "flash", "cudnn"):
        assert RevivaConfig(attention_kernel=choice).attention_kernel == choice
        assert resolve_kernel(choice, torch.device("cpu")) == "reference"
    with pytest.raises(ValueError, match="got 'x'"):
        resolve_kernel("x", torch.device("cpu"))


def test_auto_takes_cudnn_only_for_long_prompts() -> None:
    """Note [Prefill attention kernel]: where the device takes cuDNN, "auto" keeps flash below
    CUDNN_MIN_PROMPT tokens (cuDNN's plans per shape cost more than they save there); a forced
    kernel stays; off CUDA the reference path whatever the prompt."""
    from reviva.cache.block_attention import CUDNN_MIN_CHUNKED_PROMPT, CUDNN_MIN_PROMPT, call_kernel

    assert call_kernel("cudnn", "auto", CUDNN_MIN_PROMPT - 1) == "flash"
    assert call_kernel("cudnn", "auto", CUDNN_MIN_CHUNKED_PROMPT, chunked=True) == "cudnn"
    assert call_kernel("cudnn", "auto", CUDNN_MIN_CHUNKED_PROMPT - 1, chunked=True) == "flash"
    assert call_kernel("cudnn", "auto", CUDNN_MIN_CHUNKED_PROMPT) == "flash"
    assert call_kernel("cudnn", "auto", CUDNN_MIN_PROMPT) == "cudnn"
    assert call_kernel("cudnn", "cudnn", 100) == "cudnn"
    assert call_kernel("flash", "auto", 10**6) == "flash"
    assert call_kernel("reference", "auto", 10**6) == "reference"
