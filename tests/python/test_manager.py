"""Tests of reviva._C.OffloadManager and PrefetchScheduler on torch tensors: a budget that is
never exceeded, contents that survive any number of trips to the host bit for bit, the
scheduler's prefetching, errors that name the bad value. Each test runs on the host runtime and
on CUDA (conftest.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

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
    del t  # the last block's tensor keeps it resident: unregister would refuse it
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
    del t  # a tensor from acquire() keeps its block: unregister would refuse it
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


# --- safety: sizes, tensor lifetimes (leases), failed group acquires -------------------------
# Each of these was an attack on the package that crashed the interpreter or read garbage.


def test_register_refuses_a_shape_whose_byte_count_overflows(
    manager_engine: reviva.TransferEngine, device: str
) -> None:
    # (2**62 + 4) * 4 bytes wraps to 16: a 16-byte block behind a tensor of 2**62 elements, and
    # acquire(...).sum() read far past it (SIGSEGV).
    m = reviva.OffloadManager(manager_engine, budget_bytes=MIB)
    with pytest.raises(ValueError, match=r"shape \[4611686018427387908\] and dtype torch.float32"):
        m.register([2**62 + 4], torch.float32)
    with pytest.raises(ValueError, match=r"shape \[4294967296, 4294967296\] and dtype torch.uint8"):
        m.register([2**32, 2**32], torch.uint8)  # 2**64 elements: no count fits 64 bits
    with pytest.raises(ValueError, match=r"dtype torch.int64"):
        m.register([2**20, 2**20, 2**20, 2], torch.int64)  # 2**61 elements fit, their bytes not
    assert m.blocks == []
    assert m.nbytes(m.register([2**20, 3], torch.float64)) == 3 * 2**23


def test_a_tensor_kept_past_release_keeps_its_block_resident(
    manager_engine: reviva.TransferEngine, device: str
) -> None:
    # The tensor outlives release() while other blocks need the whole rest of the budget. Before
    # leases its block was evicted, its memory given to the next block, and the tensor read that
    # block's bytes.
    gen = torch.Generator().manual_seed(4)
    m = reviva.OffloadManager(manager_engine, budget_bytes=2 * MIB)
    kept_id, *others = [m.register([MIB], torch.uint8) for _ in range(4)]
    kept = m.acquire(kept_id, "write")
    expected = fill(kept, gen)
    m.release(kept_id)
    for i in others:
        fill(m.acquire(i, "write"), gen)  # its tensor dies at once: released, it may leave
        m.release(i)
        assert m.state(kept_id) == "Device"
        assert torch.equal(read(kept), expected)
    # Written after release: the write lands in the block, and stays once the tensor is gone.
    expected = fill(kept, gen)
    del kept
    for i in others:
        m.acquire(i, "write")
        m.release(i)
    m.synchronize()
    assert m.state(kept_id) == "Host"
    assert torch.equal(read(m.acquire(kept_id, "read")), expected)
    m.release(kept_id)
    m.check_invariants()


def test_a_block_whose_tensor_lives_cannot_be_offloaded_discarded_or_unregistered(
    manager_engine: reviva.TransferEngine, device: str
) -> None:
    m = reviva.OffloadManager(manager_engine, budget_bytes=MIB)
    block = m.register([1000], torch.float32)
    t = m.acquire(block, "write")
    view = t[10:20]  # a view keeps the storage, and so the block
    m.release(block)
    del t
    alive = rf"block {block} .*tensors from acquire\(\) still alive"
    for op in (m.offload, m.discard, m.unregister):
        with pytest.raises(ValueError, match=alive):
            op(block)
    with pytest.raises(ValueError, match="is not acquired .*every acquire of it was released"):
        m.release(block)
    with pytest.raises(ValueError, match=r"views block .* adopt a clone"):
        m.adopt(view)
    assert m.state(block) == "Device"
    del view
    m.offload(block)
    m.discard(block)
    m.unregister(block)
    assert m.blocks == []


def test_release_group_with_discard_refuses_a_block_whose_tensor_lives(
    manager_engine: reviva.TransferEngine, device: str
) -> None:
    m = reviva.OffloadManager(manager_engine, budget_bytes=MIB)
    a = m.register([256], torch.float32)
    b = m.register([256], torch.float32)
    sched = reviva.PrefetchScheduler(m)
    ta, tb = sched.acquire_group([a, b], "write")
    del ta
    with pytest.raises(ValueError, match=rf"discard=True\): block {b} .*still alive"):
        sched.release_group([a, b], discard=True)
    # The refused call changed nothing: both acquires are still to be released.
    m.release(a)
    m.release(b)
    with pytest.raises(ValueError, match=rf"block {b} .*still alive"):
        m.discard(b)
    del tb
    m.discard(b)
    assert m.state(a) == "Device" and m.state(b) == "Empty"


def test_tensors_outlive_their_manager(device: str) -> None:
    # The manager, scheduler, engine and runtime are dropped while tensors from acquire() live:
    # the tensors keep the core manager and the blocks' memory; the core manager goes with the last
    # of them. Before leases its memory was freed with the manager (garbage reads; writes
    # corrupted the heap). A child process, since that could take the interpreter down.
    script = textwrap.dedent(
        f"""
        import gc, torch, reviva
        rt = reviva.Runtime({device!r})
        engine = reviva.TransferEngine(rt, reviva.PinnedHostPool(rt))
        m = reviva.OffloadManager(engine, budget_bytes=1 << 20)
        sched = reviva.PrefetchScheduler(m)
        blocks = [m.register([1000], torch.int32) for _ in range(3)]
        single = m.acquire(blocks[0], "write")
        group = sched.acquire_group(blocks[1:], "write")
        for k, t in enumerate([single, *group]):
            t.copy_(torch.arange(1000, dtype=torch.int32, device={device!r}) * (k + 2))
        m.release(blocks[0])  # released; the group's acquires never are
        del sched, m, engine, rt
        gc.collect()
        for _ in range(50):  # fresh allocations that would reuse freed memory
            torch.full((1000,), -1, dtype=torch.int32, device={device!r})
        for k, t in enumerate([single, *group]):
            expected = torch.arange(1000, dtype=torch.int32, device={device!r}) * (k + 2)
            assert torch.equal(t, expected), f"tensor {{k}} changed after its manager was deleted"
            t.fill_(7)  # still the block's memory
        del single, group, t
        gc.collect()
        print("completed")
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and "completed" in proc.stdout, (
        f"child exited with {proc.returncode} (negative: killed by that signal);"
        f" stderr: {proc.stderr[-2000:]}"
    )


