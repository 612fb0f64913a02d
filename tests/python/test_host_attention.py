"""Decode attention on the host (Note [Attention on the host] in src/host_attention.cpp, Note
[Host-side appends] in src/append_blocks.cpp): with RevivaConfig(decode_attention="host"), the
layers whose K/V streams after prefill stay in their pinned host copies, decode writes their new
rows there and attends them on the host's cores. Tiny models give plain HF's greedy and seeded
sampling tokens with it, for every family (sliding windows included) and with weights streamed
too; nothing of those layers moves to the device in decode (counted); the same manager serves
repeated calls, a returned cache and a call that raises; what it cannot serve is refused by
name; with streamed weights, decode's room holds a block more (Note [Decode rooms when the host
attends]). ("auto" takes the host only on a GPU, where planner.host_attention_pays: see
test_plan_cli; the CUDA path is measured on the H200: bench_weights' reviva_8b, reviva_8b_host.)"""

from __future__ import annotations

import copy
import dataclasses
from collections import Counter
from itertools import pairwise

import pytest
import torch
from test_generate import FAMILIES, SLIDING, tiny_model
from test_weights import budget_where
from transformers.generation.streamers import BaseStreamer

from reviva import RevivaConfig, RevivaManager
from reviva.cache.kv_cache import RevivaCache
from reviva.weights.streamed import DECODE_ROOMS, HOST_DECODE_ROOMS

PROMPT, NEW = 40, 10


def some_kv_streamed(p) -> bool:  # noqa: ANN001, ARG001
    """Any plan: budget_where then finds the least budget that fits, where most layers' K/V
    streams (the callers check that at least two do, on the plan found)."""
    return True


def host_manager(model, batch: int = 1) -> RevivaManager:  # noqa: ANN001
    """A manager whose plan for `batch` rows of PROMPT + NEW tokens streams most layers' K/V
    (the least budget that fits), decode attending them on the host."""
    manager = RevivaManager(copy.deepcopy(model), RevivaConfig(decode_attention="host"))
    _, plan = budget_where(manager, PROMPT, NEW, some_kv_streamed, batch=batch)
    assert plan.streamed_layers >= 2, plan
    return manager


def check_host_stats(
    manager: RevivaManager, batch: int = 1, new: int = NEW, fp8: bool = False
) -> None:
    st = manager.get_memory_stats()
    assert st.decode_attention == "host"
    assert st.host_attended_layers >= 1, st.summary()
    assert st.host_attended_layers == st.streamed_layers, "every streamed layer is on the host"
    steps = new - 1  # (the first token comes from prefill)
    assert st.host_attention_calls == st.host_attended_layers * steps
    lay = manager.layout
    # a token's K and V (fp8: e4m3 values and a 4-byte scale per head, Note [fp8 K/V rows])
    per_head = lay.head_dim + 4 if fp8 else lay.head_dim * lay.dtype.itemsize
    row = 2 * batch * lay.num_kv_heads * per_head
    assert st.bytes_written_on_host == st.host_attended_layers * steps * row
    assert st.decode_slots == 0, "no layer is fetched in decode: the slots went"


