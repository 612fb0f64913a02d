"""Capturing a decoder layer's decode compute as CUDA graphs: the capture stream (Note [One
capture stream]), garbage collection paused around a capture, cuBLAS's workspaces taken up
front, and which layers may be captured (uncapturable: the parts the path calls must be plain
modules)."""

from __future__ import annotations

import contextlib
import gc
import threading
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# Note [One capture stream]: torch gives each (cuBLAS handle, stream) its own workspace from the
# caching allocator, taken at the stream's first matmul and held from then on (torch's
# CublasHandlePool), and torch.cuda.Stream() hands out streams from a pool per device. With a
# side stream per manager, each new manager's captures could take one more workspace that stays
# allocated, so a later call's plan (its baseline: torch's allocated bytes) would have less room
# than the first's. One capture stream per device and thread serves every manager instead.
# Measured on the H200 with it (c53e840, benchmarks/diagnostics/diag_leftover.py): four calls,
# the fourth on a new manager, leave 0.1 MB more allocated once their outputs are dropped; the
# per-manager stream it replaces was not measured.
_capture_streams = threading.local()


@contextlib.contextmanager
def collection_paused() -> Any:
    """No Python garbage collection inside a graph capture. A collection runs the finalizers of
    whatever unreachable cycles hold, anything the process made before (a WeightStore, an
    OffloadManager, a pinned table), and those synchronize or free device memory: calls that
    invalidate a capture on this thread even in thread_local mode, whose capture_end then
    raises and leaves torch's CUDA generator in its capture state, so that every later random
    op of the process raised "Offset increment outside graph capture encountered unexpectedly"
    (the H200's GPU suite at 303b431: 18 tests after the first failed capture; the same tests
    alone passed). torch.cuda.graph collects before capturing for the same reason."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream decode graphs are warmed up and captured on (Note [One capture
    stream]): one per device and thread (two threads capturing at once need two streams)."""
    streams = getattr(_capture_streams, "by_device", None)
    if streams is None:
        streams = _capture_streams.by_device = {}
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = streams.get(index)
    if stream is None:
        stream = streams[index] = torch.cuda.Stream(device=index)
    return stream


def take_matmul_workspaces(device: torch.device, dtype: torch.dtype) -> None:
    """Runs one small matmul on the current stream and on the capture stream (Note [One
    capture stream]): torch takes each one's cuBLAS workspace at its first matmul and holds it
    from then on, so taking them when a manager is made puts them in the device's baseline
    before the first call plans (else the first call's decode takes them inside its working set
    and every later call plans with that much less room)."""
    x = torch.zeros(16, 16, dtype=dtype, device=device)
    compute = torch.cuda.current_stream(device)
    F.linear(x, x)
    stream = capture_stream(device)
    stream.wait_stream(compute)
    with torch.cuda.stream(stream):
        F.linear(x, x)
    compute.wait_stream(stream)
    x.record_stream(stream)


# The parts of a decoder layer that the own decode path calls (LlamaLayerPath._qkv, _finish).
_PARTS = (
    "input_layernorm",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.qkv_proj",
    "self_attn.q_norm",
    "self_attn.k_norm",
    "self_attn.o_proj",
    "post_attention_layernorm",
    "mlp",
)


def uncapturable(layer: nn.Module) -> str | None:
    """Why a decoder layer's decode compute must not be replayed from a graph, or None. A graph
    replays the kernels of its capture and nothing else, so every part the path calls must be
    a plain module whose forward is its kernels: torch's nn.Linear (exactly; not an adapter or a
    quantized subclass whose state may change between calls) or a module of transformers' own
    model code (norms, MLPs, activations), with no forward hooks (and no global module hooks),
    no accelerate hook (it moves weights per call), and not in training mode."""
    from torch.nn.modules import module as torch_module

    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        return "global module forward hooks are registered"
    for part in _PARTS:
        try:
            top = layer.get_submodule(part)
        except AttributeError:  # (q_norm, k_norm: only some families)
            continue
        for sub, m in top.named_modules():
            name = f"{part}.{sub}" if sub else part
            if m._forward_hooks or m._forward_pre_hooks:
                return f"forward hooks on {name}"
            if hasattr(m, "_hf_hook"):
                return f"accelerate hook on {name}"
            if m.training:
                return f"{name} is in training mode"
            kind = type(m)
            plain = kind is nn.Linear or kind.__module__.startswith(
                ("transformers.models.", "transformers.activations", "torch.nn.modules.activation")
            )
            if not plain:
                return f"{name} is a {kind.__module__}.{kind.__qualname__}, not a plain module"
    return None


def param_ptrs(layer: nn.Module) -> tuple[int, ...]:
    return tuple(p.data_ptr() for p in layer.parameters())


def param_shapes(layer: nn.Module) -> tuple[tuple[Any, ...], ...]:
    return tuple((tuple(p.shape), p.dtype) for p in layer.parameters())