def test_failed_acquire_group_holds_nothing(
    manager_engine: reviva.TransferEngine, device: str
) -> None:
    # `c` fits the budget alone, not beside a and b: the group fails, and a and b must not stay
    # acquired (they did: offload refused them, and they could never leave).
    m = reviva.OffloadManager(manager_engine, budget_bytes=3 * MIB)
    a = m.register([MIB], torch.uint8)
    b = m.register([MIB], torch.uint8)
    c = m.register([2 * MIB], torch.uint8)
    sched = reviva.PrefetchScheduler(m)
    with pytest.raises(reviva.RevivaOutOfMemoryError, match="in use by compute"):
        sched.acquire_group([a, b, c], "write")
    for block in (a, b):
        with pytest.raises(ValueError, match="is not acquired"):
            m.release(block)
        m.offload(block)
    (t,) = sched.acquire_group([c], "write")
    del t
    sched.release_group([c])
    m.check_invariants()


def test_blocks_on_the_device_arena_round_trip_exactly(device: str) -> None:
    """allocator='arena': blocks' device memory from Reviva's DeviceArena (outside torch's
    allocator), reused in stream order; contents survive trips to the host bit for bit."""
    res = reviva.device_resources(device)
    gen = torch.Generator().manual_seed(7)
    budget = 3 * MIB
    m = reviva.OffloadManager(res.engine, budget_bytes=budget, allocator="arena", arena=res.arena)
    assert "arena" in m.metrics()["allocator"]
    ids = [m.register([MIB // 4], torch.float32) for _ in range(6)]
    shadow: dict[int, torch.Tensor] = {}
    for step in range(3):
        for i in ids:
            t = m.acquire(i, "readwrite" if step else "write")
            if step:
                assert torch.equal(read(t), shadow[i]), f"block {i} changed on its way"
            shadow[i] = fill(t, gen)
            del t
            m.release(i)
            assert m.device_bytes <= budget
    m.synchronize()
    assert m.metrics()["evictions"] > 0
    for i in ids:
        m.unregister(i)
    with pytest.raises(ValueError, match="allocator='arena' takes the arena"):
        reviva.OffloadManager(res.engine, allocator="arena")
    with pytest.raises(ValueError, match="allocator='torch' with an arena"):
        reviva.OffloadManager(res.engine, allocator="torch", arena=res.arena)


def test_discard_when_free_drops_the_block_when_its_last_view_goes() -> None:
    """A block still viewed by a tensor from acquire() cannot be discarded; discard_when_free
    drops its contents as soon as the last such tensor is gone (a view of it included), and
    says False when nothing holds the block (the caller discards it then)."""
    res = reviva.device_resources("cpu")
    m = reviva.OffloadManager(res.engine, budget_bytes=1 << 20)
    block = m.register([1024], torch.float32)
    t = m.acquire(block, "write")
    t.fill_(3.0)
    m.release(block)
    view = t[10:20]
    with pytest.raises(ValueError, match="del those tensors"):
        m.discard(block)
    assert m.discard_when_free(block) is True
    del t
    assert m.state(block) == "Device" and float(view.sum()) == 30.0  # the view holds it
    del view
    assert m.state(block) == "Empty"
    assert m.discard_when_free(block) is False  # nothing holds it now
    m.unregister(block)
    assert m.blocks == []
