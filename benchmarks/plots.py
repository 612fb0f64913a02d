"""The benchmarks' figures, drawn from their result JSON: a PNG with the JSON's stem beside it.

    bench_generate  decode tok/s and peak device memory against context, one line per contender
                    (card mode: contender and card or no card; fraction mode: contender and
                    budget); a call that ran out of memory, failed or was not run is drawn as an
                    x with its reason, never dropped.
    bench_train     step time against peak memory, one point per contender; the contenders that
                    did not finish are listed under the axes.

Point labels are placed by `place_labels`, which moves a label beside its point until it overlaps
no other label and no marker (plain rectangles in display pixels, so it is tested without
matplotlib). matplotlib is imported only when a figure is drawn and the benchmarks do not need
it: `write_plot` returns None without it, and the benchmark's JSON stays the primary output.

    python benchmarks/plots.py RESULT.json [RESULT.json ...]   writes RESULT.png beside each
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plot_data import (  # noqa: E402
    ctx_label,
    finite_number,
    generate_memory_key,
    generate_series,
    result_kind,
    train_card_gb,
    train_points,
)
from plot_labels import MARKER_HALF_PX, Box, place_labels  # noqa: E402

# Display sizes, in pixels at the figure's dpi (FIG_DPI) and points for text.
FIG_DPI = 100
SAVE_DPI = 150
LABEL_FONT_PT = 7.5
# An x value moved by up to this fraction of an octave per contender, so that contenders at one
# context stand side by side instead of on top of each other.
DODGE_OCTAVES = 0.06
FAILED_AT_AXES_Y = 0.04  # a failed call with no value: drawn this far up its panel (axes fraction)
FOOT_ROOM = 0.12  # ... and the panel is extended down by this fraction so that no point sits there
HEADROOM = 1.12  # a linear axis from zero ends this much above its largest value
TRAIN_MEMORY_LABEL = "peak memory, GB (torch allocated + Reviva's arena)"


def _subtitle(result: dict[str, Any]) -> str:
    env = result.get("environment") or {}
    parts = [env.get("gpu") or "no GPU", f"git {str(env.get('git_sha', '?'))[:12]}"]
    if env.get("date_utc"):
        parts.append(str(env["date_utc"])[:10])
    if result.get("complete") is False:
        parts.append("INCOMPLETE run")
    return ", ".join(parts)


# --- drawing (matplotlib, imported here only) -----------------------------------------------------


@dataclass
class Drawn:
    """A drawn figure and what the tests check: the point labels (matplotlib Annotations) and
    the legend's entries."""

    figure: Any
    labels: list[Any]
    legend_entries: list[str]