@pytest.mark.parametrize("family", FAMILIES + list(SLIDING))
def test_greedy_tokens_are_hfs_with_streamed_kv_attended_on_the_host(family: str) -> None:
    model = tiny_model(family)
    ids = torch.randint(1, 211, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    ref = model.generate(ids, max_new_tokens=NEW, do_sample=False)
    manager = host_manager(model)
    out = manager.generate(ids, max_new_tokens=NEW, do_sample=False)
    assert torch.equal(out, ref), f"{(out != ref).sum().item()} tokens differ"
    check_host_stats(manager)
    st = manager.get_memory_stats()
    # What moved to the device in decode: the layers promoted after prefill, once each (weights
    # are resident here); of the host-attended layers, nothing.
    lay = manager.layout
    row = 2 * lay.num_kv_heads * lay.head_dim * lay.dtype.itemsize
    assert st.decode.bytes_to_device == st.promoted_layers * PROMPT * row, st.decode
    # the same manager, again: the same tokens, the host layers chosen again
    again = manager.generate(ids, max_new_tokens=NEW, do_sample=False)
    assert torch.equal(again, ref)
    check_host_stats(manager)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3_sliding"])
def test_with_streamed_weights_and_seeded_sampling(family: str) -> None:
    model = tiny_model(family, seed=2)
    ids = torch.randint(1, 211, (2, PROMPT), generator=torch.Generator().manual_seed(3))
    kw = dict(max_new_tokens=NEW, do_sample=True, top_k=20, temperature=0.9)
    torch.manual_seed(7)
    ref = model.generate(ids, **kw)
    manager = RevivaManager(
        copy.deepcopy(model), RevivaConfig(decode_attention="host", stream_weights=True)
    )
    _, plan = budget_where(manager, PROMPT, NEW, some_kv_streamed, batch=2)
    assert plan.streamed_weight_layers >= 1 and plan.streamed_layers >= 2, plan
    torch.manual_seed(7)
    out = manager.generate(ids, **kw)
    assert torch.equal(out, ref), f"{(out != ref).sum().item()} tokens differ"
    check_host_stats(manager, batch=2)
    assert manager.get_memory_stats().weights_streamed


def test_weights_promoted_first_when_the_host_attends(monkeypatch: pytest.MonkeyPatch) -> None:
    """Note [Weights first when the host attends]: with host attention free (the model's rates
    set so), the room prefill leaves goes to streamed weights first: layers promoted (counted),
    their bytes no longer copied per step, and still HF's tokens, again and again."""
    import reviva.plan.decode_placement

    free = dataclasses.replace(
        reviva.plan.decode_placement.MODEL, host_attention_bps=1e18, host_attention_layer_s=0.0
    )
    monkeypatch.setattr(reviva.plan.decode_placement, "MODEL", free)
    model = tiny_model("llama", seed=12)
    ids = torch.randint(1, 211, (1, PROMPT), generator=torch.Generator().manual_seed(13))
    ref = model.generate(ids, max_new_tokens=NEW, do_sample=False)
    manager = RevivaManager(
        copy.deepcopy(model), RevivaConfig(decode_attention="host", stream_weights=True)
    )
    budget, plan = budget_where(manager, PROMPT, NEW, lambda p: p.streamed_weight_layers <= 3)

    def room_for_weights(p) -> int:  # noqa: ANN001  (what decode leaves, as the manager counts)
        room = p.budget - p.baseline - p.decode_working_set - p.weight_decode_device_bytes
        room -= (HOST_DECODE_ROOMS - DECODE_ROOMS) * p.weight_decode_block_bytes
        return (room - len(p.resident_layers) * p.layer_kv_bytes) // p.weight_layer_bytes

    while room_for_weights(plan) < 1:  # a budget a little larger, until a layer's room is left
        budget += 1 << 16
        manager.config = dataclasses.replace(manager.config, vram_budget=budget)
        plan = manager.plan(1, PROMPT, NEW)
    assert plan.streamed_weight_layers >= 2 and plan.streamed_layers >= 2, plan
    for _ in range(2):
        out = manager.generate(ids, max_new_tokens=NEW, do_sample=False)
        assert torch.equal(out, ref)
        st = manager.get_memory_stats()
        check_host_stats(manager)
        assert st.weight_layers_promoted_in_decode >= 1, st.summary()
        assert st.weight_resident_layers == (
            len(plan.weight_resident_layers) + st.weight_layers_promoted_in_decode
        )


def copies_issued_when_the_host_attends(
    manager: RevivaManager, monkeypatch: pytest.MonkeyPatch
) -> list[tuple[int, Counter]]:
    """Each host attention of a streamed-weight layer in decode: the layer, and how many copies
    of each of the store's blocks (indices) had been issued by then since the manager was made
    (the store's copies waited for there, then its timeline read: block ids count from 1)."""
    weights = manager.weights
    seen: list[tuple[int, Counter]] = []
    attend = RevivaCache.host_attend

    def spy(cache, layer_idx, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if not weights.resident(layer_idx):
            weights.store.synchronize()
            events = weights.store.timeline()
            copies = Counter(e["block"] - 1 for e in events if e["kind"] == "copy_to_device")
            seen.append((layer_idx, copies))
        return attend(cache, layer_idx, *args, **kwargs)

    monkeypatch.setattr(RevivaCache, "host_attend", spy)
    return seen


class SlotSpy:
    """A WeightStore's stand-in that records, at each set_slot_bytes, the bytes asked for and the
    slots the store had then (everything else goes to the store)."""

    def __init__(self, store) -> None:  # noqa: ANN001
        self._store = store
        self.raised: list[tuple[int, int]] = []

    def set_slot_bytes(self, nbytes: int, block_bytes: int = 0) -> None:
        self.raised.append((nbytes, int(self._store.stats()["slots"])))
        self._store.set_slot_bytes(nbytes, block_bytes)

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self._store, name)


def test_decode_room_holds_a_block_more_when_the_host_attends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Note [Decode rooms when the host attends] (weights/streamed.py): with the host attending,
    decode's room for streamed weights is HOST_DECODE_ROOMS blocks with a window of one less, so
    that when the host starts a streamed layer's attention (the Python thread blocked there) the
    copies of its MLP's first two projections have been issued; with the K/V fetched, decode keeps
    its room of two blocks, one ahead. The planner leaves that block out of what it promotes."""
    model = tiny_model("llama", seed=14)
    ids = torch.randint(1, 211, (1, PROMPT), generator=torch.Generator().manual_seed(15))
    ref = model.generate(ids, max_new_tokens=NEW, do_sample=False)
    for choice in ("host", "device"):
        manager = RevivaManager(
            copy.deepcopy(model), RevivaConfig(decode_attention=choice, stream_weights=True)
        )
        _, plan = budget_where(manager, PROMPT, NEW, lambda p: p.streamed_weight_layers <= 3)
        assert plan.streamed_weight_layers >= 2 and plan.streamed_layers >= 2, plan
        assert plan.weight_decode_block_bytes > 0, plan
        seen = copies_issued_when_the_host_attends(manager, monkeypatch)
        spy = SlotSpy(manager.weights.store)
        manager.weights.store = spy
        out = manager.generate(ids, max_new_tokens=NEW, do_sample=False)
        assert torch.equal(out, ref), f"{choice}: {(out != ref).sum().item()} tokens differ"
        st = manager.get_memory_stats()
        w = manager.weights
        block = plan.weight_decode_block_bytes
        if choice == "host":
            check_host_stats(manager)
            assert (st.weight_slots, st.weight_prefetch_blocks) == (
                HOST_DECODE_ROOMS,
                HOST_DECODE_ROOMS - 1,
            ), st.summary()
            assert st.weight_slot_bytes == block
            assert w.decode_room_bytes(HOST_DECODE_ROOMS) == HOST_DECODE_ROOMS * block
            # each time (after the call's first): the layer's up projection (its third block)
            # was copied since the host attention before, i.e. this step's copy was issued
            # before the host started (with two rooms it comes only after)
            assert len(seen) >= 2 * (NEW - 1), len(seen)
            for (_, before), (i, now) in pairwise(seen):
                up = w.parts[i][2]
                assert now[up] == before[up] + 1, (i, w.parts[i], before, now)
            # one block more than the device's room, out of what the planner promotes
            assert plan.promotable_layers(True) <= plan.promotable_layers(False)
        else:
            assert not seen and st.host_attended_layers == 0
            assert (st.weight_slots, st.weight_prefetch_blocks) == (1, 1), st.summary()
            assert st.weight_slot_bytes == DECODE_ROOMS * block
        again = manager.generate(ids, max_new_tokens=NEW, do_sample=False)
        assert torch.equal(again, ref)
        # a call's start raises the slot to a whole layer with at most one slot (after a decode
        # of HOST_DECODE_ROOMS one-block slots too): the room it maps is one layer's
        whole = max(w.layer_device_bytes)
        starts = [slots for nbytes, slots in spy.raised if nbytes == whole]
        assert len(starts) >= 2 and max(starts) <= max(plan.weight_slots, 1), spy.raised


def test_host_and_device_calls_alternate_on_one_manager_with_streamed_weights() -> None:
    """The H200's sequence at 5ce5c4c (a batch-1 call on the device after host-attended ones ran
    out of memory): calls attending on the host and on the device, of different shapes, take
    turns on one manager with streamed weights under one budget, one of them raising mid-decode;
    each gives plain HF's tokens, and each call's start maps at most one whole layer's room for
    streamed weights."""
    model = tiny_model("llama", seed=16)
    gen = torch.Generator().manual_seed(17)
    one = torch.randint(1, 211, (1, PROMPT), generator=gen)
    two = torch.randint(1, 211, (2, PROMPT // 2), generator=gen)
    refs = {
        1: model.generate(one, max_new_tokens=NEW, do_sample=False),
        2: model.generate(two, max_new_tokens=NEW, do_sample=False),
    }
    manager = RevivaManager(
        copy.deepcopy(model), RevivaConfig(decode_attention="host", stream_weights=True)
    )
    _, plan = budget_where(manager, PROMPT, NEW, lambda p: p.streamed_weight_layers <= 3)
    assert plan.streamed_weight_layers >= 2 and plan.streamed_layers >= 2, plan
    spy = SlotSpy(manager.weights.store)
    manager.weights.store = spy
    base = manager.config
    for choice, batch in (("host", 1), ("device", 2), ("host", 1), ("device", 1), ("host", 2)):
        manager.config = dataclasses.replace(base, decode_attention=choice)
        ids = one if batch == 1 else two
        out = manager.generate(ids, max_new_tokens=NEW, do_sample=False)
        assert torch.equal(out, refs[batch]), f"{choice}, batch {batch}"
        st = manager.get_memory_stats()
        assert st.decode_attention == choice
        rooms = HOST_DECODE_ROOMS if choice == "host" else 1
        if st.weight_streamed_layers:
            assert st.weight_slots == rooms, (choice, st.summary())
    # a host-attended call that raises mid-decode (its three rooms held), then the next call
    manager.config = dataclasses.replace(base, decode_attention="host")
    with pytest.raises(RuntimeError, match="streamer failed"):
        manager.generate(one, max_new_tokens=NEW, do_sample=False, streamer=Boom(4))
    manager.config = dataclasses.replace(base, decode_attention="device")
    assert torch.equal(manager.generate(one, max_new_tokens=NEW, do_sample=False), refs[1])
    whole = max(manager.weights.layer_device_bytes)
    starts = [slots for nbytes, slots in spy.raised if nbytes == whole]
    assert len(starts) == 7 and max(starts) <= max(plan.weight_slots, 1), spy.raised


def test_auto_and_device_keep_decode_on_the_device_on_the_cpu() -> None:
    """ "auto" (which takes the host only on a GPU: the CPU's cores are the device's already)
    and "device" fetch decode's streamed K/V as before: the same tokens, nothing attended on the
    host."""
    model = tiny_model("llama")
    ids = torch.randint(1, 211, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    ref = model.generate(ids, max_new_tokens=NEW, do_sample=False)
    for choice in ("auto", "device"):
        manager = RevivaManager(copy.deepcopy(model), RevivaConfig(decode_attention=choice))
        budget_where(manager, PROMPT, NEW, some_kv_streamed)
        assert torch.equal(manager.generate(ids, max_new_tokens=NEW, do_sample=False), ref)
        st = manager.get_memory_stats()
        assert st.decode_attention == "device" and st.host_attended_layers == 0
        assert st.host_attention_calls == 0


def test_a_returned_cache_continues_from_host_attended_layers() -> None:
    """Note [A returned cache]: a call's cache whose layers were attended on the host is parked
    from their host copies, and a call continuing from it gives plain HF's tokens."""
    model = tiny_model("llama", seed=5)
    ids = torch.randint(1, 211, (1, PROMPT), generator=torch.Generator().manual_seed(6))
    ref = model.generate(ids, max_new_tokens=NEW + 6, do_sample=False)
    manager = host_manager(model)
    first = manager.generate(ids, max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True)
    check_host_stats(manager)
    assert torch.equal(first.sequences, ref[:, : PROMPT + NEW])
    more = manager.generate(
        first.sequences, past_key_values=first.past_key_values, max_new_tokens=6, do_sample=False
    )
    assert torch.equal(more, ref)


