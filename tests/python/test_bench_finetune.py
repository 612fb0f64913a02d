"""benchmarks/bench_finetune.py where CI runs: its dry run (a tiny model on the host backend)
through the runs issue 51's acceptance uses (reviva_<T>, chunked_<T>, reviva_lengths), and its
checks' arithmetic on rows made up here (the GPU's figures come from a device run)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_finetune import REPEAT_SLACK, checks  # noqa: E402


def test_the_dry_run_takes_every_run_kind(tmp_path: Path) -> None:
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_finetune.py"),
            "--dry-run",
            "--runs",
            "reviva_512,chunked_512,reviva_lengths",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (path,) = tmp_path.glob("finetune-dry-*.json")
    runs = json.loads(path.read_text())["runs"]
    for name in ("reviva_512", "chunked_512", "reviva_lengths"):
        assert runs[name]["ok"], runs[name].get("error")
    assert [s["tokens"] for s in runs["reviva_lengths"]["steps"]] == [64, 256, 512, 256, 64]
    for name in ("reviva_512", "chunked_512"):
        assert runs[name]["finetune"]["streamed_layers"] > 0
        assert runs[name]["layer_rows_measured"] is None  # (the host backend measures none)


def row(step_s: float, ok: bool = True, **extra: object) -> dict:
    return {"ok": ok, "step_s": step_s, "first_step_s": step_s, **extra}


def test_the_checks_of_issue_51() -> None:
    lengths = [
        (16384, 2.0),
        (65536, 15.0),
        (131072, 52.0),
        (65536, 15.0 * REPEAT_SLACK),
        (16384, 2.5),
    ]
    out = checks(
        {
            "reviva_131072": row(52.0, finetune={"oom_retries": 1, "retried_in": ["x"]}),
            "chunked_262144": row(180.0, forecast={"step_s": 170.0}),
            "reviva_lengths": {
                "ok": True,
                "lengths": [t for t, _ in lengths],
                "steps": [{"tokens": t, "step_s": s, "resident_layers": 6} for t, s in lengths],
            },
            "reviva_65536": row(14.6, gpu="NVIDIA H100 80GB HBM3"),
            "chunked_65536": row(16.9, gpu="NVIDIA H200"),
        }
    )
    assert out["train_lora_8b_128k_first_step"]["pass"]
    assert out["train_lora_8b_128k_first_step"]["oom_retries"] == 1
    assert out["train_lora_8b_256k"]["pass"] and out["train_lora_8b_256k"]["forecast_s"] == 170.0
    lengths_check = out["train_lora_8b_lengths (reviva_lengths)"]
    assert not lengths_check["pass"]  # (the second 16k step: 2.5 s after 2.0)
    assert [s["tokens"] for s in lengths_check["slower_than_first"]] == [16384]
    assert out["train_lora_8b_64k_today (reviva_65536)"]["pass"]  # (14.6 s <= 1.05 x 14.5)
    assert not out["train_lora_8b_64k_today (chunked_65536)"]["pass"]  # (16.9 s > 1.05 x 15.9)
    refused = checks({"reviva_262144": {"ok": False, "error": "does not fit"}})
    assert not refused["train_lora_8b_256k"]["pass"]
    assert refused["train_lora_8b_256k"]["error"] == "does not fit"
