"""What a generate call can count on, read just before planning: the device's memory
(DeviceState, device_state: torch's, the driver's and Reviva's arena's figures) and the host's
pinned memory (HostState, host_state: /proc/meminfo and Reviva's pinned pool).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reviva.adapters import DecoderLayout


@dataclass(frozen=True)
class DeviceState:
    """What the device holds and can give, read just before planning (bytes)."""

    total: int  # the device's memory
    baseline: int  # held by torch's tensors now (weights, buffers)
    available: int  # free + torch's cached but unused blocks + Reviva's arena mapped now
    granularity: int  # the arena's mapping unit

    @property
    def limit(self) -> int:
        """The most a call can hold in all: what is held plus what can still be had."""
        return self.baseline + self.available


def device_state(layout: DecoderLayout, arena: object, streamed_bytes: int = 0) -> DeviceState:
    """Reads the device now. On CUDA: torch's allocated and reserved bytes, cudaMemGetInfo and
    the arena; on the CPU (host backend) the simulated device and the model's bytes, less the
    `streamed_bytes` of parameters that live in a WeightStore (its host copies, or the arena)."""
    st = arena.stats()
    granularity = int(st["granularity"])
    ours = int(st["mapped_bytes"]) + int(st["retiring_bytes"])
    if layout.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(layout.device)
        allocated = torch.cuda.memory_allocated(layout.device)
        cached = torch.cuda.memory_reserved(layout.device) - allocated
        return DeviceState(total, allocated, free + cached + ours, granularity)
    model = layout.model
    held = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    held -= streamed_bytes
    total = 16 << 30  # the host backend's simulated device
    return DeviceState(total, held, max(total - held, 0), granularity)


@dataclass(frozen=True)
class HostState:
    """Pinned host memory a call can still take (bytes): what the system can give without
    swapping (MemAvailable, less a reserve for the rest of the process) plus what Reviva's pool
    holds pinned and unused. Pinned memory cannot be paged out: a plan past this would push the
    machine into swap or the OOM killer instead of failing with the numbers."""

    available: int
    system_available: int  # MemAvailable
    reserve: int  # kept for the process's other host memory
    pool_cached: int  # pinned by the pool, unused


def host_state(pool: object) -> HostState | None:
    """The host's side, now; None where /proc/meminfo is not there (no check then)."""
    system = _mem_available()
    if system is None:
        return None
    st = pool.stats()
    cached = max(int(st["bytes_reserved"]) - int(st["bytes_in_use"]), 0)
    reserve = max(1 << 30, system // 20)
    return HostState(max(system - reserve, 0) + cached, system, reserve, cached)


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