@pytest.mark.parametrize("family", ["llama", "qwen3"])  # (fp8 takes no sliding window yet)
def test_fp8_rows_attended_on_the_host_give_the_devices_tokens(family: str) -> None:
    """fp8 K/V (Note [fp8 K/V rows]) attended on the host: the new rows quantized as the store
    does and written to the host copy, the host reading e4m3 values and their scales
    (host_decode_attention's Fp8E4M3 rows). The same tokens as the same plan with decode on the
    device (both attend the same fp8 values in fp32), on repeated calls; what the host wrote is
    fp8 rows' bytes."""
    model = tiny_model(family, seed=4)
    ids = torch.randint(1, 211, (1, PROMPT), generator=torch.Generator().manual_seed(5))
    outs = {}
    for choice in ("device", "host"):
        manager = RevivaManager(
            copy.deepcopy(model), RevivaConfig(decode_attention=choice, kv_dtype="fp8")
        )
        _, plan = budget_where(manager, PROMPT, NEW, some_kv_streamed)
        assert plan.streamed_layers >= 2 and plan.kv_fp8, plan
        outs[choice] = [manager.generate(ids, max_new_tokens=NEW, do_sample=False) for _ in "ab"]
        if choice == "host":
            check_host_stats(manager, fp8=True)
    assert torch.equal(outs["host"][0], outs["device"][0])
    assert torch.equal(outs["host"][1], outs["host"][0])


