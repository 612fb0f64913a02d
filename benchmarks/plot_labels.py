"""Where the benchmarks' figures put their point labels: `place_labels` moves a label beside its
point until it overlaps no other label and no marker. Plain rectangles in display pixels (no
matplotlib), so that it is tested without it."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

LABEL_PAD_PX = 6.0  # between a label and its point, and between two labels
MARKER_HALF_PX = 5.0  # a marker as an obstacle: a square of twice this side (7 pt markers)
BOUNDS_TRIES = 40  # candidate positions tried inside the axes before one outside is accepted


@dataclass(frozen=True)
class Box:
    """A rectangle in display pixels, y up."""

    x0: float
    y0: float
    x1: float
    y1: float

    def overlaps(self, other: Box, gap: float = 0.0) -> bool:
        """True when the two are closer than `gap` (touching edges do not overlap at gap 0)."""
        return (
            self.x0 < other.x1 + gap
            and other.x0 < self.x1 + gap
            and self.y0 < other.y1 + gap
            and other.y0 < self.y1 + gap
        )

    def inside(self, bounds: Box) -> bool:
        return (
            self.x0 >= bounds.x0
            and self.x1 <= bounds.x1
            and self.y0 >= bounds.y0
            and self.y1 <= bounds.y1
        )


def _candidates(
    anchor: tuple[float, float], size: tuple[float, float], clearance: float, pad: float
) -> Iterator[Box]:
    """Positions for a label of `size` beside `anchor` (`clearance` from it sideways), nearest
    first: centred on the anchor's height to its right, then to its left, then a label's height
    (and pad) higher, lower, two higher... Endless: above every other label there is room."""
    (ax, ay), (w, h) = anchor, size
    for k in itertools.count():
        dy = (k + 1) // 2 * (h + pad) * (1 if k % 2 else -1)
        y0 = ay - h / 2 + dy
        yield Box(ax + clearance, y0, ax + clearance + w, y0 + h)
        yield Box(ax - clearance - w, y0, ax - clearance, y0 + h)


def place_labels(
    anchors: Sequence[tuple[float, float]],
    sizes: Sequence[tuple[float, float]],
    bounds: Box | None = None,
    obstacles: Sequence[Box] = (),
    pad: float = LABEL_PAD_PX,
    clearance: float = MARKER_HALF_PX + LABEL_PAD_PX,
) -> list[Box]:
    """Where each label goes: a box of sizes[i] beside anchors[i] that overlaps no box placed
    before it and no obstacle (each kept `pad` / 2 apart). Labels are placed from the lowest
    anchor up, each at the first free candidate (`_candidates`) inside `bounds`; when none of
    the first BOUNDS_TRIES pairs is, at the nearest free one outside. Deterministic: the same
    input gives the same boxes."""
    if len(anchors) != len(sizes):
        raise ValueError(f"{len(anchors)} anchors but {len(sizes)} sizes")
    placed: dict[int, Box] = {}
    taken: list[Box] = list(obstacles)
    for i in sorted(range(len(anchors)), key=lambda i: (anchors[i][1], anchors[i][0], i)):
        first_free = None
        for tries, box in enumerate(_candidates(anchors[i], sizes[i], clearance, pad)):
            free = not any(box.overlaps(t, pad / 2) for t in taken)
            if free and (bounds is None or box.inside(bounds)):
                first_free = box
                break
            if free and first_free is None:
                first_free = box
            if first_free is not None and tries >= 2 * BOUNDS_TRIES:
                break
        assert first_free is not None  # the candidates are endless; far enough up is free
        placed[i] = first_free
        taken.append(first_free)
    return [placed[i] for i in range(len(anchors))]
