"""benchmarks/plots.py: the benchmarks' PNGs (issue 16). The label placement, the grouping of rows
and the skip without matplotlib run everywhere; the figures themselves need matplotlib and skip
with a reason where it is not installed. Drawn from committed results (card mode with a call that
ran out of memory, fraction mode with contenders out of memory at every long context, a crowded
training run) and from small synthetic ones."""

from __future__ import annotations

import importlib.util
import itertools
import json
import sys
from pathlib import Path
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
RESULTS = BENCHMARKS / "results"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
NO_MATPLOTLIB = "matplotlib is not installed here (the benchmarks run without it)"


def _load_plots() -> Any:
    """benchmarks/plots.py as a module (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location("reviva_bench_plots", BENCHMARKS / "plots.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


plots = _load_plots()
# (plots.py put benchmarks/ on sys.path: its siblings, where the data and the label placement
# live, import as themselves)
import plot_data  # noqa: E402
import plot_labels  # noqa: E402

GENERATE_RESULTS = [
    "generate-card24-2026-12-02-50eb01c.json",  # card mode; reviva_paged's call 1 out of memory
    "generate-merged-2026-11-29-9c13d87.json",  # fraction mode; OOM at 64k, 128k, 256k
    "generate-card24-merged-2026-12-02-8646e57.json",  # 64k, 256k, 512k
]
TRAIN_RESULTS = [
    "train-2026-11-29-6f9ef03.json",  # four contenders at one point (5.4 GB, 0.49 s)
    "train-card-2026-12-02-fd28304.json",  # card mode
]


def _generate_row(contender: str, context: int, call: int, **fields: Any) -> dict[str, Any]:
    mode = "card" if fields.get("card") else "no_card"
    row = {"mode": mode, "card": None, "contender": contender, "context": context, "call": call}
    row.update(completed=True, oom=False, error=None)
    return {**row, **fields}


def synthetic_generate() -> dict[str, Any]:
    """Three contexts: reviva on the card at every one; hf on the card out of memory at every
    one; hf_offload out of memory in call 1 of 3 at 64k and not run at 128k."""
    rows = []
    for ctx, tok_s in ((16384, 40.0), (65536, 22.0), (131072, 4.5)):
        for call in (1, 2):
            rows.append(
                _generate_row(
                    "reviva",
                    ctx,
                    call,
                    card="24GB",
                    decode_tok_s=tok_s + call,
                    card_peak_used_gb=23.5,
                )
            )
        rows.append(
            _generate_row(
                "hf",
                ctx,
                1,
                card="24GB",
                completed=False,
                oom=True,
                error="OutOfMemoryError: CUDA out of memory",
                decode_tok_s=None,
                card_peak_used_gb=23.99,
            )
        )
    for call in (1, 2, 3):
        oom = call == 1
        rows.append(
            _generate_row(
                "hf_offload",
                65536,
                call,
                card="24GB",
                completed=not oom,
                oom=oom,
                error="OutOfMemoryError" if oom else None,
                decode_tok_s=None if oom else 1.3,
                card_peak_used_gb=23.9 if oom else 22.0,
            )
        )
    rows.append(
        _generate_row(
            "hf_offload",
            131072,
            1,
            card="24GB",
            completed=False,
            not_run=True,
            error="not run: skipped: estimated 900 s",
        )
    )
    return {
        "environment": {"gpu": "test GPU", "git_sha": "0123456789abcdef"},
        "complete": True,
        "settings": {"mode": "card", "card": "24GB", "card_bytes": 24 * 10**9},
        "runs": rows,
    }


def synthetic_train() -> dict[str, Any]:
    """Card mode: two contenders at the same point, one out of memory, one skipped, a growth
    row."""
    setup = {"ballast": {"card_bytes": 24 * 10**9}}
    ok = {"mode": "card", "completed": True, "error": None, "oom": False, "device_setup": setup}
    return {
        "environment": {"gpu": "test GPU", "git_sha": "0123456789abcdef"},
        "settings": {"mode": "card", "card": "24GB"},
        "runs": [
            {**ok, "contender": "plain", "step_s": 0.16, "peak_gb": 19.8},
            {**ok, "contender": "reviva_all", "step_s": 0.49, "peak_gb": 5.42},
            {**ok, "contender": "reviva_all_min0K", "step_s": 0.49, "peak_gb": 5.42},
            {**ok, "contender": "reviva_4GB", "completed": False, "oom": True, "error": "OOM"},
            {
                "mode": "card",
                "contender": "save_on_cpu",
                "completed": False,
                "error": "skipped: estimated 80 s, 10 s left of --max-wall-s 540",
            },
            {**ok, "contender": "growth", "growth": {"step_s": [0.3, 0.3]}},
        ],
    }


def _no_overlaps(boxes: list[Any]) -> list[tuple[int, int]]:
    return [
        (i, j) for (i, a), (j, b) in itertools.combinations(enumerate(boxes), 2) if a.overlaps(b)
    ]


# --- without matplotlib ---------------------------------------------------------------------------


def test_labels_at_one_point_are_placed_apart_inside_the_axes() -> None:
    Box = plot_labels.Box
    anchors = [(200.0, 150.0)] * 8 + [(205.0, 152.0), (60.0, 40.0)]
    sizes = [(70.0, 10.0)] * 10
    bounds = Box(0.0, 0.0, 400.0, 300.0)
    markers = [Box(x - 5, y - 5, x + 5, y + 5) for x, y in anchors]
    boxes = plot_labels.place_labels(anchors, sizes, bounds, markers)
    assert _no_overlaps(boxes) == []
    for box in boxes:
        assert box.inside(bounds)
        assert not any(box.overlaps(m) for m in markers)
    assert boxes == plot_labels.place_labels(anchors, sizes, bounds, markers)  # deterministic
    # Alone, a label stays beside its point at its height.
    (alone,) = plot_labels.place_labels([(100.0, 100.0)], [(50.0, 10.0)], bounds)
    assert alone.x0 > 100.0 and (alone.y0 + alone.y1) / 2 == 100.0


def test_labels_leave_the_axes_only_when_there_is_no_room_inside() -> None:
    Box = plot_labels.Box
    bounds = Box(0.0, 0.0, 100.0, 30.0)
    boxes = plot_labels.place_labels([(50.0, 15.0)] * 4, [(30.0, 10.0)] * 4, bounds)
    assert _no_overlaps(boxes) == []
    assert sum(box.inside(bounds) for box in boxes) >= 2
    with pytest.raises(ValueError, match="2 anchors but 1 sizes"):
        plot_labels.place_labels([(0.0, 0.0)] * 2, [(1.0, 1.0)], bounds)


def test_generate_rows_grouped_with_every_failed_call_kept() -> None:
    series = {s.label: s for s in plot_data.generate_series(synthetic_generate())}
    assert list(series) == ["reviva (card 24GB)", "hf (card 24GB)", "hf_offload (card 24GB)"]
    assert [p.context for p in series["reviva (card 24GB)"].points] == [16384, 65536, 131072]
    assert [p.failure_label() for p in series["reviva (card 24GB)"].points] == [None] * 3
    assert [p.failure_label() for p in series["hf (card 24GB)"].points] == ["OOM"] * 3
    assert [p.failed_memory_gb for p in series["hf (card 24GB)"].points] == [[23.99]] * 3
    offload = series["hf_offload (card 24GB)"].points
    assert [p.failure_label() for p in offload] == ["OOM 1/3", "not run"]
    assert offload[0].decode_tok_s == [1.3, 1.3]
    assert plot_data.generate_memory_key(synthetic_generate())[0] == "card_peak_used_gb"


def test_train_points_say_why_a_contender_has_none() -> None:
    points = plot_data.train_points(synthetic_train())
    assert [(p.label, p.failure) for p in points] == [
        ("plain", None),
        ("reviva_all", None),
        ("reviva_all_min0K", None),
        ("reviva_4GB", "OOM"),
        ("save_on_cpu", "skipped"),
    ]


def test_result_kind_from_the_rows() -> None:
    assert plot_data.result_kind(synthetic_generate()) == "generate"
    assert plot_data.result_kind(synthetic_train()) == "train"
    with pytest.raises(ValueError, match="neither 'context' nor 'step_s'"):
        plot_data.result_kind({"runs": [{"contender": "x"}]})


def test_without_matplotlib_the_plot_is_skipped_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "train-x.json"
    path.write_text(json.dumps(synthetic_train()))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    assert plots.plot_beside(path) is None
    assert capsys.readouterr().out == plots.PLOT_SKIPPED + "\n"
    assert "matplotlib is not installed" in plots.PLOT_SKIPPED
    assert not path.with_suffix(".png").exists()
    assert plots.main([str(path)]) == 2


def test_a_result_without_runs_is_not_plotted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "generate-x.json"
    path.write_text(json.dumps({"environment": {}, "runs": []}))
    assert plots.plot_beside(path) is None
    assert capsys.readouterr().out == "plot skipped: the result has no runs\n"


# --- the figures (matplotlib) ---------------------------------------------------------------------


@pytest.fixture
def matplotlib() -> Any:
    return pytest.importorskip("matplotlib", reason=NO_MATPLOTLIB)


def drawn_texts(fig: Any) -> list[Any]:
    """The figure's texts that are drawn: every visible non-empty one, except the labels of
    ticks outside their axis's view (matplotlib keeps them, with stale positions, undrawn)."""
    from matplotlib.text import Text

    ticks, in_view = set(), []
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            lo, hi = sorted(axis.get_view_interval())
            for locs, minor in (
                (axis.get_majorticklocs(), False),
                (axis.get_minorticklocs(), True),
            ):
                objects = (
                    axis.get_minor_ticks(len(locs)) if minor else axis.get_major_ticks(len(locs))
                )
                for loc, tick in zip(locs, objects, strict=True):
                    ticks.update((id(tick.label1), id(tick.label2)))
                    if lo - 1e-9 * abs(lo) <= loc <= hi + 1e-9 * abs(hi):
                        in_view += [tick.label1, tick.label2]
    texts = [t for t in fig.findobj(Text) if id(t) not in ticks] + in_view
    return [t for t in texts if t.get_visible() and t.get_text().strip()]