def test_fp8_some_layers_on_the_host_beside_the_fetched(monkeypatch: pytest.MonkeyPatch) -> None:
    """Note [The host beside the copies] (plan/host_decode.py): with fp8 rows, "auto" on a GPU
    attends some of the layers still streamed after prefill on the host while the others are fetched
    (planner.host_kv_layers picks how many; forced to 2 here, on the CPU, where "auto" never takes
    the host). The same tokens as every layer fetched, on repeated calls; 2 layers on the host, the
    rest fetched through the slots they keep."""
    model = tiny_model("llama", seed=6)
    ids = torch.randint(1, 211, (1, PROMPT), generator=torch.Generator().manual_seed(7))
    device = RevivaManager(copy.deepcopy(model), RevivaConfig(kv_dtype="fp8"))
    budget, plan = budget_where(device, PROMPT, NEW, some_kv_streamed)
    ref = device.generate(ids, max_new_tokens=NEW, do_sample=False)
    fetched = device.get_memory_stats().streamed_layers
    assert fetched >= 3, device.get_memory_stats().summary()

    def two_beside(self, plan, beams, padded, share) -> bool:  # noqa: ANN001, ARG001
        self._phase["host_beside_copies"] = 2
        return True

    monkeypatch.setattr(RevivaManager, "_decode_attention_on_host", two_beside)
    manager = RevivaManager(copy.deepcopy(model), RevivaConfig(kv_dtype="fp8", vram_budget=budget))
    for _ in range(2):
        assert torch.equal(manager.generate(ids, max_new_tokens=NEW, do_sample=False), ref)
        st = manager.get_memory_stats()
        assert st.decode_attention == "host" and st.host_attended_layers == 2, st.summary()
        assert st.streamed_layers == fetched and st.decode_slots >= 1, st.summary()
        assert st.host_attention_calls == 2 * (NEW - 1)


