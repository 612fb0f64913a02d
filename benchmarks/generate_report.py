"""What a card-mode run of bench_generate prints (a line per call, a table of every call), and
`--analyse`: the rows of earlier result files (e.g. of separate device calls) merged, checked
again and written as one result."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from common import cell, print_table, result_path, write_json
from generate_checks import analyse_card
from generate_contenders import ctx_label
from generate_model import ANCHORS
from plots import plot_beside


def call_summary(row: dict[str, Any]) -> str:
    result = (
        "ok"
        if row.get("completed")
        else ("OOM" if row.get("oom") else ("not run" if row.get("not_run") else "ERROR"))
    )
    return (
        f"{row['mode']:>7} {row['contender']:>14} {ctx_label(row['context']):>5} call "
        f"{row['call']}: {result:>7} prefill {cell(row.get('prefill_s'), '.2f')} s, decode "
        f"{cell(row.get('decode_tok_s'), '.2f')} tok/s, {row.get('new_tokens')} new, card peak "
        f"{cell(row.get('card_peak_used_gb'), '.2f')} GB, torch "
        f"{cell(row.get('max_memory_allocated_gb'), '.2f')}/"
        f"{cell(row.get('max_memory_reserved_gb'), '.2f')} GB "
        f"{(row.get('error') or '')[:160]}"
    )


def print_card_table(rows: list[dict[str, Any]]) -> None:
    table = []
    for r in rows:
        st = r.get("reviva") or {}
        result = (
            "ok"
            if r.get("completed")
            else ("OOM" if r.get("oom") else ("not run" if r.get("not_run") else "ERROR"))
        )
        table.append(
            [
                r["mode"],
                r["contender"],
                ctx_label(r["context"]),
                r["call"],
                result,
                cell(r.get("prefill_s"), ".2f"),
                cell(r.get("decode_tok_s"), ".2f"),
                cell(r.get("new_tokens"), "d"),
                cell(r.get("max_memory_allocated_gb"), ".2f"),
                cell(r.get("max_memory_reserved_gb"), ".2f"),
                cell(r.get("card_peak_used_gb"), ".2f"),
                cell(st.get("streamed_layers"), "d"),
            ]
        )
    print_table(
        [
            "mode",
            "contender",
            "ctx",
            "call",
            "result",
            "prefill s",
            "decode tok/s",
            "new",
            "alloc GB",
            "reserved GB",
            "card peak GB",
            "streamed",
        ],
        table,
    )


def merge_card(args: argparse.Namespace, parts: list[dict[str, Any]]) -> int:
    settings = dict(parts[0]["settings"])
    for p in parts[1:]:
        s = p["settings"]
        for k in ("card", "kv_bytes_per_token_per_layer", "calls_per_worker", "num_layers"):
            if s.get(k) != settings.get(k):
                raise ValueError(f"cannot merge: {k} differs ({s.get(k)!r} vs {settings.get(k)!r})")
    settings["contexts"] = sorted({c for p in parts for c in p["settings"]["contexts"]})
    # One row per (mode, contender, context, call): a later file's row replaces an earlier one
    # (a re-run), except that a call not run never replaces one that ran.
    merged: dict[tuple, dict[str, Any]] = {}
    replaced = 0
    for p in parts:
        for r in p["runs"]:
            key = (r["mode"], r["contender"], r["context"], r["call"])
            if key in merged and r.get("not_run") and not merged[key].get("not_run"):
                continue
            replaced += key in merged
            merged[key] = r
    rows = list(merged.values())
    settings["merge_replaced_rows"] = replaced
    analysis = analyse_card(rows, settings)
    print_card_table(rows)
    print(json.dumps(analysis["checks"], indent=1))
    env = {
        **parts[0]["environment"],
        "merged_from": [
            {
                "file": Path(f).name,
                "git_sha": p["environment"]["git_sha"],
                "command": p["environment"]["command"],
                "complete": p.get("complete"),
            }
            for f, p in zip(args.analyse, parts, strict=True)
        ],
    }
    payload = {
        "environment": env,
        "complete": all(p.get("complete") for p in parts),
        "model": parts[0]["model"],
        "settings": settings,
        "anchors": ANCHORS,
        "workers": [w for p in parts for w in p.get("workers", [])],
        "runs": rows,
        **analysis,
    }
    path = result_path(args.name or f"generate-{settings['card_label']}-merged", env, args.out_dir)
    write_json(path, payload)
    print(f"wrote {path}")
    plot_beside(path)
    return 0
