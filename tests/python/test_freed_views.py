"""Views that escape torch's checks: a numpy array, a DLPack capsule or a storage taken from a
tensor of WeightStore.acquire or KVStore.view/kv holds the raw address, which the revoke of
Note [Revoked views] (python/csrc/leases.h) cannot reach. Such a view kept past release reads
the bytes it was lent (the store never gives that memory to another layer while it lives: Note
[Memory held by views] in src/arena_device_allocator.cpp), never the next layer's, and never
freed memory: the sequences with the store deleted and the arena reclaimed run in a subprocess,
so that a segfault fails the test instead of killing pytest."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch.utils import dlpack

import reviva

LAYERS, KV_HEADS, DIM, CAP, TOKENS = 3, 2, 8, 64, 20
WEIGHT_BYTES = 256

# Each way out of torch's checks, from a tensor `t` the store lent: what it returns is indexed
# like a flat uint8 array of the tensor's bytes.
ESCAPES: dict[str, Callable[[torch.Tensor], object]] = {
    "numpy": lambda t: t.numpy(),
    "np.asarray": lambda t: np.asarray(t),
    "np.from_dlpack": lambda t: np.from_dlpack(t),
    "torch.from_dlpack": lambda t: torch.from_dlpack(dlpack.to_dlpack(t)),
    "storage of from_numpy": lambda t: torch.from_numpy(t.numpy()).untyped_storage(),
}


def as_bytes(view: object) -> np.ndarray:
    """The escaped view's bytes, read now."""
    if isinstance(view, torch.UntypedStorage):
        return np.frombuffer(bytes(view), dtype=np.uint8).copy()
    if isinstance(view, torch.Tensor):
        return view.contiguous().view(torch.uint8).reshape(-1).numpy().copy()
    return np.ascontiguousarray(view).reshape(-1).view(np.uint8).copy()


def weight_store(arena: reviva._C.DeviceArena | None = None) -> reviva._C.WeightStore:
    """Every layer streamed through one slot: each acquire reuses the last one's memory."""
    res = reviva.device_resources(torch.device("cpu"))
    store = reviva._C.WeightStore(res.engine, arena or res.arena, [WEIGHT_BYTES] * LAYERS)
    for i in range(LAYERS):
        store.host(i).copy_(torch.full((WEIGHT_BYTES,), i + 1, dtype=torch.uint8))
    store.set_residency([], 1, 1)
    return store


@pytest.mark.parametrize("escape", sorted(ESCAPES))
def test_weights_escaped_before_release_never_read_the_next_layer(escape: str) -> None:
    store = weight_store()
    w0 = store.acquire(0)
    view = ESCAPES[escape](w0)
    del w0
    store.release(0)
    w1 = store.acquire(1)  # (the one slot's memory held layer 1 here before the fix)
    assert int(w1[0]) == 2 and int(w1[-1]) == 2
    assert (as_bytes(view) == 1).all(), f"{escape} kept past release reads another layer's bytes"
    del w1
    store.release(1)
    w0 = store.acquire(0)  # (and layer 0 comes back whole)
    assert int(w0.sum()) == WEIGHT_BYTES
    del w0
    store.release(0)
    del view


def test_weights_written_through_numpy_after_release_reach_no_other_layer() -> None:
    store = weight_store()
    w0 = store.acquire(0)
    kept = w0.numpy()
    store.release(0)
    w1 = store.acquire(1)
    kept[:] = 9  # (its own memory: the store gave layer 1 other memory)
    assert (w1 == 2).all(), "a write through a stale numpy view reached layer 1's weights"
    with pytest.raises(RuntimeError, match=r"used after WeightStore\.release\(0\)"):
        w0.sum()  # (torch's own view of it is revoked, as before)
    del w1
    store.release(1)


def test_memory_held_by_a_view_goes_back_when_the_view_dies() -> None:
    res = reviva.device_resources(torch.device("cpu"))
    arena = reviva._C.DeviceArena(res.engine.runtime)
    store = weight_store(arena)
    w0 = store.acquire(0)
    kept = w0.numpy()
    del w0
    store.release(0)
    store.acquire(1)  # (a second buffer: the first is the view's)
    store.release(1)
    store.trim()
    arena.reclaim(True)
    assert arena.stats()["mapped_bytes"] == arena.granularity, "the view's memory went back early"
    assert (kept == 1).all()
    del kept
    arena.reclaim(True)
    assert arena.stats()["mapped_bytes"] == 0, "the view's memory stayed after the view died"


