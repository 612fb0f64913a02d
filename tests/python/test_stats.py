"""RevivaManager.get_memory_stats(): a typed object (reviva.stats.GenerateStats) in bytes and
seconds (Note [One naming scheme]), with what each phase did, that reads as a mapping too."""

from __future__ import annotations

import dataclasses
import json
import typing

import pytest
import torch
from test_lifetime import ids_for, streaming_manager, tiny_model

from reviva import RevivaConfig, RevivaManager
from reviva.stats import GenerateStats, PhaseStats

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _unit_ok(name: str, kind: object) -> bool:
    """A field's name says its unit: sizes end in _bytes, times in _s, rates in _tok_s/_gbps;
    the rest are counts, names, flags and nested figures."""
    banned = ("_mb", "_mib", "_ms", "_gb", "vram", "h2d", "d2h")
    return not any(name.endswith(b) or b + "_" in name for b in banned)


def test_stats_are_typed_in_bytes_and_seconds_with_one_naming_scheme() -> None:
    hints = typing.get_type_hints(GenerateStats)
    for f in dataclasses.fields(GenerateStats):
        assert _unit_ok(f.name, hints[f.name]), f.name
        if f.name.endswith("_bytes"):
            assert hints[f.name] in (int, int | None), (f.name, hints[f.name])
        if f.name.endswith("_s"):
            ok = (float, float | None, dict[str, float])  # (a dict: seconds by step)
            assert hints[f.name] in ok, (f.name, hints[f.name])
    for f in dataclasses.fields(PhaseStats):
        assert _unit_ok(f.name, None), f.name
    # training's stats use the same names for the same things
    from reviva.activations.offload import ActivationStats

    names = {f.name for f in dataclasses.fields(ActivationStats)}
    assert {"bytes_to_host", "bytes_to_device", "stall_s", "host_wait_s"} <= names, names
    assert not any(n.endswith(("_ms", "_mb")) for n in names), names


@pytest.mark.parametrize("device", DEVICES)
def test_stats_say_what_each_phase_did(device: str) -> None:
    model = tiny_model(device, seed=21)
    ids = ids_for(device, 96, seed=22)
    manager = streaming_manager(model, 96, 8)
    assert manager.get_memory_stats() is None  # before any call
    for _ in range(2):  # the same call again: its own figures, not a sum of both
        out = manager.generate(ids, max_new_tokens=8, do_sample=False)
        st = manager.get_memory_stats()
        assert isinstance(st, GenerateStats)
        plan = manager.plan(1, 96, 8)
        assert st.budget_bytes == plan.budget and isinstance(st.budget_bytes, int)
        assert st.layer_kv_bytes == plan.layer_kv_bytes
        p, d = st.prefill, st.decode
        # prefill streamed layers' K/V; what decode promoted shows in decode, not instead
        assert p.kv_streamed_layers == 5 - st.resident_layers_in_prefill >= 2, st
        assert d.kv_streamed_layers == st.streamed_layers <= p.kv_streamed_layers, st
        assert d.kv_resident_layers + d.kv_streamed_layers == 5
        assert p.tokens == 96 and d.tokens == st.decode_steps == out.shape[1] - 96 - 1
        # streamed K/V went to the host in prefill and came back in decode
        assert p.bytes_to_host > 0 and d.bytes_to_device > 0, st
        assert p.bytes_to_host + d.bytes_to_host == st.bytes_to_host, st
        assert p.bytes_to_device + d.bytes_to_device == st.bytes_to_device, st
        assert p.seconds == st.prefill_s > 0 and d.seconds == st.decode_s > 0
        assert d.tok_s == pytest.approx(st.decode_tok_s) and d.seconds_per_token > 0
        assert st.stall_s >= 0 and p.stall_s + d.stall_s >= st.stall_s - 1e-9
        if device == "cuda":
            assert st.peak_device_bytes == max(p.peak_device_bytes, d.peak_device_bytes)
            assert st.peak_device_bytes <= plan.budget
        else:
            assert st.peak_device_bytes is None and p.peak_device_bytes is None
        # the mapping view and the JSON view
        assert st["streamed_layers"] == st.streamed_layers and "prefill" in st
        assert dict(st)["prefill"]["kv_streamed_layers"] == p.kv_streamed_layers
        assert len(dict(st)) == len(dataclasses.fields(GenerateStats))
        with pytest.raises(KeyError):
            st["peak_vram_mb"]  # noqa: B018 (the old name is gone, not silently None)
        back = json.loads(json.dumps(st.to_dict()))
        assert back["decode"]["tok_s"] == pytest.approx(d.tok_s)
        assert back["budget_bytes"] == plan.budget
        assert "prefill" in st.summary() and "decode" in st.summary()


