"""The device resources a process shares: one set per device, used by every RevivaManager and
every activation offload of the process.

- the runtime (the core's backend on the device, torch's current stream as compute),
- the pinned host pool: pinned memory stays pooled between generate calls and training steps
  (pinning costs ~0.35 ms per MB on the H200 host, the 1.9x slower first call of issue 12), up
  to `set_pinned_memory_limit` (no cap by default), reported by `pinned_memory_stats()` and
  given back by `release_pinned_memory()`;
- the transfer engine: one copy stream per direction, so K/V streaming and activation offload
  share the PCIe links instead of competing for them;
- the device arena: Reviva's own device memory (K/V buffers), outside torch's allocator.

    reviva.pinned_memory_stats()      # {"bytes_reserved": ..., "bytes_in_use": ..., ...}
    reviva.release_pinned_memory()    # after the last generate: unpins what is cached
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

from reviva._C import DeviceArena, PinnedHostPool, Runtime, TransferEngine
from reviva.sizes import parse_bytes


@dataclass(frozen=True)
class DeviceResources:
    """The shared resources of one device (see the module docstring)."""

    device: torch.device
    runtime: Runtime
    pool: PinnedHostPool
    engine: TransferEngine
    arena: DeviceArena


class _Registry:
    """The process's resources by device, made on first use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_device: dict[str, DeviceResources] = {}
        self._pinned_limit = 0  # 0: no cap

    def get(self, device: torch.device | str) -> DeviceResources:
        device = _normalized(device)
        key = str(device)
        with self._lock:
            found = self._by_device.get(key)
            if found is None:
                runtime = Runtime(key)
                pool = PinnedHostPool(runtime, self._pinned_limit)
                found = DeviceResources(
                    device=device,
                    runtime=runtime,
                    pool=pool,
                    engine=TransferEngine(runtime, pool),
                    arena=DeviceArena(runtime),
                )
                self._by_device[key] = found
            return found

    def existing(self) -> list[DeviceResources]:
        with self._lock:
            return list(self._by_device.values())

    def set_pinned_limit(self, limit: int) -> None:
        with self._lock:
            if self._by_device:
                raise RuntimeError(
                    "set_pinned_memory_limit: the pinned pools exist already (a manager or an "
                    "activation offload was made); set the limit before the first one"
                )
            self._pinned_limit = limit


_REGISTRY = _Registry()


def _normalized(device: torch.device | str) -> torch.device:
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    if d.type not in ("cuda", "cpu"):
        raise ValueError(f"reviva: unsupported device {str(d)!r} (use 'cuda[:N]' or 'cpu')")
    return d


def device_resources(device: torch.device | str) -> DeviceResources:
    """The process's shared runtime, pinned pool, transfer engine and arena of `device`."""
    return _REGISTRY.get(device)


def set_pinned_memory_limit(limit: int | str | None) -> None:
    """Caps the pinned host memory of every device's pool ("64GB", bytes; None: no cap). Must
    be called before the first manager or activation offload of the process."""
    bytes_ = 0 if limit is None else parse_bytes(limit)
    if limit is not None and bytes_ <= 0:
        raise ValueError(f"pinned memory limit must be > 0 bytes or None, got {limit!r}")
    _REGISTRY.set_pinned_limit(bytes_)


def pinned_memory_stats() -> dict[str, Any]:
    """Pinned host memory held by the process's pools, summed over devices."""
    total: dict[str, Any] = {"bytes_reserved": 0, "bytes_in_use": 0, "bytes_pending": 0}
    for r in _REGISTRY.existing():
        r.pool.synchronize_pending()
        st = r.pool.stats()
        for k in total:
            total[k] += st[k]
    return total


def release_pinned_memory() -> int:
    """Unpins every cached pinned slab no call is using; returns the bytes given back."""
    released = 0
    for r in _REGISTRY.existing():
        r.pool.synchronize_pending()
        released += r.pool.release_cached()
    return released