def test_memory_held_by_a_view_counts_against_the_arena_limit_and_is_named() -> None:
    res = reviva.device_resources(torch.device("cpu"))
    arena = reviva._C.DeviceArena(res.engine.runtime, limit_bytes=1)
    arena.limit_bytes = arena.granularity  # (room for the one slot)
    store = weight_store(arena)
    w0 = store.acquire(0)
    kept = np.from_dlpack(w0)
    del w0
    store.release(0)
    with pytest.raises(reviva.RevivaOutOfMemoryError, match="still held by views"):
        store.acquire(1)
    assert (kept == 1).all()
    del kept
    w1 = store.acquire(1)  # (the view gone, its memory serves the next layer)
    assert int(w1[0]) == 2
    del w1
    store.release(1)


def kv_store() -> tuple[reviva.KVStore, torch.Tensor]:
    res = reviva.device_resources(torch.device("cpu"))
    store = reviva.KVStore(
        res.engine, res.arena, LAYERS, 1, KV_HEADS, DIM, torch.float32, CAP, prefetch_layers=0
    )
    store.add_slot()  # (every layer streams through one slot, none held ahead)
    rows = torch.randn(LAYERS, 1, KV_HEADS, TOKENS, DIM)
    for i in range(LAYERS):
        store.acquire(i)
        store.write(i, 0, rows[i], rows[i] + 1)
        store.release(i)
    return store, rows


@pytest.mark.parametrize("escape", sorted(ESCAPES))
def test_kv_escaped_before_release_never_reads_the_next_layer(escape: str) -> None:
    store, rows = kv_store()
    store.acquire(0)
    view = ESCAPES[escape](store.view(0, TOKENS))
    store.release(0)
    for i in (1, 2, 1, 2):  # (the next layers through the slot: layer 0's memory, before)
        store.acquire(i)
        k1, _ = store.kv(i, TOKENS)
        assert torch.equal(k1, rows[i])
        del k1
        store.release(i)
    got = as_bytes(view)
    # (the view is [tokens, 2, batch, heads, dim] token-major: its K rows are layer 0's keys)
    as_rows = torch.from_numpy(got).view(torch.float32).view(TOKENS, 2, 1, KV_HEADS, DIM)
    assert torch.equal(as_rows[:, 0].permute(1, 2, 0, 3), rows[0]), f"{escape}: not layer 0's K"
    del view


SCRIPT = """
import gc, sys
import numpy as np, torch
from torch.utils import dlpack
import reviva

kind, escape = sys.argv[1], sys.argv[2]
escapes = {
    "numpy": lambda t: t.numpy(),
    "np.from_dlpack": lambda t: np.from_dlpack(t),
    "torch.from_dlpack": lambda t: torch.from_dlpack(dlpack.to_dlpack(t)),
    "storage of from_numpy": lambda t: torch.from_numpy(t.numpy()).untyped_storage(),
}
res = reviva.device_resources(torch.device("cpu"))
arena = reviva._C.DeviceArena(res.engine.runtime)
if kind == "weights":
    store = reviva._C.WeightStore(res.engine, arena, [1 << 20] * 3)
    for i in range(3):
        store.host(i).fill_(i + 1)
    store.set_residency([], 1, 1)
    view = escapes[escape](store.acquire(0))
    store.release(0)
    store.acquire(1)
    store.release(1)
    want = 1
else:
    store = reviva._C.KVStore(res.engine, arena, 3, 1, 2, 8, torch.float32, 1 << 14, 0)
    store.add_slot()
    for i in range(3):
        store.acquire(i)
        rows = torch.full((1, 2, 1 << 13, 8), float(i + 1))
        store.write(i, 0, rows, rows)
        store.release(i)
    store.acquire(0)
    view = escapes[escape](store.view(0, 1 << 13))
    store.release(0)
    want = 1.0
del store
gc.collect()
arena.reclaim(True)
res.arena.reclaim(True)
t = torch.from_numpy(np.frombuffer(bytes(view), dtype=np.uint8).copy()) if isinstance(
    view, torch.UntypedStorage) else torch.as_tensor(view)
t = t.view(torch.uint8) if kind == "weights" else t.reshape(-1).view(torch.float32)
assert bool((t.reshape(-1)[:1024] == want).all()), t.reshape(-1)[:8]
if isinstance(view, torch.UntypedStorage):
    view.fill_(7)
elif isinstance(view, torch.Tensor):
    view.fill_(7)
else:
    view[...] = 7
print("ok")
"""


@pytest.mark.parametrize("kind", ["weights", "kv"])
@pytest.mark.parametrize(
    "escape", ["numpy", "np.from_dlpack", "torch.from_dlpack", "storage of from_numpy"]
)
def test_a_view_outliving_the_store_and_the_reclaimed_arena_reads_its_bytes(
    kind: str, escape: str
) -> None:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SCRIPT), kind, escape],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), (
        f"{kind}/{escape}: exit {out.returncode} (-11: segfault)\n{out.stdout}\n{out.stderr}"
    )
