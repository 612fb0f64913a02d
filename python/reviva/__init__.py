"""Reviva: offload activations and the K/V cache between GPU memory, pinned host memory and disk
while the GPU keeps computing.

The core (pinned host pool, transfer engine) is C++/CUDA; this package exposes it on torch tensors.
"""

from __future__ import annotations

# torch first: it loads libtorch and the CUDA runtime that reviva._C links against.
import torch  # noqa: F401

from reviva._C import (  # noqa: F401  (re-exported API)
    DeviceArena,
    KVStore,
    OffloadedTensor,
    OffloadManager,
    PinnedHostPool,
    PrefetchScheduler,
    RevivaBackendError,
    RevivaDiskError,
    RevivaError,
    RevivaOutOfMemoryError,
    Runtime,
    Transfer,
    TransferEngine,
    cuda_available,
    cuda_device_count,
)
from reviva._C import version as _core_version
from reviva.activations.offload import ActivationOffload, offload_activations
from reviva.cache.saved import SavedCache, SavedCacheError
from reviva.cache.saved import load as load_cache
from reviva.config import RevivaConfig
from reviva.generate.loader import from_pretrained
from reviva.resources import (
    device_resources,
    pinned_memory_stats,
    release_pinned_memory,
    set_pinned_memory_limit,
)
from reviva.sizes import parse_bytes
from reviva.train.finetune import Finetune, finetune
from reviva.train.plan import FinetuneOutOfMemoryError


def _version() -> str:
    """The installed distribution's version (pyproject.toml's, the one source); from a source
    tree without metadata, the core's (built from the same file)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("reviva")
    except PackageNotFoundError:
        return _core_version().split("+")[0]


__version__ = _version()


# reviva.activations.hf_trainer's names (the Trainer hook, which imports transformers): loaded on
# first use.
_HF_TRAINING = (
    "RevivaOffloadCallback",
    "RevivaTrainerMixin",
    "act_offloading_ctx_manager",
    "enable_activation_offload",
)


def __getattr__(name: str) -> object:
    # The HF integration imports transformers: loaded on first use, not with the core.
    if name not in ("RevivaManager", "RevivaCache", "CallOutOfMemoryError", *_HF_TRAINING):
        raise AttributeError(f"module 'reviva' has no attribute {name!r}")
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        raise ImportError(
            f"reviva.{name} needs transformers, which is not installed: pip install "
            "'reviva[hf]' (or transformers>=5.0); the core (offload, pools, stores) works without"
        )
    if name == "RevivaManager":
        from reviva.generate.manager import RevivaManager

        return RevivaManager
    if name == "CallOutOfMemoryError":
        from reviva.generate.call import CallOutOfMemoryError

        return CallOutOfMemoryError
    if name == "RevivaCache":
        from reviva.cache.kv_cache import RevivaCache

        return RevivaCache
    from reviva.activations import hf_trainer as hf_training

    return getattr(hf_training, name)


__all__ = [
    "ActivationOffload",
    "CallOutOfMemoryError",
    "DeviceArena",
    "device_resources",
    "pinned_memory_stats",
    "release_pinned_memory",
    "set_pinned_memory_limit",
    "offload_activations",
    "KVStore",
    "OffloadedTensor",
    "OffloadManager",
    "PinnedHostPool",
    "PrefetchScheduler",
    "RevivaBackendError",
    "RevivaCache",
    "RevivaConfig",
    "RevivaError",
    "RevivaManager",
    "RevivaOffloadCallback",
    "RevivaOutOfMemoryError",
    "RevivaTrainerMixin",
    "Runtime",
    "Transfer",
    "TransferEngine",
    "act_offloading_ctx_manager",
    "core_version",
    "cuda_available",
    "cuda_device_count",
    "enable_activation_offload",
    "finetune",
    "from_pretrained",
    "Finetune",
    "FinetuneOutOfMemoryError",
    "parse_bytes",
    "load_cache",
    "RevivaDiskError",
    "SavedCache",
    "SavedCacheError",
]


def core_version() -> str:
    """Version of the C++ core, with the backends it was built with ("0.1.0+cuda")."""
    return _core_version()
