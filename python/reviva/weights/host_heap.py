"""The C heap's free memory given back to the system, once weights have moved to pinned host
memory (StreamedWeights' packing, HostEmbedding's table): the model's CPU copy must not stay held
by the heap beside the pinned one."""

from __future__ import annotations

import ctypes
import ctypes.util


def _trim_host_heap() -> None:
    """Gives the C heap's free memory back to the system (glibc's malloc_trim): the CPU
    tensors just freed may sit in the heap (malloc's mmap threshold grows with large frees), and
    a model larger than half the host must not hold it twice. Nothing where there is no glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass
