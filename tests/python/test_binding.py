"""Tests of reviva._C on torch tensors: offload/restore round trips, batching and coalescing,
the lifetime protocol at the torch boundary, input validation, pool and engine statistics.

Each test that takes the `device` fixture runs on the host runtime and on CUDA (conftest.py).
Data is random bytes from a generator seeded per test, and results are compared byte for byte,
so that a copy of the wrong bytes, a short copy or a copy from stale memory is seen.
"""

from __future__ import annotations

import gc
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import reviva

ROUND_TRIP_DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.int64,
    torch.bool,
]
# 0-d, one element, an odd 2-d shape, a 3-d shape, and one of 4 MiB plus an odd tail (well above
# the engine's coalescing threshold, so it takes the plain-copy path).
ROUND_TRIP_SHAPES = [(), (1,), (7, 13), (2, 3, 5), ((1 << 20) + 3,)]
# Below TransferEngine's default coalesce_below (256 KiB): offload_batch packs these into one
# segment copy.
SMALL_DTYPES = [torch.float32, torch.float16, torch.uint8, torch.int64, torch.bool]


# --- helpers ----------------------------------------------------------------------------------


def random_tensor(
    shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator, device: str
) -> torch.Tensor:
    """A tensor of random bits: for floats every bit pattern (NaN payloads, -0.0, subnormals)
    can occur, which a value comparison would blur."""
    if dtype == torch.bool:
        # Only 0 and 1 are valid bools.
        t = torch.randint(0, 2, shape, generator=gen, dtype=torch.uint8).bool()
    else:
        itemsize = torch.empty((), dtype=dtype).element_size()
        raw = torch.randint(
            0, 256, (math.prod(shape) * itemsize,), generator=gen, dtype=torch.uint8
        )
        t = raw.view(dtype).reshape(shape)
    return t.to(device)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype
    assert actual.shape == expected.shape
    assert torch.equal(as_bytes(actual), as_bytes(expected)), (
        f"bytes differ for a tensor of shape {tuple(expected.shape)}, dtype {expected.dtype}"
    )


def random_small_tensors(count: int, gen: torch.Generator, device: str) -> list[torch.Tensor]:
    """`count` tensors of random dtypes and random (mostly odd) byte counts, all under 64 KiB."""
    tensors = []
    for _ in range(count):
        dtype = SMALL_DTYPES[int(torch.randint(0, len(SMALL_DTYPES), (), generator=gen))]
        numel = int(torch.randint(1, 8192, (), generator=gen))
        tensors.append(random_tensor((numel,), dtype, gen, device))
    return tensors


def total_nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.nbytes for t in tensors)


# --- round trips ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ROUND_TRIP_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("shape", ROUND_TRIP_SHAPES, ids=lambda s: "x".join(map(str, s)) or "0d")
def test_offload_restore_round_trip_is_bit_exact(
    engine: reviva.TransferEngine,
    runtime: reviva.Runtime,
    device: str,
    gen: torch.Generator,
    shape: tuple[int, ...],
    dtype: torch.dtype,
) -> None:
    src = random_tensor(shape, dtype, gen, device)
    expected = src.cpu()
    h = engine.offload(src)
    restored = engine.restore(h)
    assert str(restored.device) == runtime.device
    assert restored.data_ptr() != src.data_ptr()
    assert_bitwise_equal(restored, expected)
    assert_bitwise_equal(src, expected)  # offloading leaves the source as it was


def test_offload_without_record_stream_round_trips(
    engine: reviva.TransferEngine, device: str, gen: torch.Generator
) -> None:
    """record_stream=False: the caller holds the source until the offload is ready."""
    src = random_tensor((64, 33), torch.float32, gen, device)
    expected = src.cpu()
    h = engine.offload(src, record_stream=False)
    h.wait()
    del src  # now safe: the D2H has read it
    assert_bitwise_equal(engine.restore(h), expected)
    batch = engine.offload_batch([expected.to(device)], record_stream=False)
    batch[0].wait()
    assert_bitwise_equal(engine.restore(batch[0]), expected)


def test_offload_of_a_view_with_storage_offset(
    engine: reviva.TransferEngine, device: str, gen: torch.Generator
) -> None:
    # A contiguous view that starts inside its storage: the copy must start at the view's first
    # element, not at the storage's.
    base = random_tensor((1000,), torch.float32, gen, device)
    view = base[37:]
    h = engine.offload(view)
    assert h.nbytes == 963 * 4
    assert_bitwise_equal(engine.restore(h), base[37:].cpu())


def test_restore_twice_gives_two_equal_tensors(
    engine: reviva.TransferEngine, device: str, gen: torch.Generator
) -> None:
    src = random_tensor((257, 3), torch.float16, gen, device)
    h = engine.offload(src)
    first = engine.restore(h)
    second = engine.restore(h)
    assert first.data_ptr() != second.data_ptr()
    assert_bitwise_equal(first, src)
    assert_bitwise_equal(second, src)


def test_large_copy_is_split_into_chunks(
    runtime: reviva.Runtime, pool: reviva.PinnedHostPool, device: str, gen: torch.Generator
) -> None:
    engine = reviva.TransferEngine(runtime, pool, chunk_bytes=1 << 20)
    src = random_tensor(((4 << 20) + 12,), torch.uint8, gen, device)
    h = engine.offload(src)
    assert_bitwise_equal(engine.restore(h), src)
    engine.synchronize()
    stats = engine.stats()
    # 4 MiB + 12 bytes in 1 MiB chunks: four full chunks and a 12-byte tail, each direction.
    assert stats["to_host"]["chunks"] == 5
    assert stats["to_device"]["chunks"] == 5


# --- OffloadedTensor --------------------------------------------------------------------------


def test_host_tensor_is_a_cpu_copy_of_the_source(
    engine: reviva.TransferEngine, device: str, gen: torch.Generator
) -> None:
    src = random_tensor((7, 13), torch.bfloat16, gen, device)
    h = engine.offload(src)
    host = h.host_tensor()
    assert host.device.type == "cpu"
    assert h.ready()  # host_tensor() waited for the offload
    assert_bitwise_equal(host, src)
    if device == "cuda":
        # The view is of the pool's page-locked memory, which CUDA knows as pinned.
        assert host.is_pinned()


def test_offloaded_tensor_properties(
    engine: reviva.TransferEngine, runtime: reviva.Runtime, device: str, gen: torch.Generator
) -> None:
    src = random_tensor((7, 13), torch.float16, gen, device)
    h = engine.offload(src)
    assert h.shape == [7, 13]
    assert h.dtype == torch.float16
    assert h.nbytes == 7 * 13 * 2
    assert h.device == runtime.device == str(src.device)
    h.wait()
    assert h.ready()


def test_restore_into_out_writes_it_and_returns_it(
    engine: reviva.TransferEngine, device: str, gen: torch.Generator
) -> None:
    src = random_tensor((33, 5), torch.int64, gen, device)
    out = torch.zeros_like(src)
    h = engine.offload(src)
    result = engine.restore(h, out=out)
    assert result.data_ptr() == out.data_ptr()
    assert_bitwise_equal(out, src)


# --- batches ----------------------------------------------------------------------------------


def test_batch_of_300_small_tensors_is_one_segment_copy_each_way(
    engine: reviva.TransferEngine, device: str, gen: torch.Generator
) -> None:
    tensors = random_small_tensors(300, gen, device)
    handles = engine.offload_batch(tensors)
    assert len(handles) == 300
    restored = engine.restore_batch(handles)
    assert len(restored) == 300
    for got, want in zip(restored, tensors, strict=True):
        assert_bitwise_equal(got, want)
    engine.synchronize()
    stats = engine.stats()
    for direction in ("to_host", "to_device"):
        assert stats[direction]["coalesced_requests"] == 300, direction
        assert stats[direction]["segment_launches"] == 1, direction
        assert stats[direction]["chunks"] == 0, direction
        assert stats[direction]["bytes_completed"] == total_nbytes(tensors), direction


def test_batch_of_small_and_large_tensors(
    engine: reviva.TransferEngine, device: str, gen: torch.Generator
) -> None:
    small = random_small_tensors(40, gen, device)
    large = [
        random_tensor(((1 << 20) + 3,), torch.float32, gen, device),
        random_tensor((300_001,), torch.uint8, gen, device),
        random_tensor((513, 1025), torch.bfloat16, gen, device),
    ]
    # Interleave, so that the coalesced ones are not simply a prefix of the batch.
    tensors = small[:10] + large[:1] + small[10:30] + large[1:] + small[30:]
    outs: list[torch.Tensor | None] = [None] * len(tensors)
    outs[3] = torch.empty_like(tensors[3])
    outs[10] = torch.empty_like(tensors[10])  # the first large one
    handles = engine.offload_batch(tensors)
    restored = engine.restore_batch(handles, outs=outs)
    assert restored[3].data_ptr() == outs[3].data_ptr()
    assert restored[10].data_ptr() == outs[10].data_ptr()
    for got, want in zip(restored, tensors, strict=True):
        assert_bitwise_equal(got, want)
    engine.synchronize()
    stats = engine.stats()
    for direction in ("to_host", "to_device"):
        assert stats[direction]["coalesced_requests"] == 40, direction
        assert stats[direction]["segment_launches"] == 1, direction
        assert stats[direction]["chunks"] == 3, direction


# --- lifetime protocol at the torch boundary ------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("device", ["cuda"])
def test_offload_copies_the_data_as_of_the_offload_call(
    engine: reviva.TransferEngine, gen: torch.Generator
) -> None:
    # The tensor is written by work still queued on torch's current stream when offload() is
    # called; the copy stream must wait for it (the producer event) instead of reading the zeros.
    src = random_tensor((4 << 20,), torch.uint8, gen, "cuda")
    t = torch.zeros_like(src)
    a = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    for _ in range(20):  # tens of milliseconds of queued work ahead of the write
        a = torch.tanh(a @ a)
    t.copy_(src)
    h = engine.offload(t)
    assert_bitwise_equal(h.host_tensor(), src)


@pytest.mark.gpu
@pytest.mark.parametrize("device", ["cuda"])
def test_restore_orders_later_work_on_the_current_stream(
    engine: reviva.TransferEngine, gen: torch.Generator
) -> None:
    # wait=True: work queued on the current stream after restore() sees the restored bytes, even
    # though the copy ran on the engine's own stream.
    src = random_tensor((64 << 20,), torch.uint8, gen, "cuda")
    expected = src.cpu()
    h = engine.offload(src)
    h.wait()
    restored = engine.restore(h)
    snapshot = restored.clone()  # on the current stream, right behind the restore
    assert torch.equal(snapshot.cpu(), expected)


def test_source_memory_is_not_reused_before_its_offload_has_read_it(
    engine: reviva.TransferEngine, device: str, gen: torch.Generator
) -> None:
    # Keep the copy stream busy, so that the next offload is still queued when its source is
    # dropped; if the source's memory went back to torch at once, the new tensor below would get
    # it and the queued copy would read the new tensor's bytes.
    busy_bytes = (512 << 20) if device == "cuda" else (64 << 20)
    busy = torch.empty(busy_bytes, dtype=torch.uint8, device=device)
    busy_handle = engine.offload(busy)
    src = random_tensor((8 << 20,), torch.uint8, gen, device)
    expected = src.cpu()
    h = engine.offload(src)
    del src
    reuse = torch.empty(8 << 20, dtype=torch.uint8, device=device)
    reuse.fill_(0xA5)
    assert_bitwise_equal(h.host_tensor(), expected)
    busy_handle.wait()


def test_tensors_outliving_their_engine_exit_cleanly(device: str) -> None:
    # torch's allocator records events on the copy streams (record_stream) when it frees memory
    # a copy used, possibly after the engine is gone: those streams must outlive the engine.
    # Seen on the H200 before the fix: "CUDA error: context is destroyed" and an abort at exit.
    script = textwrap.dedent(
        f"""
        import torch, reviva
        rt = reviva.Runtime({device!r})
        pool = reviva.PinnedHostPool(rt)
        engine = reviva.TransferEngine(rt, pool)
        sources = [torch.randn(1 << 16, device={device!r}) for _ in range(4)]
        handles = engine.offload_batch(sources)
        restored = engine.restore_batch(handles)
        del engine, pool, rt
        del sources, restored, handles
        print("completed")
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and "completed" in proc.stdout, (
        f"child exited with {proc.returncode}; stderr: {proc.stderr[-2000:]}"
    )


def test_dropping_a_handle_before_its_offload_completes_is_safe(device: str) -> None:
    # The source tensor and the handle are both dropped while the copy may still be queued: the
    # copy must not read freed memory. Run in a child process, since a use-after-free can take
    # the interpreter down with it.
    script = textwrap.dedent(
        f"""
        import gc, torch, reviva
        rt = reviva.Runtime({device!r})
        pool = reviva.PinnedHostPool(rt)
        engine = reviva.TransferEngine(rt, pool)
        for _ in range(20):
            # 32 MiB: the allocator maps it on its own and unmaps it when it is freed.
            t = torch.ones(32 << 20, dtype=torch.uint8, device={device!r})
            h = engine.offload(t)
            del h, t
            gc.collect()
        engine.synchronize()
        print("completed")
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ),
    )
    assert proc.returncode == 0 and "completed" in proc.stdout, (
        f"child exited with {proc.returncode} (negative: killed by that signal, -11 is SIGSEGV);"
        f" stderr: {proc.stderr[-2000:]}"
    )


# --- input validation -------------------------------------------------------------------------


def test_offload_rejects_a_non_contiguous_tensor(
    engine: reviva.TransferEngine, device: str, gen: torch.Generator
) -> None:
    t = random_tensor((16, 8), torch.float32, gen, device).t()
    with pytest.raises(ValueError, match="contiguous"):
        engine.offload(t)


def test_offload_rejects_an_empty_tensor(engine: reviva.TransferEngine, device: str) -> None:
    with pytest.raises(ValueError, match="empty"):
        engine.offload(torch.empty(0, 5, device=device))


def test_offload_batch_rejects_an_empty_list(engine: reviva.TransferEngine) -> None:
    with pytest.raises(ValueError, match="no tensors"):
        engine.offload_batch([])


def test_offload_batch_names_the_bad_tensor(
    engine: reviva.TransferEngine, device: str, gen: torch.Generator
) -> None:
    good = random_tensor((4, 4), torch.float32, gen, device)
    with pytest.raises(ValueError, match="tensor 2: .*contiguous"):
        engine.offload_batch([good, good, good.t()])


def test_offload_rejects_a_tensor_on_another_device(engine: reviva.TransferEngine) -> None:
    # A meta tensor is on a device no runtime serves; it exists on any machine.
    with pytest.raises(ValueError, match="expected a tensor on .*device meta"):
        engine.offload(torch.empty(3, device="meta"))


@pytest.mark.gpu
@pytest.mark.parametrize("device", ["cuda"])
def test_cuda_engine_rejects_cpu_tensors(engine: reviva.TransferEngine) -> None:
    with pytest.raises(ValueError, match="expected a tensor on cuda:0.*device cpu"):
        engine.offload(torch.ones(8))
    h = engine.offload(torch.ones(8, device="cuda"))
    with pytest.raises(ValueError, match="expected a tensor on cuda:0.*device cpu"):
        engine.restore(h, out=torch.empty(8))


@pytest.mark.gpu
@pytest.mark.parametrize("device", ["cuda"])
def test_restore_rejects_a_handle_from_another_device(engine: reviva.TransferEngine) -> None:
    cpu_runtime = reviva.Runtime("cpu")
    cpu_engine = reviva.TransferEngine(cpu_runtime, reviva.PinnedHostPool(cpu_runtime))
    h = engine.offload(torch.ones(8, device="cuda"))
    with pytest.raises(ValueError, match="offloaded from cuda:0.*restores to cpu"):
        cpu_engine.restore(h)


def test_restore_rejects_out_of_another_dtype(
    engine: reviva.TransferEngine, device: str, gen: torch.Generator
) -> None:
    h = engine.offload(random_tensor((4, 4), torch.float32, gen, device))
    # Same byte count, other dtype: must still be refused.
    with pytest.raises(ValueError, match="dtype"):
        engine.restore(h, out=torch.empty(4, 4, dtype=torch.int32, device=device))


def test_restore_rejects_out_of_another_size(
    engine: reviva.TransferEngine, device: str, gen: torch.Generator
) -> None:
    h = engine.offload(random_tensor((4, 4), torch.float32, gen, device))
    with pytest.raises(ValueError, match="80 bytes differ from the offloaded 64 bytes"):
        engine.restore(h, out=torch.empty(5, 4, device=device))


def test_restore_rejects_a_non_contiguous_out(
    engine: reviva.TransferEngine, device: str, gen: torch.Generator
) -> None:
    h = engine.offload(random_tensor((4, 4), torch.float32, gen, device))
    with pytest.raises(ValueError, match="contiguous"):
        engine.restore(h, out=torch.empty(4, 4, device=device).t())


def test_restore_batch_rejects_a_wrong_number_of_outs(
    engine: reviva.TransferEngine, device: str, gen: torch.Generator
) -> None:
    tensors = [random_tensor((3,), torch.float32, gen, device) for _ in range(3)]
    handles = engine.offload_batch(tensors)
    with pytest.raises(ValueError, match="3 tensors but 2 outputs"):
        engine.restore_batch(handles, outs=[None, None])


def test_runtime_rejects_an_unknown_device() -> None:
    with pytest.raises((ValueError, RuntimeError), match="tpu"):
        reviva.Runtime("tpu")


def test_engine_rejects_a_pool_of_another_runtime(runtime: reviva.Runtime, device: str) -> None:
    other_pool = reviva.PinnedHostPool(reviva.Runtime(device))
    with pytest.raises(ValueError, match="another runtime"):
        reviva.TransferEngine(runtime, other_pool)


# --- pinned host pool -------------------------------------------------------------------------


def test_pool_capacity_is_enforced(runtime: reviva.Runtime, device: str) -> None:
    pool = reviva.PinnedHostPool(runtime, capacity_bytes=1 << 20)
    engine = reviva.TransferEngine(runtime, pool)
    assert pool.capacity_bytes == 1 << 20
    with pytest.raises(reviva.RevivaOutOfMemoryError, match="capacity 1048576") as info:
        engine.offload(torch.ones(4 << 20, dtype=torch.uint8, device=device))
    assert isinstance(info.value, MemoryError)
    assert "4194304 bytes" in str(info.value)  # names the request, too
    # The failed request left the pool usable and consistent.
    small = torch.arange(1000, dtype=torch.int64, device=device)
    assert_bitwise_equal(engine.restore(engine.offload(small)), small)
    assert pool.stats()["bytes_reserved"] <= 1 << 20
    pool.check_invariants()


def test_pool_bytes_return_to_zero_after_handles_are_dropped(
    engine: reviva.TransferEngine, pool: reviva.PinnedHostPool, device: str, gen: torch.Generator
) -> None:
    tensors = random_small_tensors(50, gen, device) + [
        random_tensor(((1 << 20) + 3,), torch.float16, gen, device)
    ]
    handles = engine.offload_batch(tensors)
    engine.restore_batch(handles)
    stats = pool.stats()
    assert stats["bytes_requested"] == total_nbytes(tensors)
    assert stats["bytes_in_use"] >= total_nbytes(tensors)
    del handles
    gc.collect()
    pool.synchronize_pending()
    stats = pool.stats()
    assert stats["bytes_in_use"] == 0
    assert stats["bytes_requested"] == 0
    assert stats["bytes_pending"] == 0
    assert stats["pending_blocks"] == 0
    pool.check_invariants()


