"""RevivaConfig: how RevivaManager may use device memory, host memory and copies.

Validated on construction; every error names the bad value. (Issue 4 builds RevivaManager on it;
the config stands alone so that it can be checked and documented first.)
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from reviva.sizes import parse_bytes

# RevivaConfig.attention_kernel's values (Note [Prefill attention kernel] in
# cache/block_attention.py).
ATTENTION_KERNELS = ("auto", "flash", "cudnn")

_OFFLOAD_DEVICES = ("cpu", "disk")
_MIN_BARE_BUDGET = 1 << 20  # a smaller bare number is a unit forgotten
_MAX_PREFETCH = 256


@dataclass(frozen=True)
class RevivaConfig:
    """Limits and knobs of a RevivaManager.

    vram_threshold: fraction of the device's total memory Reviva's work may hold (0 < x <= 1).
    vram_budget:    absolute budget ("24GB", "20GiB", or bytes: a bare number of at least 1 MiB,
                    since a smaller one is a forgotten unit); wins over
                    vram_threshold. Either is capped by what the device can give at each call.
    prefetch_layers: streamed layers kept in flight ahead of compute (0 to 256; at most the
                    model's layers are used).
    offload_device: where streamed K/V goes: "cpu" (pinned host memory: a call whose streamed
                    K/V needs more than host_memory, or than the host can pin, is refused), or
                    "disk": the streamed layers whose K/V does not fit there spill to a file
                    under disk_path, read back a few layers ahead of their turn in each decode
                    step (Note [Spilled layers] in src/kv_store_disk.cpp); a few layers' pinned
                    copies are the staging.
    disk_path:      the folder for offload_device="disk"'s file (created 0600, unlinked once
                    open, so nothing is left behind); None: a new folder under $TMPDIR.
    pin_memory:     use pinned host memory (True); pageable memory copies at a third of the speed.
    host_memory:    cap on pinned host memory ("64GB", bytes), None for no cap.
    chunk_tokens:   token chunk of the MLP/projections in prefill (> 0), None to choose it
                    from the budget.
    prefill_attention: "whole" (one attention call over the prompt: the fastest kernel, but
                    the queries and output of every token at once), "chunked" (by query chunks,
                    bottom-right causal), or "auto" (whole where it fits beside a full set
                    of staging slots; with fp8 K/V where decode keeps its layers too).
    cuda_graphs:    replay each layer's decode compute around attention as CUDA graphs (CUDA,
                    half precision, no padding mask): the host issues a step several times
                    faster. False runs every kernel eagerly.
    kv_dtype:       "auto" (K/V in the model's dtype: lossless) or "fp8" (e4m3 with a scale per
                    token and head: half the bytes to hold and to stream, lossy; its measured
                    error is in the stats: Note [fp8 K/V rows] in cache/fp8.py).
    kv_block_tokens: fp8 K/V: tokens of K/V dequantized and attended at a time (> 0), None to
                    choose it from the planner's block size (128 MiB of temporaries).
    kv_page_tokens: 0 (the default): a streamed layer's K/V moves as one block, staged whole.
                    > 0: layers not resident from the start keep their K/V in pages of this
                    many tokens, read and written page by page (attention merged across pages,
                    Note [Paged layers] in src/kv_store_pages.cpp), so the staging room is a few
                    pages instead of whole layers and more layers stay resident. Opt-in: on an H200
                    at 64k it was slower than whole layers (prefill 5.2 s against 3.85, decode
                    14.6 tok/s against 21.7; docs/design-notes.md), before prefill's page reads were
                    prefetched.
    attention_kernel: prefill's chunked attention on CUDA: "flash" (aten's flash attention),
                    "cudnn" (cuDNN's, 1.8x faster at 256k on an H200), or "auto" (cuDNN on
                    compute capability 9.0+ where torch has it enabled, else flash). Note
                    [Prefill attention kernel] in cache/block_attention.py.
    prefill_residual: where the prompt's hidden states live through prefill: "device", "host"
                    (pinned host memory, streamed through each layer by chunks: nothing of the
                    prompt's size on the device but K/V), or "auto" (the device unless the plan
                    does not fit there).
    device:         where compute runs: None (the model's device), or "cuda", "cuda:N", "cpu".
                    A model on the CPU (or with its decoder layers on the meta device) computing
                    on "cuda" keeps its decoder layers' weights in pinned host memory; the rest
                    of the model (embeddings, final norm, head) moves to the device.
    stream_weights: "auto" (the decoder layers' weights live in pinned host memory and stream
                    to the device when they are not on the compute device, or when the model's
                    weights on the device are more than the budget), True (always) or False
                    (never). Each call's plan keeps as many layers' weights resident as saves
                    the most bytes per token beside the K/V (Note [Streamed weights] in
                    reviva/weights/streamed.py).
    decode_attention: where decode attends the K/V of layers whose K/V streams: "device"
                    (each such layer's K/V is copied to the device at every step), "host" (it
                    stays in pinned host memory and the host's cores attend it there: a query
                    and an output cross PCIe instead of the layer's K/V; Note [Attention on the
                    host] in src/host_attention.cpp), or "auto" (the host for one sequence on
                    a GPU where the weights stream too and the planner's step with the host
                    attending is 10% shorter than with the K/V fetched,
                    planner.host_attention_pays; with fp8 K/V and resident weights, some of
                    the fetched layers, planner.host_kv_layers; else the device).
                    REVIVA_HOST_ATTENTION_THREADS sets the host's threads (default: every core
                    the process may use).
                    "host" needs bf16, fp32 or fp8 K/V without pages, beams, a shared prompt
                    or a padding mask, and is refused otherwise ("auto" then takes the device).
    progress:       a progress line on stderr through prefill (layer i of N, tokens a second):
                    "auto" (when stderr is a terminal and the prompt has 16k tokens or more,
                    unless REVIVA_PROGRESS=0), True or False.
    """

    vram_threshold: float = 0.8
    vram_budget: int | str | None = None
    prefetch_layers: int = 2
    offload_device: str = "cpu"
    disk_path: str | None = None
    pin_memory: bool = True
    host_memory: int | str | None = None
    chunk_tokens: int | None = None
    prefill_attention: str = "auto"
    cuda_graphs: bool = True
    prefill_residual: str = "auto"
    kv_dtype: str = "auto"
    kv_block_tokens: int | None = None
    kv_page_tokens: int = 0
    attention_kernel: str = "auto"
    device: str | None = None
    stream_weights: str | bool = "auto"
    progress: str | bool = "auto"
    decode_attention: str = "auto"

    def __post_init__(self) -> None:
        t = self.vram_threshold
        if isinstance(t, bool) or not isinstance(t, int | float) or not 0.0 < t <= 1.0:
            raise ValueError(f"vram_threshold must be a fraction in (0, 1], got {t!r}")
        if self.vram_budget is not None:
            budget = parse_bytes(self.vram_budget)
            if budget <= 0:
                raise ValueError(f"vram_budget must be > 0 bytes, got {self.vram_budget!r}")
            if not isinstance(self.vram_budget, str) and budget < _MIN_BARE_BUDGET:
                raise ValueError(
                    f"vram_budget={self.vram_budget!r} is {budget} bytes (a bare number is "
                    "bytes): write a unit, e.g. '24GB', or at least 1 MiB as a number"
                )
        p = self.prefetch_layers
        if p == "auto":
            raise ValueError(
                "prefetch_layers='auto' is not available: the K/V window is fixed per call; give "
                "an int (2 is the default, measured to keep PCIe busy on the H200)"
            )
        if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p <= _MAX_PREFETCH:
            raise ValueError(f"prefetch_layers must be an int in [0, {_MAX_PREFETCH}], got {p!r}")
        if self.offload_device not in _OFFLOAD_DEVICES:
            raise ValueError(
                f"offload_device must be one of {_OFFLOAD_DEVICES}, got {self.offload_device!r}"
            )
        if self.disk_path is not None:
            if self.offload_device != "disk":
                raise ValueError(
                    f"disk_path={self.disk_path!r} is for offload_device='disk', got "
                    f"offload_device={self.offload_device!r}"
                )
            if not isinstance(self.disk_path, str) or not os.path.isdir(self.disk_path):
                raise ValueError(f"disk_path must name an existing folder, got {self.disk_path!r}")
        if not isinstance(self.pin_memory, bool):
            raise ValueError(f"pin_memory must be True or False, got {self.pin_memory!r}")
        if self.host_memory is not None and parse_bytes(self.host_memory) <= 0:
            raise ValueError(f"host_memory must be > 0 bytes, got {self.host_memory!r}")
        if self.attention_kernel not in ATTENTION_KERNELS:
            raise ValueError(
                "attention_kernel must be 'auto', 'flash' or 'cudnn', got "
                f"{self.attention_kernel!r}"
            )
        if self.prefill_attention not in ("auto", "whole", "chunked"):
            raise ValueError(
                "prefill_attention must be 'auto', 'whole' or 'chunked', got "
                f"{self.prefill_attention!r}"
            )
        if self.prefill_residual not in ("auto", "device", "host"):
            raise ValueError(
                "prefill_residual must be 'auto', 'device' or 'host', got "
                f"{self.prefill_residual!r}"
            )
        if self.decode_attention not in ("auto", "device", "host"):
            raise ValueError(
                "decode_attention must be 'auto', 'device' or 'host', got "
                f"{self.decode_attention!r}"
            )
        if self.kv_dtype not in ("auto", "fp8"):
            raise ValueError(f"kv_dtype must be 'auto' or 'fp8', got {self.kv_dtype!r}")
        b = self.kv_block_tokens
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b <= 0):
            raise ValueError(f"kv_block_tokens must be an int > 0 or None, got {b!r}")
        g = self.kv_page_tokens
        if isinstance(g, bool) or not isinstance(g, int) or g < 0:
            raise ValueError(f"kv_page_tokens must be an int >= 0 (0: whole layers), got {g!r}")
        if not isinstance(self.cuda_graphs, bool):
            raise ValueError(f"cuda_graphs must be True or False, got {self.cuda_graphs!r}")
        if self.device is not None:
            if not isinstance(self.device, str) or self.device.split(":")[0] not in (
                "cuda",
                "cpu",
            ):
                raise ValueError(
                    f"device must be None, 'cpu', 'cuda' or 'cuda:N', got {self.device!r}"
                )
        if self.stream_weights not in ("auto", True, False) or (
            isinstance(self.stream_weights, int) and not isinstance(self.stream_weights, bool)
        ):
            raise ValueError(
                f"stream_weights must be 'auto', True or False, got {self.stream_weights!r}"
            )
        if self.progress not in ("auto", True, False) or (
            isinstance(self.progress, int) and not isinstance(self.progress, bool)
        ):
            raise ValueError(f"progress must be 'auto', True or False, got {self.progress!r}")
        c = self.chunk_tokens
        if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c <= 0):
            raise ValueError(f"chunk_tokens must be an int > 0 or None, got {c!r}")

    def budget_bytes(self, total_device_bytes: int) -> int:
        """The device budget in bytes: vram_budget if given, else the threshold of the total."""
        if self.vram_budget is not None:
            return parse_bytes(self.vram_budget)
        return int(total_device_bytes * self.vram_threshold)

    def host_memory_bytes(self) -> int:
        """The pinned host memory cap in bytes; 0 means no cap."""
        return 0 if self.host_memory is None else parse_bytes(self.host_memory)