def check_drawn(drawn: Any, expected_legend: list[str], png: Path) -> None:
    """The PNG is one; no two texts of the figure overlap (point labels, legend, ticks, titles);
    the legend names every contender."""
    from matplotlib.text import Text

    assert png.read_bytes()[:8] == PNG_SIGNATURE and png.stat().st_size > 10_000
    fig = drawn.figure
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    texts = drawn_texts(fig)
    # A label's own extent, without the leader line an Annotation's extent includes.
    boxes = [plots._box(Text.get_window_extent(t, renderer)) for t in texts]
    overlaps = [(texts[i].get_text(), texts[j].get_text()) for i, j in _no_overlaps(boxes)]
    assert overlaps == []
    labels = [plots._box(Text.get_window_extent(t, renderer)) for t in drawn.labels]
    assert _no_overlaps(labels) == []
    for name in expected_legend:
        assert name in drawn.legend_entries


@pytest.mark.parametrize("name", GENERATE_RESULTS)
def test_generate_plot_of_a_committed_result(matplotlib: Any, name: str, tmp_path: Path) -> None:
    result = json.loads((RESULTS / name).read_text())
    png = tmp_path / "generate.png"
    drawn = plots.plot_generate(result, png)
    series = plot_data.generate_series(result)
    check_drawn(drawn, [s.label for s in series], png)
    failed = sum(p.failure_label() is not None for s in series for p in s.points)
    assert len(drawn.labels) == 2 * failed  # each failure named in both panels


