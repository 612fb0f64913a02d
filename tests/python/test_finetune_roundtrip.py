"""benchmarks/check_finetune_roundtrip.py, the GPU acceptance of a fine-tuned model's round trip
(finetune, close, merge_and_unload, save_pretrained, reload), runs its every check on the CPU
with a tiny model (--dry-run): the script itself is tested where CI runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("chunks", [None, 48])
def test_the_round_trip_script_passes_its_checks_on_the_cpu(
    tmp_path: Path, chunks: int | None
) -> None:
    """Whole layers (finetune's default) and layers by chunks of 48 query tokens (of 128)."""
    by_chunks = [] if chunks is None else ["--attention-chunk-tokens", str(chunks)]
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "check_finetune_roundtrip.py"),
            "--dry-run",
            "--tokens",
            "128",
            "--steps",
            "2",
            "--out",
            str(tmp_path),
            *by_chunks,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (path,) = tmp_path.glob("finetune-roundtrip-dry-*.json")
    result = json.loads(path.read_text())
    assert set(result["checks"]) == {
        "closed_tensors_identical",
        "closed_loss_equal",
        "saved_tensors_identical",
        "reloaded_loss_equal",
    }
    assert all(c["passed"] for c in result["checks"].values()), result["checks"]
    assert result["checks"]["closed_tensors_identical"]["tensors"] > 0
    assert len(result["run"]["train_losses"]) == 2
    assert result["run"]["streamed_layers"] > 0  # (streamed and resident layers both)
    assert result["run"]["attention_chunk_tokens"] == chunks
    assert result["run"]["layers_by_chunks_refused"] is False