class Boom(BaseStreamer):
    def __init__(self, after: int) -> None:
        self.seen, self.after = 0, after

    def put(self, value: torch.Tensor) -> None:
        self.seen += 1
        if self.seen > self.after:
            raise RuntimeError("streamer failed")

    def end(self) -> None:
        pass


def test_a_call_that_raises_mid_decode_leaves_the_manager_usable() -> None:
    model = tiny_model("llama", seed=8)
    ids = torch.randint(1, 211, (1, PROMPT), generator=torch.Generator().manual_seed(9))
    ref = model.generate(ids, max_new_tokens=NEW, do_sample=False)
    manager = host_manager(model)
    with pytest.raises(RuntimeError, match="streamer failed"):
        manager.generate(ids, max_new_tokens=NEW, do_sample=False, streamer=Boom(4))
    assert torch.equal(manager.generate(ids, max_new_tokens=NEW, do_sample=False), ref)
    check_host_stats(manager)


def test_what_the_host_cannot_attend_is_refused_by_name() -> None:
    model = tiny_model("llama")
    ids = torch.randint(1, 211, (2, PROMPT), generator=torch.Generator().manual_seed(1))
    manager = host_manager(model, batch=2)
    with pytest.raises(ValueError, match=r"decode_attention='host'\) with num_beams=2"):
        manager.generate(ids[:1], max_new_tokens=4, num_beams=2, do_sample=False)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    with pytest.raises(ValueError, match="a padded batch"):
        manager.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    with pytest.raises(ValueError, match="decode_attention must be 'auto', 'device' or 'host'"):
        RevivaConfig(decode_attention="cpu")