@pytest.mark.parametrize("name", TRAIN_RESULTS)
def test_train_plot_of_a_committed_result(matplotlib: Any, name: str, tmp_path: Path) -> None:
    result = json.loads((RESULTS / name).read_text())
    png = tmp_path / "train.png"
    drawn = plots.plot_train(result, png)
    done = [p.label for p in plot_data.train_points(result) if p.failure is None]
    check_drawn(drawn, done, png)
    assert sorted(label.get_text() for label in drawn.labels) == sorted(done)


def test_generate_plot_names_a_contender_out_of_memory_everywhere(
    matplotlib: Any, tmp_path: Path
) -> None:
    png = tmp_path / "generate.png"
    drawn = plots.plot_generate(synthetic_generate(), png)
    check_drawn(
        drawn,
        [
            "reviva (card 24GB)",
            "hf (card 24GB)",
            "hf_offload (card 24GB)",
            "failed call (OOM, error, not run)",
            "card: 24 GB",
        ],
        png,
    )
    texts = sorted(label.get_text() for label in drawn.labels)
    assert texts == sorted(["OOM"] * 6 + ["OOM 1/3"] * 2 + ["not run"] * 2)


def test_train_plot_lists_the_contenders_that_did_not_finish(
    matplotlib: Any, tmp_path: Path
) -> None:
    png = tmp_path / "train.png"
    drawn = plots.plot_train(synthetic_train(), png)
    check_drawn(drawn, ["plain", "reviva_all", "reviva_all_min0K", "card: 24GB"], png)
    assert "growth" not in drawn.legend_entries
    notes = [t.get_text() for t in drawn.figure.texts]
    assert notes == ["did not finish: reviva_4GB (OOM); save_on_cpu (skipped)"]


def test_cli_writes_the_png_beside_each_json(
    matplotlib: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    paths = []
    for name, result in (("generate-x", synthetic_generate()), ("train-x", synthetic_train())):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(result))
    assert plots.main([str(p) for p in paths]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [f"wrote {p.with_suffix('.png')}" for p in paths]
    for p in paths:
        assert p.with_suffix(".png").read_bytes()[:8] == PNG_SIGNATURE
