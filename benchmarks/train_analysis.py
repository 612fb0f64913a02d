"""bench_train's analysis of its rows: the roofline of every offloading row, the checks (the JSON's
`checks`: train_card, and the earlier offload_all*, reviva_<budget>, no_growth) and the table."""

from __future__ import annotations

from typing import Any

from card import gb
from common import cell, print_table

import reviva

DESIGN_COPY_GBPS = {"d2h": 55.3, "h2d": 55.4}  # DESIGN.md, when no plain worker measured them
MAX_VS_SAVE_ON_CPU = 0.5
MAX_ROOFLINE_RATIO = 1.05


def add_rooflines(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The roofline of every Reviva row, from the plain run's forward and backward (no card when
    there is one) and the measured pinned copy bandwidths (else DESIGN.md's); says which."""
    plain = [r for r in rows if r["contender"] == "plain" and r.get("completed")]
    plain.sort(key=lambda r: r.get("mode") != "no_card")
    ref = plain[0] if plain else None
    bw_rows = [r for r in plain if r.get("pinned_copy_gbps")]
    bw = bw_rows[0]["pinned_copy_gbps"] if bw_rows else DESIGN_COPY_GBPS
    info = {
        "compute_from": f"{ref['mode']} plain" if ref else None,
        "forward_s": ref and ref["forward_s"],
        "backward_s": ref and ref["backward_s"],
        "pinned_copy_gbps": bw,
        "pinned_copy_gbps_from": f"{bw_rows[0]['mode']} plain" if bw_rows else "DESIGN.md",
    }
    for r in rows:
        a = r.get("bytes_offloaded_per_step")
        if a is None or not r.get("completed") or ref is None:
            continue
        roof = max(ref["forward_s"], a / (bw["d2h"] * 1e9)) + max(
            ref["backward_s"], a / (bw["h2d"] * 1e9)
        )
        r["roofline_s"] = roof
        r["ratio_to_roofline"] = r["step_s"] / roof
    return info


def acceptance(rows: list[dict]) -> dict:
    """The earlier checks, from rows of one mode (card or in-process)."""
    by = {r["contender"]: r for r in rows if r.get("completed")}
    soc = by.get("save_on_cpu")
    out: dict[str, Any] = {}
    for name, everything in by.items():
        if not name.startswith("reviva_all") or soc is None:
            continue
        ratio = everything.get("ratio_to_roofline")
        res, soc_res = everything.get("peak_reserved_gb"), soc.get("peak_reserved_gb")
        out[name.replace("reviva_all", "offload_all")] = {
            "ratio_to_roofline": ratio,
            "within_15pct_of_roofline": ratio is not None and ratio <= 1.15,
            "vs_save_on_cpu_time": everything["step_s"] / soc["step_s"],
            "at_most_half_of_save_on_cpu": everything["step_s"] <= 0.5 * soc["step_s"],
            "peak_gb": everything.get("peak_gb"),
            "save_on_cpu_peak_gb": soc.get("peak_gb"),
            "peak_not_above_save_on_cpu": _le(everything.get("peak_gb"), soc.get("peak_gb")),
            "peak_reserved_gb": res,
            "save_on_cpu_peak_reserved_gb": soc_res,
            "peak_reserved_not_above_save_on_cpu": _le(res, soc_res),
        }
    for r in rows:
        if r.get("budget") and r.get("completed"):
            limit = reviva.parse_bytes(r["budget"]) / 1e9
            ratio = r.get("ratio_to_roofline")
            out[r["contender"]] = {
                "peak_gb": r.get("peak_gb"),
                "peak_le_budget": _le(r.get("peak_gb"), limit),
                "peak_reserved_gb": r.get("peak_reserved_gb"),
                "peak_reserved_le_budget": _le(r.get("peak_reserved_gb"), limit),
                "ratio_to_roofline": ratio,
                "within_10pct_of_roofline": ratio is not None and ratio <= 1.1,
            }
    growth = next((r["growth"] for r in rows if r.get("growth")), None)
    if growth and growth.get("step_s"):
        steps = len(growth["step_s"])
        out["no_growth"] = {
            "steps": steps,
            "allocated_constant": len(set(growth["allocated_gb"])) == 1,
            "reserved_constant_after_5": len(set(growth["reserved_gb"][5:])) <= 1,
            "pinned_constant_after_5": len(set(growth["pinned_reserved_gb"][5:])) <= 1,
            "pinned_in_use_zero": not any(growth["pinned_in_use_bytes"]),
        }
    return out


def _le(a: float | None, b: float | None) -> bool:
    return a is not None and b is not None and a <= b


def train_card_check(rows: list[dict], card: str) -> dict[str, Any]:
    """The card mode's acceptance: offload-all against save_on_cpu and its roofline, budgets."""
    by = {r["contender"]: r for r in rows if r.get("mode") == "card"}
    soc, everything = by.get("save_on_cpu"), by.get("reviva_all")
    missing = []
    for name, r in (("save_on_cpu", soc), ("reviva_all", everything)):
        if r is None:
            missing.append(f"no {name} run on the card")
        elif not r.get("completed"):
            missing.append(f"{name} on the card failed: {r.get('error')}")
    offload_all: dict[str, Any] = {"contender": "reviva_all"}
    if everything is not None and everything.get("completed") and soc and soc.get("completed"):
        ratio = everything.get("ratio_to_roofline")
        if ratio is None:
            missing.append("no roofline for reviva_all (no completed plain run)")
        offload_all.update(
            step_s=everything["step_s"],
            first_step_s=everything.get("first_step_s"),
            save_on_cpu_step_s=soc["step_s"],
            vs_save_on_cpu_time=everything["step_s"] / soc["step_s"],
            time_ok=everything["step_s"] <= MAX_VS_SAVE_ON_CPU * soc["step_s"],
            peak_gb=everything.get("peak_gb"),
            save_on_cpu_peak_gb=soc.get("peak_gb"),
            peak_ok=_le(everything.get("peak_gb"), soc.get("peak_gb")),
            card_peak_used_gb=everything.get("card_peak_used_gb"),
            save_on_cpu_card_peak_used_gb=soc.get("card_peak_used_gb"),
            ratio_to_roofline=ratio,
            roofline_ok=ratio is not None and ratio <= MAX_ROOFLINE_RATIO,
        )
        offload_all["ok"] = bool(
            offload_all["time_ok"] and offload_all["peak_ok"] and offload_all["roofline_ok"]
        )
    else:
        offload_all["ok"] = False
    budgets = {}
    for name, r in by.items():
        spec = r.get("spec") or {}
        if spec.get("kind") != "reviva" or not spec.get("budget"):
            continue
        limit = reviva.parse_bytes(spec["budget"]) / 1e9
        budgets[name] = {
            "budget_gb": limit,
            "completed": bool(r.get("completed")),
            "error": r.get("error"),
            "peak_gb": r.get("peak_gb"),
            "ok": bool(r.get("completed")) and _le(r.get("peak_gb"), limit),
            "peak_reserved_gb": r.get("peak_reserved_gb"),
            "max_reserved_timed_gb": r.get("max_reserved_timed_gb"),
            "card_peak_used_gb": r.get("card_peak_used_gb"),
            "step_s": r.get("step_s"),
            "ratio_to_roofline": r.get("ratio_to_roofline"),
        }
    if not budgets:
        missing.append("no reviva_<budget> run on the card")
    return {
        "card": card,
        "criteria": f"reviva_all: step <= {MAX_VS_SAVE_ON_CPU}x save_on_cpu's, peak (allocated) "
        f"<= save_on_cpu's, step <= {MAX_ROOFLINE_RATIO}x the roofline; every reviva_<budget>: "
        "completed, peak (allocated) <= the budget",
        "missing": missing,
        "offload_all": offload_all,
        "budgets": budgets,
        "pass": not missing and offload_all["ok"] and all(b["ok"] for b in budgets.values()),
    }


def finish(rows: list[dict], mode_rows: list[dict], card: str | None) -> dict[str, Any]:
    roof = add_rooflines(rows)
    checks = acceptance(mode_rows)
    if card:
        checks["train_card"] = train_card_check(rows, card)
    return {"roofline_reference": roof, "checks": checks}


def print_rows(rows: list[dict]) -> None:
    print_table(
        [
            "mode",
            "contender",
            "result",
            "step s",
            "first s",
            "peak GB",
            "reserved GB",
            "card peak GB",
            "offloaded GB",
            "roofline s",
            "ratio",
        ],
        [
            [
                r.get("mode", "-"),
                r["contender"],
                "ok" if r.get("completed") else ("OOM" if r.get("oom") else "ERROR"),
                cell(r.get("step_s"), ".3f"),
                cell(r.get("first_step_s"), ".3f"),
                cell(r.get("peak_gb"), ".2f"),
                cell(r.get("peak_reserved_gb"), ".2f"),
                cell(r.get("card_peak_used_gb"), ".2f"),
                cell(gb(r.get("bytes_offloaded_per_step")), ".2f"),
                cell(r.get("roofline_s"), ".3f"),
                cell(r.get("ratio_to_roofline"), ".3f"),
            ]
            for r in rows
        ],
    )
