"""Tests of reviva._C.OffloadManager and PrefetchScheduler on torch tensors: a budget that is
never exceeded, contents that survive any number of trips to the host bit for bit, the
scheduler's prefetching, errors that name the bad value. Each test runs on the host runtime and
on CUDA (conftest.py)."""

from __future__ import annotations

import pytest
import torch

import reviva

MIB = 1 << 20


@pytest.fixture
def manager_engine(device: str) -> reviva.TransferEngine:
    rt = reviva.Runtime(device)
    return reviva.TransferEngine(rt, reviva.PinnedHostPool(rt))


def fill(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Writes fresh random bytes into `t` in place and returns a CPU copy of them."""
    data = torch.randint(0, 256, (t.numel() * t.element_size(),), generator=gen, dtype=torch.uint8)
    t.view(-1).view(torch.uint8).copy_(data.to(t.device))
    return data


def read(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1).view(torch.uint8).cpu()


def test_contents_survive_round_trips_under_a_small_budget(
    manager_engine: reviva.TransferEngine, device: str
) -> None:
    gen = torch.Generator().manual_seed(1)
    budget = 3 * MIB
    m = reviva.OffloadManager(manager_engine, budget_bytes=budget, policy="lru")
    ids = [m.register([MIB // 4], torch.float32) for _ in range(8)]  # 1 MiB each
    shadow: dict[int, torch.Tensor] = {}
    for step in range(3):
        for i in ids:
            t = m.acquire(i, "readwrite" if step else "write")
            if step:
                assert torch.equal(read(t), shadow[i]), f"block {i} changed on its way"
            shadow[i] = fill(t, gen)
            m.release(i)
            assert m.device_bytes <= budget
    m.synchronize()
    met = m.metrics()
    assert met["peak_device_bytes"] <= budget
    assert met["bytes_to_host"] > 0 and met["bytes_to_device"] > 0
    assert met["evictions"] > 0
    m.check_invariants()
    for i in ids:
        m.unregister(i)
    m.synchronize()
    assert m.device_bytes == 0


def test_scheduler_prefetches_the_declared_order(
    manager_engine: reviva.TransferEngine, device: str
) -> None:
    gen = torch.Generator().manual_seed(2)
    m = reviva.OffloadManager(manager_engine, budget_bytes=5 * MIB, policy="belady")
    ids = [m.register([MIB], torch.uint8) for _ in range(10)]
    sched = reviva.PrefetchScheduler(m, prefetch_groups=2)
    sched.declare_order([[i] for i in ids])
    shadow = {}
    for i in ids:  # first pass writes
        (t,) = sched.acquire_group([i], "write")
        shadow[i] = fill(t, gen)
        sched.release_group([i])
    m.synchronize()
    m.reset_metrics()
    for i in ids:  # second pass reads, each block prefetched ahead of its use
        (t,) = sched.acquire_group([i], "read")
        assert torch.equal(read(t), shadow[i])
        sched.release_group([i])
    sched.end_step()
    m.synchronize()
    met = m.metrics()
    assert met["prefetches"] > 0, met
    assert met["prefetch_hits"] + met["prefetch_late"] > 0, met
    assert met["peak_device_bytes"] <= 5 * MIB
    assert sched.stats()["prefetches_issued"] > 0


def test_adopted_tensor_is_offloaded_and_restored(
    manager_engine: reviva.TransferEngine, device: str
) -> None:
    gen = torch.Generator().manual_seed(3)
    m = reviva.OffloadManager(manager_engine, budget_bytes=4 * MIB)
    src = torch.empty(MIB, dtype=torch.uint8, device=device)
    expected = fill(src, gen)
    block = m.adopt(src)
    del src
    assert m.state(block) == "Device"
    m.offload(block)
    m.synchronize()
    assert m.state(block) == "Host"
    t = m.acquire(block, "read")
    assert torch.equal(read(t), expected)
    m.release(block)
    m.unregister(block)


def test_budget_that_cannot_be_met_names_the_numbers(
    manager_engine: reviva.TransferEngine, device: str
) -> None:
    m = reviva.OffloadManager(manager_engine, budget_bytes=2 * MIB)
    a = m.register([MIB], torch.uint8)
    b = m.register([MIB], torch.uint8)
    c = m.register([MIB], torch.uint8)
    m.acquire(a, "write")
    m.acquire(b, "write")
    with pytest.raises(reviva.RevivaOutOfMemoryError, match="budget 2097152"):
        m.acquire(c, "write")
    big = m.register([3 * MIB], torch.uint8)
    with pytest.raises(reviva.RevivaOutOfMemoryError, match="cannot fit"):
        m.acquire(big, "write")
    m.release(a)
    m.release(b)
    m.acquire(c, "write")  # now a or b makes room
    m.release(c)


def test_bad_input_is_named(manager_engine: reviva.TransferEngine, device: str) -> None:
    m = reviva.OffloadManager(manager_engine, budget_bytes=MIB)
    with pytest.raises(ValueError, match="unknown block id 12345"):
        m.acquire(12345)
    with pytest.raises(ValueError, match="unknown eviction policy 'fifo'"):
        reviva.OffloadManager(manager_engine, policy="fifo")
    block = m.register([16], torch.float32)
    with pytest.raises(ValueError, match="unknown access 'sideways'"):
        m.acquire(block, "sideways")
    with pytest.raises(ValueError, match="is not acquired"):
        m.release(block)
    m.acquire(block, "write")
    with pytest.raises(ValueError, match="is acquired"):
        m.offload(block)
    m.release(block)
    with pytest.raises(ValueError, match="holds no bytes"):
        m.register([0, 4], torch.float32)
