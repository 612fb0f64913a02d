"""Note [Traces] (reviva/trace.py): the trace file of a call (and of a training step), the
progress line of a long prefill, and the profiler ranges around Reviva's phases."""

from __future__ import annotations

import io
import json

import pytest
import torch
from test_lifetime import ids_for, streaming_manager, tiny_model

import reviva
from reviva import RevivaConfig, RevivaManager
from reviva.trace import PrefillProgress

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _tracks(trace: dict) -> dict[str, list[dict]]:
    names = {
        e["tid"]: e["args"]["name"]
        for e in trace["traceEvents"]
        if e["ph"] == "M" and e["name"] == "thread_name"
    }
    out: dict[str, list[dict]] = {n: [] for n in names.values()}
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            out[names[e["tid"]]].append(e)
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_a_call_writes_a_trace_of_compute_copies_and_stalls(device: str, tmp_path) -> None:  # noqa: ANN001
    model = tiny_model(device, seed=31)
    ids = ids_for(device, 96, seed=32)
    manager = streaming_manager(model, 96, 8)
    with pytest.raises(RuntimeError, match="nothing to write yet"):
        manager.trace(tmp_path / "none.json")
    for call in range(2):  # the second call's trace is its own
        manager.generate(ids, max_new_tokens=8, do_sample=False)
        st = manager.get_memory_stats()
        path = manager.trace(tmp_path / f"call{call}.json")
        trace = json.loads(open(path).read())  # loads as JSON
        tracks = _tracks(trace)
        assert {"compute", "K/V to host", "K/V to device"} <= set(tracks), set(tracks)
        compute = [e["name"] for e in tracks["compute"]]
        assert compute.count("prefill") == 1 and compute.count("decode") == 1, compute
        layers = [n for n in compute if n.startswith("prefill layer ")]
        assert layers == [f"prefill layer {i}" for i in range(5)], compute
        steps = [n for n in compute if n.startswith("decode step ")]
        assert len(steps) == st.decode_steps == 7, compute
        # every copy the engine made for the K/V store, with its bytes (no hidden states on the
        # host, no streamed weights here: the engine's counters are the store's)
        assert sum(e["args"]["bytes"] for e in tracks["K/V to host"]) == st.bytes_to_host > 0
        assert sum(e["args"]["bytes"] for e in tracks["K/V to device"]) == st.bytes_to_device
        # on one time line: from the call's start to its end (5 ms of clock alignment slack)
        end = max(e["ts"] + e["dur"] for e in tracks["compute"])
        for name, spans in tracks.items():
            for e in spans:
                assert -5e3 <= e["ts"] and e["ts"] + e["dur"] <= end + 5e3, (name, e, end)
        prefill = next(e for e in tracks["compute"] if e["name"] == "prefill")
        first_write = min(e["ts"] for e in tracks["K/V to host"])
        assert prefill["ts"] <= first_write <= prefill["ts"] + prefill["dur"] + 5e3
        assert trace["otherData"]["decode_steps"] == 7
        assert trace["otherData"]["stats"]["bytes_to_host"] == st.bytes_to_host


def test_streamed_weights_have_their_own_track(tmp_path) -> None:  # noqa: ANN001
    from test_generate import tiny_model as family_model
    from test_weights import MIXES, budget_where

    manager = RevivaManager(family_model("llama"), RevivaConfig(stream_weights=True))
    budget_where(manager, 40, 4, MIXES["least"])
    ids = torch.randint(1, 211, (1, 40), generator=torch.Generator().manual_seed(1))
    for _ in range(2):  # (the second call's events alone)
        manager.generate(ids, max_new_tokens=4, do_sample=False)
    tracks = _tracks(json.loads(open(manager.trace(tmp_path / "w.json")).read()))
    st = manager.get_memory_stats()
    assert st.weights_streamed and st.weight_bytes_to_device > 0
    got = sum(e["args"]["bytes"] for e in tracks["weights to device"])
    assert got == st.weight_bytes_to_device, (got, st.weight_bytes_to_device)


def test_a_training_step_writes_its_trace(tmp_path) -> None:  # noqa: ANN001
    model = tiny_model("cpu", seed=33).train()
    ids = ids_for("cpu", 64, seed=34)
    offload = reviva.ActivationOffload(model)
    with pytest.raises(RuntimeError, match="nothing to write yet"):
        offload.trace(tmp_path / "none.json")
    for _ in range(2):
        with offload:
            model(input_ids=ids, labels=ids).loss.backward()
    tracks = _tracks(json.loads(open(offload.trace(tmp_path / "step.json")).read()))
    assert [e["name"] for e in tracks["compute"]] == ["step", "forward", "backward"]
    to_host = sum(e["args"]["bytes"] for e in tracks["activations to host"])
    to_device = sum(e["args"]["bytes"] for e in tracks["activations to device"])
    assert to_host > 0 and to_device > 0
    # the last step's copies alone: the stats count all steps
    assert to_device * 2 == offload.stats.bytes_to_device, (to_device, offload.stats)


def test_progress_line_when_asked_and_only_then(capsys: pytest.CaptureFixture[str]) -> None:
    model = tiny_model("cpu", seed=35)
    ids = ids_for("cpu", 64, seed=36)
    RevivaManager(model, RevivaConfig(progress=True)).generate(ids, max_new_tokens=2)
    err = capsys.readouterr().err
    assert "reviva: prefill layer 5/5, 64 tokens" in err and err.endswith("s)\n"), err
    RevivaManager(model, RevivaConfig()).generate(ids, max_new_tokens=2)  # auto: not a tty
    assert "reviva:" not in capsys.readouterr().err
    tty = io.StringIO()
    tty.isatty = lambda: True  # type: ignore[method-assign]
    assert PrefillProgress.wanted("auto", 16384, tty)
    assert not PrefillProgress.wanted("auto", 16383, tty)
    assert not PrefillProgress.wanted("auto", 1 << 20, io.StringIO())
    with pytest.raises(ValueError, match="progress must be 'auto', True or False, got 'yes'"):
        RevivaConfig(progress="yes")
    with pytest.raises(ValueError, match="got 1"):
        RevivaConfig(progress=1)


def test_profiler_ranges_name_the_phases() -> None:
    model = tiny_model("cpu", seed=37)
    ids = ids_for("cpu", 64, seed=38)
    manager = RevivaManager(model, RevivaConfig())
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        manager.generate(ids, max_new_tokens=4, do_sample=False)
    names = [e.name for e in prof.events()]
    assert names.count("reviva.generate") == 1 and names.count("reviva.prefill") == 1
    assert names.count("reviva.prefill.layer") == 5 and names.count("reviva.decode") == 1
    assert names.count("reviva.decode.step") == 3, [n for n in names if n.startswith("reviva")]
