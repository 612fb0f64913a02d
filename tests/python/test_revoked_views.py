"""Tensors over memory that is lent until a release (Note [Revoked views] in
python/csrc/leases.h): KVStore.view/kv/page_kv and WeightStore.acquire/resident_view. Kept past
the call that gives the memory back, they raise naming that call on any read or write of their
data (and so does every view of them), instead of reading the next layer's K/V or weights; a
copy taken before stays valid, and the memory itself goes back."""

from __future__ import annotations

import pytest
import torch

import reviva

LAYERS, KV_HEADS, DIM, CAP = 3, 2, 8, 64


def kv_store(**kwargs: int) -> tuple[reviva.KVStore, torch.Tensor]:
    res = reviva.device_resources(torch.device("cpu"))
    store = reviva.KVStore(
        res.engine, res.arena, LAYERS, 1, KV_HEADS, DIM, torch.float32, CAP, **kwargs
    )
    store.add_slot()  # (every layer streams through one slot: each acquire reuses its memory)
    rows = torch.randn(LAYERS, 1, KV_HEADS, 20, DIM)
    for i in range(LAYERS):
        if store.paged(i):  # (written page by page by write itself)
            store.write(i, 0, rows[i], rows[i] + 1)
            continue
        store.acquire(i)
        store.write(i, 0, rows[i], rows[i] + 1)
        store.release(i)
    return store, rows


def test_kv_kept_past_release_raises_naming_the_call() -> None:
    store, rows = kv_store()
    store.acquire(0)
    k, v = store.kv(0, 20)
    head = k[0, 1]  # (a view of the view: the same storage)
    kept = k.clone()
    assert torch.equal(k, rows[0]) and torch.equal(v, rows[0] + 1)
    store.release(0)
    store.acquire(1)  # (the slot's memory now holds layer 1)
    for t in (k, v, head):
        with pytest.raises(
            RuntimeError,
            match=r"KVStore\.view\(0, \.\.\.\) or kv\(0, \.\.\.\) used after KVStore\.release\(0\)",
        ):
            t.sum()
        assert t.shape[-1] == DIM and t.dtype == torch.float32  # (metadata still reads)
    with pytest.raises(RuntimeError, match="used after KVStore.release"):
        k.fill_(0)  # (a write too: it would have overwritten layer 1's K/V)
    assert torch.equal(kept, rows[0])
    k1, _ = store.kv(1, 20)
    assert torch.equal(k1, rows[1]), "layer 1's rows changed"
    del k1
    store.release(1)


def test_a_view_dropped_before_release_costs_nothing_and_views_taken_again_read() -> None:
    store, rows = kv_store()
    for _ in range(3):
        store.acquire(2)
        k, _ = store.view(2, 20).unbind(1)[0], None
        assert torch.equal(k.permute(1, 2, 0, 3), rows[2])
        del k
        store.release(2)
    store.acquire(2)
    assert torch.equal(store.kv(2, 20)[0], rows[2])
    store.release(2)


def test_views_alive_at_clear_are_revoked() -> None:
    store, _ = kv_store()
    store.acquire(0)
    k, _ = store.kv(0, 20)
    store.release(0)
    store.acquire(1)
    k1, _ = store.kv(1, 20)
    store.release(1)
    store.clear()
    with pytest.raises(RuntimeError, match=r"used after KVStore\.release\(1\)"):
        k1.sum()
    with pytest.raises(RuntimeError, match=r"used after KVStore\.release\(0\)"):
        k.sum()


def test_page_views_kept_past_release_page_raise() -> None:
    store, rows = kv_store(page_tokens=8)
    assert store.paged(0)
    store.acquire_page(0, 1)
    k, _ = store.page_kv(0, 1, 8)
    assert torch.equal(k, rows[0][:, :, 8:16])
    store.release_page(0, 1)
    with pytest.raises(
        RuntimeError,
        match=r"KVStore\.page_view\(0, 1, \.\.\.\) used after KVStore\.release_page\(0, 1\)",
    ):
        k.sum()


def weight_store(resident: list[int]) -> reviva._C.WeightStore:
    res = reviva.device_resources(torch.device("cpu"))
    store = reviva._C.WeightStore(res.engine, res.arena, [256] * LAYERS)
    for i in range(LAYERS):
        store.host(i).copy_(torch.full((256,), i + 1, dtype=torch.uint8))
    store.set_residency(resident, 1, 1)
    return store


def test_weights_kept_past_release_raise_naming_the_call() -> None:
    store = weight_store([])
    w0 = store.acquire(0)
    as_float = w0.view(torch.float32)  # (a parameter laid out over it)
    kept = w0.clone()
    store.release(0)
    w1 = store.acquire(1)  # (the one slot holds layer 1 now)
    assert int(w1[0]) == 2
    for t in (w0, as_float):
        with pytest.raises(
            RuntimeError, match=r"WeightStore\.acquire\(0\) used after WeightStore\.release\(0\)"
        ):
            t.sum()
    assert int(kept[0]) == 1 and int(w1[0]) == 2
    del w1
    store.release(1)


def test_resident_views_are_revoked_when_the_layer_stops_being_resident() -> None:
    store = weight_store([0])
    view = store.resident_view(0)
    store.acquire(0)
    store.release(0)
    assert int(view[0]) == 1  # (resident: valid across acquire and release)
    store.set_residency([0, 1], 1, 1)
    assert int(view[0]) == 1  # (still resident)
    store.set_residency([1], 1, 1)
    with pytest.raises(
        RuntimeError,
        match=r"WeightStore\.resident_view\(0\) used after set_residency left layer 0 out",
    ):
        view.sum()