@pytest.mark.gpu
def test_gpu_bf16_host_attention_as_close_to_fp32_as_the_devices() -> None:
    """A 1B-shaped bf16 model on the CPU computing on CUDA with weights and K/V streamed: decode
    attending the streamed K/V on the host gives the same tokens as
    attending it on the device, and each decode step's logits are as close to an fp32 run of
    the same weights over the same tokens (<= 1.5x the device path's error, plus bf16's step):
    the host reads bf16 rows into fp32 sums, the device's flash kernel does the same."""
    from test_generate import gpu_llama

    from reviva.cli.demo import fp32_reference_logits
    from reviva.cli.demo import relative_error as rel

    gpu_model = gpu_llama(8, 32768, torch.bfloat16)
    with torch.no_grad():
        gpu_model.lm_head.weight.mul_(8.0)
    prompt, new = 16384, 8  # (long enough that K/V still streams after decode's promotions)
    ids = torch.randint(1, 32000, (1, prompt), device="cuda")
    kwargs = dict(
        max_new_tokens=new, do_sample=False, output_logits=True, return_dict_in_generate=True
    )
    cpu_model = copy.deepcopy(gpu_model).to("cpu")
    del gpu_model
    torch.cuda.empty_cache()
    fixed = dict(device="cuda", chunk_tokens=1024, prefill_attention="chunked")
    runs = {}
    for choice in ("device", "host"):
        manager = RevivaManager(
            copy.deepcopy(cpu_model), RevivaConfig(decode_attention=choice, **fixed)
        )
        # (the least budget, and 64 MiB more: the call plans again with the device as it is then)
        budget, _ = budget_where(manager, prompt, new, lambda p: True)
        manager.config = dataclasses.replace(manager.config, vram_budget=budget + (64 << 20))
        out = manager.generate(ids, **kwargs)
        st = manager.get_memory_stats()
        assert st.weights_streamed and st.streamed_layers >= 2, st.summary()
        assert st.decode_attention == choice
        runs[choice] = (out, st)
        again = manager.generate(ids, **kwargs)
        assert torch.equal(again.sequences, out.sequences), choice
        del manager
    dev, host = runs["device"][0], runs["host"][0]
    st = runs["host"][1]
    assert st.host_attended_layers == st.streamed_layers >= 2
    assert st.host_attention_calls == st.host_attended_layers * (new - 1)
    assert torch.equal(host.sequences, dev.sequences)
    model = cpu_model.to("cuda")
    exact = fp32_reference_logits(model, dev.sequences[:, :-1], keep=new)  # [1, new, vocab]
    for t in range(1, new):  # (step 0 is prefill's: the same path in both)
        err_dev, err_host = rel(dev.logits[t], exact[:, t]), rel(host.logits[t], exact[:, t])
        assert err_host <= 1.5 * err_dev + 4e-3, (t, err_host, err_dev)


def test_host_kv_views_hold_the_store_and_clear_and_close_wait_for_them() -> None:
    """KVStore.host_kv's views of a host-attended layer's host copy: read after close() they
    read memory given back (then crashed); now close() and clear() refuse while a view lives,
    naming how many, and a view outlives the store object, reading the values written."""
    from reviva import KVStore
    from reviva.resources import device_resources

    res = device_resources(torch.device("cpu"))

    def store_with_rows() -> tuple[KVStore, torch.Tensor]:
        store = KVStore(res.engine, res.arena, 1, 1, 2, 16, torch.float32, 64)
        store.add_slot()
        store.acquire(0)
        rows = torch.randn(1, 2, 8, 16, generator=torch.Generator().manual_seed(2))
        store.write(0, 0, rows, rows.clone())
        store.release(0)
        store.attend_on_host(0)
        return store, rows

    store, rows = store_with_rows()
    k, v = store.host_kv(0, 8)
    assert torch.equal(k, rows)
    for call in (store.close, store.clear):
        with pytest.raises(ValueError, match=r"1 result\(s\) of host_kv\(\) still view"):
            call()
    del k, v
    store.close()
    store, rows = store_with_rows()
    k, _ = store.host_kv(0, 8)
    del store, _
    import gc

    gc.collect()
    assert torch.equal(k, rows)  # (the store's memory lives as long as its views)