def _new_figure(width_in: float, height_in: float) -> Any:
    """A figure with its own Agg canvas: no pyplot, so no global figure list to close."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width_in, height_in), dpi=FIG_DPI)
    FigureCanvasAgg(fig)
    return fig


def _box(extent: Any) -> Box:
    return Box(extent.x0, extent.y0, extent.x1, extent.y1)


def _annotate(ax: Any, items: list[tuple[float, float, str, str]], markers: list[Box]) -> list[Any]:
    """Labels (x, y in the axes' data coordinates, or y None: FAILED_AT_AXES_Y; text; colour)
    placed by place_labels inside the axes, a thin line back to the point when moved off it."""
    from matplotlib.text import Text

    fig = ax.figure
    fig.canvas.draw()  # the axes' limits and transforms are final from here on
    renderer = fig.canvas.get_renderer()
    anchors, sizes = [], []
    for x, y, text, _ in items:
        anchors.append(_display(ax, x, y))
        probe = Text(0, 0, text, fontsize=LABEL_FONT_PT, figure=fig)
        extent = probe.get_window_extent(renderer)
        sizes.append((extent.width, extent.height))
    boxes = place_labels(anchors, sizes, _box(ax.get_window_extent(renderer)), markers)
    to_points = 72.0 / fig.dpi
    labels = []
    for (x, y, text, colour), (ax_, ay), box in zip(items, anchors, boxes, strict=True):
        centre_y = (box.y0 + box.y1) / 2
        moved = abs(centre_y - ay) > 1.0
        labels.append(
            ax.annotate(
                text,
                xy=(x, y if y is not None else FAILED_AT_AXES_Y),
                xycoords=("data", "data" if y is not None else "axes fraction"),
                xytext=((box.x0 - ax_) * to_points, (box.y0 - ay) * to_points),
                textcoords="offset points",
                ha="left",
                va="bottom",
                fontsize=LABEL_FONT_PT,
                color=colour,
                annotation_clip=False,
                # Lines (the card, a contender's) may pass under a label: a light ground keeps
                # it legible.
                bbox=dict(boxstyle="square,pad=0.1", fc="white", ec="none", alpha=0.75),
                arrowprops=dict(arrowstyle="-", lw=0.5, color=colour, shrinkA=0, shrinkB=3)
                if moved
                else None,
            )
        )
    return labels


def _display(ax: Any, x: float, y: float | None) -> tuple[float, float]:
    if y is None:
        dx, _ = ax.transData.transform((x, 1.0))
        _, dy = ax.transAxes.transform((0.0, FAILED_AT_AXES_Y))
        return float(dx), float(dy)
    dx, dy = ax.transData.transform((x, y))
    return float(dx), float(dy)


def _room_at_foot(ax: Any) -> None:
    """Extends the y axis down by FOOT_ROOM of its span (in its scale: log or linear), so that the
    failed calls drawn at FAILED_AT_AXES_Y sit below every point."""
    scale = ax.yaxis.get_transform()
    lo, hi = scale.transform(ax.get_ylim())
    ax.set_ylim(bottom=scale.inverted().transform(lo - FOOT_ROOM * (hi - lo)))


def _marker_box(ax: Any, x: float, y: float | None) -> Box:
    cx, cy = _display(ax, x, y)
    return Box(cx - MARKER_HALF_PX, cy - MARKER_HALF_PX, cx + MARKER_HALF_PX, cy + MARKER_HALF_PX)


def _mark_failure(ax: Any, x: float, y: float | None, colour: Any) -> None:
    """An x where a call failed: at its value, or at the foot of the panel when it has none."""
    if y is None:
        ax.plot(
            [x],
            [FAILED_AT_AXES_Y],
            transform=ax.get_xaxis_transform(),
            marker="x",
            ms=8,
            mew=2,
            color=colour,
            ls="none",
        )
    else:
        ax.plot([x], [y], marker="x", ms=9, mew=2, color=colour, ls="none")


def plot_generate(result: dict[str, Any], png_path: Path | str | None = None) -> Drawn:
    """Two panels against the prompt's length (log2): decode tok/s (median of the completed
    calls, a bar from the slowest to the fastest) and peak memory (the most of the completed
    calls); one line per contender. A failed call is an x with its reason: in the tok/s panel at
    the point, or at the panel's foot when no call completed; in the memory panel at the memory
    it had reached when it failed. Written to png_path when given."""
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FixedLocator, FuncFormatter, LogFormatter, NullLocator

    series = generate_series(result)
    mem_key, mem_label = generate_memory_key(result)
    contexts = sorted({p.context for s in series for p in s.points})
    if not contexts:
        raise ValueError("the result has no rows to plot")
    fig = _new_figure(12.0, 4.6)
    fig.subplots_adjust(left=0.06, right=0.98, wspace=0.22, top=0.84, bottom=0.13)
    ax_tok, ax_mem = fig.subplots(1, 2)
    colours = [f"C{i % 10}" for i in range(len(series))]
    styles = ["-", "--", ":", "-."]
    markers = ["o", "s", "^", "D", "v", "P"]
    tok_items, mem_items = [], []
    tok_marks, mem_marks = [], []
    for i, s in enumerate(series):
        dodge = 2 ** (DODGE_OCTAVES * (i - (len(series) - 1) / 2))
        colour, style = colours[i], styles[(i // 10) % len(styles)]
        marker = markers[i % len(markers)]
        ok = [p for p in s.points if p.decode_tok_s]
        xs = [p.context * dodge for p in ok]
        med = [statistics.median(p.decode_tok_s) for p in ok]
        low = [m - min(p.decode_tok_s) for m, p in zip(med, ok, strict=True)]
        high = [max(p.decode_tok_s) - m for m, p in zip(med, ok, strict=True)]
        ax_tok.errorbar(
            xs,
            med,
            yerr=[low, high],
            color=colour,
            ls=style,
            marker=marker,
            ms=5,
            capsize=3,
            lw=1.4,
        )
        with_mem = [p for p in ok if p.memory_gb]
        ax_mem.plot(
            [p.context * dodge for p in with_mem],
            [max(p.memory_gb) for p in with_mem],
            color=colour,
            ls=style,
            marker=marker,
            ms=5,
            lw=1.4,
        )
        tok_marks += [(x, y) for x, y in zip(xs, med, strict=True)]
        mem_marks += [(p.context * dodge, max(p.memory_gb)) for p in with_mem]
        for p in s.points:
            why = p.failure_label()
            if why is None:
                continue
            x = p.context * dodge
            y_tok = statistics.median(p.decode_tok_s) if p.decode_tok_s else None
            _mark_failure(ax_tok, x, y_tok, colour)
            tok_items.append((x, y_tok, why, colour))
            tok_marks.append((x, y_tok))
            y_mem = max(p.failed_memory_gb) if p.failed_memory_gb else None
            _mark_failure(ax_mem, x, y_mem, colour)
            mem_items.append((x, y_mem, why, colour))
            mem_marks.append((x, y_mem))
    card_bytes = finite_number((result.get("settings") or {}).get("card_bytes"))
    card_gb = None if card_bytes is None else card_bytes / 1e9
    if card_gb is not None:
        ax_mem.axhline(card_gb, color="0.4", ls=(0, (4, 3)), lw=1)
    for ax in (ax_tok, ax_mem):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(FixedLocator(contexts))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: ctx_label(int(round(x)))))
        ax.xaxis.set_minor_locator(NullLocator())
        lo, hi = contexts[0] / 2**0.5, contexts[-1] * 2**0.5
        ax.set_xlim(lo, hi)
        ax.set_xlabel("prompt tokens (context)")
        ax.grid(True, which="major", alpha=0.3)
    ax_tok.set_yscale("log")
    # Plain numbers (0.5, 2, 30), the minor ticks labelled too when the axis spans few decades.
    ax_tok.yaxis.set_major_formatter(LogFormatter())
    ax_tok.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False))
    if any(y is None for _, y, _, _ in tok_items):
        _room_at_foot(ax_tok)
    ax_tok.set_ylabel("decode tok/s (median of calls; bar: min-max)")
    ax_tok.set_title("decode rate")
    # From zero, with room above the highest point (or the card) for its label.
    mem_top = max([y for _, y in mem_marks if y is not None] + [card_gb or 0.0, 1e-3])
    ax_mem.set_ylim(0, mem_top * HEADROOM)
    ax_mem.set_ylabel(mem_label)
    ax_mem.set_title("peak memory")
    mode = (result.get("settings") or {}).get("mode") or "fraction"
    fig.suptitle(
        f"bench_generate ({mode} mode): decode and peak memory against context\n"
        f"{_subtitle(result)}",
        fontsize=10,
    )
    handles = [
        Line2D(
            [],
            [],
            color=colours[i],
            ls=styles[(i // 10) % len(styles)],
            marker=markers[i % len(markers)],
            label=s.label,
        )
        for i, s in enumerate(series)
    ]
    handles.append(
        Line2D(
            [],
            [],
            color="0.3",
            marker="x",
            ms=8,
            mew=2,
            ls="none",
            label="failed call (OOM, error, not run)",
        )
    )
    if card_gb is not None:
        handles.append(Line2D([], [], color="0.4", ls=(0, (4, 3)), label=f"card: {card_gb:g} GB"))
    legend = fig.legend(
        handles=handles, loc="center left", bbox_to_anchor=(0.995, 0.5), fontsize=8, frameon=False
    )
    labels = _annotate(ax_tok, tok_items, [_marker_box(ax_tok, x, y) for x, y in tok_marks])
    labels += _annotate(ax_mem, mem_items, [_marker_box(ax_mem, x, y) for x, y in mem_marks])
    drawn = Drawn(fig, labels, [t.get_text() for t in legend.get_texts()])
    if png_path is not None:
        fig.savefig(png_path, dpi=SAVE_DPI, bbox_inches="tight")
    return drawn


def plot_train(result: dict[str, Any], png_path: Path | str | None = None) -> Drawn:
    """Step time against peak memory, a labelled point per contender that finished; the card as
    a vertical line; the contenders that did not finish, with why, under the axes. Written to
    png_path when given."""
    from matplotlib.lines import Line2D

    points = train_points(result)
    fig = _new_figure(9.0, 5.2)
    failed = [p for p in points if p.failure is not None]
    fig.subplots_adjust(left=0.09, right=0.97, top=0.88, bottom=0.17 if failed else 0.12)
    ax = fig.subplots()
    done = [p for p in points if p.failure is None]
    markers = ["o", "s", "^", "D", "v", "P", "X", "*"]
    handles = []
    for i, p in enumerate(done):
        colour, marker = f"C{i % 10}", markers[(i // 10) % len(markers)]
        ax.plot([p.memory_gb], [p.step_s], marker=marker, ms=7, color=colour, ls="none")
        handles.append(Line2D([], [], marker=marker, color=colour, ls="none", label=p.label))
    settings = result.get("settings") or {}
    card = settings.get("card") if settings.get("mode") == "card" else None
    card_gb = train_card_gb(result) if card else None
    if card_gb is not None:
        ax.axvline(card_gb, color="0.4", ls=(0, (4, 3)), lw=1)
        handles.append(Line2D([], [], color="0.4", ls=(0, (4, 3)), label=f"card: {card}"))
    # From zero, with room beyond the largest point (or the card) for its label.
    ax.set_xlim(0, max([p.memory_gb for p in done] + [card_gb or 0.0, 1e-3]) * HEADROOM)
    ax.set_ylim(0, max([p.step_s for p in done] + [1e-3]) * HEADROOM)
    ax.set_xlabel(TRAIN_MEMORY_LABEL)
    ax.set_ylabel("step s (median after a warm-up step)")
    ax.grid(True, alpha=0.3)
    where = f"on a {card} card" if card else f"{settings.get('mode') or 'in-process'} mode"
    ax.set_title(
        f"bench_train ({where}): step time against peak memory\n{_subtitle(result)}", fontsize=10
    )
    if failed:
        fig.text(
            0.09,
            0.03,
            "did not finish: " + "; ".join(f"{p.label} ({p.failure})" for p in failed),
            fontsize=8,
            color="C3",
            wrap=True,
        )
    legend = ax.legend(
        handles=handles, loc="center left", bbox_to_anchor=(1.02, 0.5), fontsize=8, frameon=False
    )
    marks = [_marker_box(ax, p.memory_gb, p.step_s) for p in done]
    labels = _annotate(
        ax, [(p.memory_gb, p.step_s, p.label, f"C{i % 10}") for i, p in enumerate(done)], marks
    )
    drawn = Drawn(fig, labels, [t.get_text() for t in legend.get_texts()])
    if png_path is not None:
        fig.savefig(png_path, dpi=SAVE_DPI, bbox_inches="tight")
    return drawn


def plot_result(result: dict[str, Any], png_path: Path | str | None = None) -> Drawn:
    """plot_generate or plot_train, by result_kind."""
    kind = result_kind(result)
    return (plot_generate if kind == "generate" else plot_train)(result, png_path)


def write_plot(json_path: Path | str) -> Path | None:
    """Reads a result JSON and writes its plot beside it (same stem, .png); the PNG's path, or
    None when matplotlib is not installed (the caller says so; the JSON is the result)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return None
    json_path = Path(json_path)
    png_path = json_path.with_suffix(".png")
    plot_result(json.loads(json_path.read_text()), png_path)
    return png_path


PLOT_SKIPPED = "plot skipped: matplotlib is not installed (the JSON has every figure)"


def plot_beside(json_path: Path | str) -> Path | None:
    """For the benchmarks, after their final JSON: writes the plot beside it and prints one line,
    where it went or why it was skipped (matplotlib not installed, or a result without runs)."""
    if not json.loads(Path(json_path).read_text()).get("runs"):
        print("plot skipped: the result has no runs", flush=True)
        return None
    png = write_plot(json_path)
    print(f"wrote {png}" if png is not None else PLOT_SKIPPED, flush=True)
    return png


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("results", nargs="+", metavar="RESULT.json")
    args = parser.parse_args(argv)
    for name in args.results:
        png = write_plot(name)
        if png is None:
            print(PLOT_SKIPPED, file=sys.stderr)
            return 2
        print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
