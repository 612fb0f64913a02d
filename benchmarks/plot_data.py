"""What the benchmarks' figures draw, read from a result JSON (no matplotlib): bench_generate's
rows as one series per contender with a point per context, bench_train's as one point per
contender, and why a row has no figures (OOM, not run, error)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

# The peak memory of a generate row, first key present in the result wins: the card-level peak
# (card mode: the device's used memory, CUDA context and memory outside torch included), else
# torch's max_memory_allocated (card-mode rows without a sampler; fraction mode's name).
GENERATE_MEMORY_KEYS = (
    ("card_peak_used_gb", "peak device memory, GB (card-level: mem_get_info)"),
    ("max_memory_allocated_gb", "peak allocated, GB (torch)"),
    ("peak_allocated_gb", "peak allocated, GB (torch)"),
)


def finite_number(x: Any) -> float | None:
    """x as a float when it is a finite number, else None (absent, null, NaN, a string)."""
    return float(x) if isinstance(x, int | float) and math.isfinite(x) else None


def ctx_label(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


def failure(row: dict[str, Any]) -> str | None:
    """Why a row did not give its figures (OOM, not run, error, incomplete), or None."""
    if row.get("oom"):
        return "OOM"
    if row.get("not_run"):
        return "not run"
    if row.get("error"):
        return "error"
    if row.get("completed") is False:
        return "incomplete"
    return None


@dataclass
class GeneratePoint:
    """One contender at one context: its completed calls' figures and its failed calls."""

    context: int
    decode_tok_s: list[float] = field(default_factory=list)
    memory_gb: list[float] = field(default_factory=list)  # completed calls
    failed_memory_gb: list[float] = field(default_factory=list)  # failed calls that have one
    failures: list[str] = field(default_factory=list)  # one reason per failed call

    @property
    def calls(self) -> int:
        return len(self.decode_tok_s) + len(self.failures)

    def failure_label(self) -> str | None:
        """'OOM', or 'OOM 1/3' when other calls completed; reasons joined by ', '."""
        if not self.failures:
            return None
        counts = {reason: self.failures.count(reason) for reason in dict.fromkeys(self.failures)}
        if len(counts) == 1 and len(self.failures) == self.calls:
            return self.failures[0]
        return ", ".join(f"{reason} {n}/{self.calls}" for reason, n in counts.items())


@dataclass
class GenerateSeries:
    label: str
    contender: str
    points: list[GeneratePoint]


def generate_memory_key(result: dict[str, Any]) -> tuple[str, str]:
    """(row key, axis label) of the peak memory drawn for this result (GENERATE_MEMORY_KEYS)."""
    rows = result.get("runs") or []
    for key, label in GENERATE_MEMORY_KEYS:
        if any(finite_number(r.get(key)) is not None for r in rows):
            return key, label
    return GENERATE_MEMORY_KEYS[0]


def _series_label(row: dict[str, Any]) -> str:
    if "mode" in row:  # card mode
        return f"{row['contender']} ({'card ' + row['card'] if row.get('card') else 'no card'})"
    budget = row.get("budget")
    return f"{row['contender']} ({'no budget' if budget in (None, 'none') else budget})"


def generate_series(result: dict[str, Any]) -> list[GenerateSeries]:
    """The result's rows grouped by contender (and card or budget), in the order they first
    appear, each with one point per context, contexts ascending."""
    key, _ = generate_memory_key(result)
    series: dict[str, GenerateSeries] = {}
    points: dict[tuple[str, int], GeneratePoint] = {}
    for row in result.get("runs") or []:
        label = _series_label(row)
        s = series.setdefault(label, GenerateSeries(label, row["contender"], []))
        p = points.get((label, row["context"]))
        if p is None:
            p = points[(label, row["context"])] = GeneratePoint(row["context"])
            s.points.append(p)
        memory, tok_s = finite_number(row.get(key)), finite_number(row.get("decode_tok_s"))
        why = failure(row) or (None if tok_s is not None else "no decode")
        if why is None:
            p.decode_tok_s.append(tok_s)
            if memory is not None:
                p.memory_gb.append(memory)
        else:
            p.failures.append(why)
            if memory is not None:
                p.failed_memory_gb.append(memory)
    for s in series.values():
        s.points.sort(key=lambda p: p.context)
    return list(series.values())


@dataclass
class TrainPoint:
    label: str
    step_s: float | None
    memory_gb: float | None
    failure: str | None  # why it has no point


def _train_label(row: dict[str, Any]) -> str:
    return f"{row['contender']} (no card)" if row.get("mode") == "no_card" else row["contender"]


def train_points(result: dict[str, Any]) -> list[TrainPoint]:
    """One per contender row, in the result's order; growth rows (memory after each of many
    steps, not a step time) are not points."""
    out = []
    for row in result.get("runs") or []:
        if "growth" in row or row.get("contender") == "growth":
            continue
        step_s, memory = finite_number(row.get("step_s")), finite_number(row.get("peak_gb"))
        why = failure(row) or (None if step_s is not None and memory is not None else "no figures")
        if why == "error" and row.get("error_type"):
            why = row["error_type"]
        elif why == "error" and str(row.get("error", "")).startswith("skipped"):
            why = "skipped"
        out.append(TrainPoint(_train_label(row), step_s, memory, why))
    return out


def result_kind(result: dict[str, Any]) -> str:
    """'generate' or 'train', from the rows; ValueError when neither."""
    rows = result.get("runs") or []
    if rows and all("context" in r for r in rows):
        return "generate"
    if rows and any("step_s" in r or "growth" in r for r in rows):
        return "train"
    raise ValueError(
        "not a bench_generate or bench_train result: its 'runs' have neither 'context' nor "
        f"'step_s' ({len(rows)} rows)"
    )


def train_card_gb(result: dict[str, Any]) -> float | None:
    """The card's size in GB as a card worker's ballast recorded it (bytes), or None."""
    for row in result.get("runs") or []:
        ballast = (row.get("device_setup") or {}).get("ballast") or {}
        if row.get("mode") == "card" and finite_number(ballast.get("card_bytes")) is not None:
            return ballast["card_bytes"] / 1e9
    return None