def test_host_tensor_keeps_its_block_alive(
    engine: reviva.TransferEngine, pool: reviva.PinnedHostPool, device: str, gen: torch.Generator
) -> None:
    src = random_tensor((1000,), torch.float32, gen, device)
    h = engine.offload(src)
    host = h.host_tensor()
    del h
    gc.collect()
    pool.synchronize_pending()
    assert pool.stats()["bytes_requested"] == 4000  # the view still holds the block
    assert_bitwise_equal(host, src)
    del host
    gc.collect()
    pool.synchronize_pending()
    assert pool.stats()["bytes_in_use"] == 0


def test_pool_reuses_blocks_of_the_same_size(
    engine: reviva.TransferEngine, pool: reviva.PinnedHostPool, device: str, gen: torch.Generator
) -> None:
    for _ in range(6):
        h = engine.offload(random_tensor((100_003,), torch.uint8, gen, device))
        h.wait()
        del h
        gc.collect()
    pool.synchronize_pending()
    stats = pool.stats()
    assert stats["allocations"] == 6
    assert stats["slabs_allocated"] == 1
    assert stats["cache_hits"] >= 5
    assert stats["hit_rate"] > 0
    pool.check_invariants()


# --- engine statistics ------------------------------------------------------------------------


def test_engine_counts_bytes_per_direction_exactly(
    engine: reviva.TransferEngine, device: str, gen: torch.Generator
) -> None:
    single = random_tensor((7, 13), torch.float16, gen, device)
    batch = random_small_tensors(20, gen, device) + [
        random_tensor(((1 << 20) + 3,), torch.int8, gen, device)
    ]
    h_single = engine.offload(single)
    h_batch = engine.offload_batch(batch)
    engine.restore(h_single)
    engine.restore_batch(h_batch[:5])
    engine.synchronize()
    stats = engine.stats()
    d2h_bytes = single.nbytes + total_nbytes(batch)
    h2d_bytes = single.nbytes + total_nbytes(batch[:5])
    assert stats["to_host"]["bytes_submitted"] == d2h_bytes
    assert stats["to_host"]["bytes_completed"] == d2h_bytes
    assert stats["to_device"]["bytes_submitted"] == h2d_bytes
    assert stats["to_device"]["bytes_completed"] == h2d_bytes
    for direction in ("to_host", "to_device"):
        assert stats[direction]["transfers_submitted"] == 2, direction
        assert stats[direction]["transfers_completed"] == 2, direction
    engine.reset_stats()
    stats = engine.stats()
    assert stats["to_host"]["bytes_completed"] == 0
    assert stats["to_device"]["transfers_submitted"] == 0


# --- copy_ (CUDA only) ------------------------------------------------------------------------


def test_copy_is_refused_on_the_host_runtime() -> None:
    rt = reviva.Runtime("cpu")
    engine = reviva.TransferEngine(rt, reviva.PinnedHostPool(rt))
    with pytest.raises(ValueError, match="needs one tensor on cpu and one pinned CPU tensor"):
        engine.copy_(torch.empty(16), torch.ones(16))


@pytest.mark.gpu
@pytest.mark.parametrize("device", ["cuda"])
def test_copy_requires_a_pinned_cpu_tensor(engine: reviva.TransferEngine) -> None:
    with pytest.raises(ValueError, match="pinned"):
        engine.copy_(torch.empty(1024), torch.ones(1024, device="cuda"))
    with pytest.raises(ValueError, match="pinned"):
        engine.copy_(torch.empty(1024, device="cuda"), torch.ones(1024))


@pytest.mark.gpu
@pytest.mark.parametrize("device", ["cuda"])
def test_copy_round_trip_with_pinned_tensors(
    engine: reviva.TransferEngine, gen: torch.Generator
) -> None:
    src = random_tensor(((1 << 20) + 3,), torch.bfloat16, gen, "cuda")
    host = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
    d2h = engine.copy_(host, src)
    assert d2h.direction == "device-to-host"
    assert d2h.nbytes == src.nbytes
    d2h.wait()
    assert_bitwise_equal(host, src)
    back = torch.empty_like(src)
    h2d = engine.copy_(back, host)
    assert h2d.direction == "host-to-device"
    h2d.wait()
    assert_bitwise_equal(back, src)


