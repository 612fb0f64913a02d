"""bench_generate's plan_1M_fp8 check: `python -m reviva plan`'s forecasts against the card runs
of the 8B shape at 256k and 512k, and its plan for 1M tokens with fp8 K/V."""

from __future__ import annotations

import json
from typing import Any

from generate_contenders import ctx_label
from generate_model import SHAPE

# Issue 13's plan_1M_fp8: `python -m reviva plan` says 1M tokens with fp8 K/V fit a 24 GB card
# and a 128 GiB host and predicts the times; its predictions at these contexts within
# PLAN_TOLERANCE of what the card runs measured.
PLAN_CONTEXTS = (262144, 524288)
PLAN_TOLERANCE = 0.15


def _plan_json(*argv: str) -> dict[str, Any]:
    import contextlib
    import io

    from reviva.cli.main import main as reviva_main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        reviva_main(["plan", "--model", "llama3-8b", "--json", *argv])
    return json.loads(buf.getvalue())


def plan_check(rows: list[dict[str, Any]], settings: dict[str, Any]) -> dict[str, Any] | None:
    """plan_1M_fp8 from the 24 GB card's Reviva rows at 256k and 512k of the 8B shape (None when
    this run has none: another run, merged with --analyse, brings them)."""
    if settings.get("card") != "24GB" or settings.get("num_layers") != SHAPE["num_hidden_layers"]:
        return None
    runs = [
        r
        for r in rows
        if r["mode"] == "card"
        and r["contender"] in ("reviva", "reviva_fp8", "reviva_flash")
        and r["context"] in PLAN_CONTEXTS
        and r.get("completed")
    ]
    if not runs:
        return None
    host = ("--host-memory", "128GiB", "--new-tokens", "16")
    million = _plan_json("--context", "1M", "--kv-dtype", "fp8", *host)
    compared = []
    for r in runs:
        st = r.get("reviva") or {}
        kernel = st.get("attention_kernel") or "flash"  # rows before the choice: flash
        kv = "fp8" if r["contender"] == "reviva_fp8" else "auto"
        new = str(r.get("new_tokens") or 16)
        argv = ["--context", str(r["context"]), "--kv-dtype", kv, "--new-tokens", new]
        pred = _plan_json(*argv, "--attention-kernel", kernel)
        f = pred.get("forecast") or {}
        predicted = f.get("prefill_s")
        if predicted is not None and r["call"] == 1:  # a process's first call: cuDNN's plans
            predicted += f.get("prefill_first_call_extra_s") or 0.0
        x: dict[str, Any] = {
            "contender": r["contender"],
            "context": r["context"],
            "call": r["call"],
            "attention_kernel": kernel,
            "measured_prefill_s": r.get("prefill_s"),
            "predicted_prefill_s": predicted,
            "measured_decode_tok_s": r.get("decode_tok_s"),
            "predicted_decode_tok_s": f.get("decode_call_tok_s"),
        }
        for what in ("prefill_s", "decode_tok_s"):
            m, p = x[f"measured_{what}"], x[f"predicted_{what}"]
            err = p / m - 1 if m and p else None
            x[f"{what}_error"] = err
            x[f"{what}_ok"] = err is not None and abs(err) <= PLAN_TOLERANCE
        x["ok"] = x["prefill_s_ok"] and x["decode_tok_s_ok"]
        compared.append(x)
    bf16 = {x["context"] for x in compared if x["contender"] != "reviva_fp8"}
    missing = [
        f"no completed bf16 card run at {c} tokens to compare with"
        for c in PLAN_CONTEXTS
        if c not in bf16
    ]
    fits = bool(million.get("fits")) and (million.get("host_bytes") or 0) <= 128 * 2**30
    return {
        "kind": "plan",
        "criteria": "plan: 1M tokens, fp8 K/V, fit a 24 GB card and a 128 GiB host with times "
        f"predicted; its prefill and decode predictions within {PLAN_TOLERANCE:.0%} of every "
        f"measured card run at {', '.join(ctx_label(c) for c in PLAN_CONTEXTS)}",
        "missing": missing,
        "plan_1m_fp8": {
            "fits": million.get("fits"),
            "host_bytes": million.get("host_bytes"),
            "forecast": million.get("forecast"),
            "error": million.get("error"),
        },
        "compared": compared,
        "pass": not missing and fits and all(x["ok"] for x in compared),
    }