def test_a_budget_in_gb_reads_back_in_bytes() -> None:
    # the case: "24GB" was reported as budget_mb 22888.18 (MiB labelled mb)
    model = tiny_model("cpu", seed=23)
    manager = RevivaManager(model, RevivaConfig(vram_budget="24GB"))
    manager.generate(ids_for("cpu", 40, seed=24), max_new_tokens=2, do_sample=False)
    st = manager.get_memory_stats()
    assert st.requested_budget_bytes == 24 * 10**9, st.requested_budget_bytes
    assert torch.is_tensor(torch.tensor(st.budget_bytes))  # a plain int


def _names(figures: object, where: str = "") -> list[tuple[str, str]]:
    """Every key of a (nested) dict or list of dicts, with where it was found."""
    if isinstance(figures, dict):
        out = []
        for k, v in figures.items():
            out.append((str(k), where))
            out += _names(v, f"{where}.{k}")
        return out
    if isinstance(figures, list):
        return [n for item in figures for n in _names(item, where)]
    return []


def test_every_figure_of_the_binding_names_its_unit() -> None:
    """Note [One naming scheme]: every dict the core's binding returns says bytes and seconds,
    with to_host/to_device for directions: the transfer engine's stats and its directions, the
    pinned pool's, the arena's, an OffloadManager's metrics and timeline, its scheduler's stats,
    a KV store's stats and timeline, a weight store's stats and timeline (a manager's call, with
    streamed weights and K/V, fills them all)."""
    from test_weights import budget_where

    import reviva

    model = tiny_model("cpu", seed=31)
    manager = RevivaManager(model, RevivaConfig(stream_weights=True))
    budget_where(manager, 96, 6, lambda p: True)  # (the least: weights and most K/V stream)
    ids = ids_for("cpu", 96, seed=32)
    out = manager.generate(ids, max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
    store = out.past_key_values.store
    weights = manager.weights.store
    m = reviva.OffloadManager(manager.engine, budget_bytes=1 << 20, policy="lru")
    sched = reviva.PrefetchScheduler(m, prefetch_groups=2)
    block = m.register([1 << 16], torch.float32)
    sched.acquire_group([block], "write")
    sched.release_group([block])
    m.synchronize()
    figures = {
        "engine": manager.engine.stats(),
        "pool": manager.pool.stats(),
        "arena": manager.arena.stats(),
        "manager": m.metrics(),
        "manager_timeline": m.timeline(),
        "scheduler": sched.stats(),
        "kv_store": store.stats(),
        "kv_timeline": manager._last_timeline,
        "weight_store": weights.stats(),
        "weight_timeline": weights.timeline(),
    }
    names = _names(figures)
    assert {"to_host", "to_device", "busy_s", "compute_stall_s", "start_s"} <= {n for n, _ in names}
    bad = [(n, w) for n, w in names if not _unit_ok(n, None) or n.endswith("_ms")]
    assert not bad, bad
    assert all(e["end_s"] >= e["start_s"] >= 0 for e in figures["weight_timeline"])