# --- parse_bytes ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("24GB", 24 * 10**9),
        ("1.5GiB", 3 * 2**29),
        ("512MiB", 512 * 2**20),
        (" 4 kb ", 4000),
        ("100", 100),
        ("0", 0),
        (1 << 30, 1 << 30),
        (0, 0),
        # Decimal fractions whose product with the unit is a whole number: exact, not truncated
        # through a binary float (2.01 * 1000 is 2009.9999999999998 in floating point).
        ("2.01KB", 2010),
        ("8.19KB", 8190),
        ("2.01MB", 2_010_000),
    ],
)
def test_parse_bytes_reads_sizes(value: int | str, expected: int) -> None:
    result = reviva.parse_bytes(value)
    assert result == expected
    assert type(result) is int


@pytest.mark.parametrize(
    "value", ["12 parsecs", "-1", "", "GB", "1.5.2GB", "24 G B", float("inf"), float("nan"), -1]
)
def test_parse_bytes_rejects_non_sizes_naming_the_value(value: int | float | str) -> None:
    with pytest.raises(ValueError) as info:
        reviva.parse_bytes(value)
    assert repr(value) in str(info.value)


@pytest.mark.parametrize("value", [True, False, None, [1], b"24GB"])
def test_parse_bytes_rejects_other_types(value: object) -> None:
    with pytest.raises(TypeError):
        reviva.parse_bytes(value)  # type: ignore[arg-type]


# --- packaging ----------------------------------------------------------------------------------


def _needed_libraries(path: str) -> list[str]:
    out = subprocess.run(["readelf", "-d", path], capture_output=True, text=True, check=True)
    return [
        line.split("[", 1)[1].rstrip("]") for line in out.stdout.splitlines() if "(NEEDED)" in line
    ]


def test_native_libraries_share_the_process_libstdcxx() -> None:
    # A static copy of libstdc++ inside libreviva or _C, beside torch's shared one, crashed the
    # first `ostream << long` on the GPU machine (its image links -static-libstdc++ by default).
    import pathlib

    folder = pathlib.Path(reviva.__file__).parent
    libraries = [*folder.glob("libreviva.so*"), *folder.glob("_C*.so")]
    assert libraries, f"no native libraries found in {folder}"
    for lib in libraries:
        needed = _needed_libraries(str(lib))
        assert any(n.startswith("libstdc++.so") for n in needed), (
            f"{lib.name} does not link the shared libstdc++ (NEEDED: {needed})"
        )


def test_one_overlap_ratio_and_the_engines_stall_meter(
    engine: reviva.TransferEngine, device: str
) -> None:
    """Note [Overlap ratio]: one definition in the core, and the engine's stall meter counts the
    waits of wait_for (the one every path uses)."""
    from reviva._C import overlap_ratio

    assert overlap_ratio(25.0, 100.0) == 0.75
    assert overlap_ratio(0.0, 0.0) == 1.0 and overlap_ratio(300.0, 100.0) == 0.0
    x = torch.arange(1 << 20, dtype=torch.float32, device=device)
    h = engine.offload(x, record_stream=False)
    h.wait()
    y, t = engine.restore_async(h, record_stream=False)
    engine.wait_for(t)
    st = engine.stats()
    assert {"compute_stall_s", "stalls", "overlap_ratio"} <= st.keys()
    assert st["overlap_ratio"] == pytest.approx(
        overlap_ratio(st["compute_stall_s"], st["to_host"]["busy_s"] + st["to_device"]["busy_s"])
    )
    assert torch.equal(y, x)


def test_one_version_everywhere() -> None:
    """pyproject.toml's version is the package's, the core's and the installed metadata's (the
    one source: CMake reads it for the project and version_string())."""
    import re
    from importlib.metadata import PackageNotFoundError, version
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    want = re.search(r'^version = "([0-9.]+)"$', text, re.M).group(1)
    assert reviva.__version__ == want
    assert reviva.core_version().split("+")[0] == want
    assert reviva.core_version().split("+")[1] in ("cuda", "host")
    try:
        assert version("reviva") == want
    except PackageNotFoundError:  # (a source tree on the path: no metadata, the core's then)
        pass
