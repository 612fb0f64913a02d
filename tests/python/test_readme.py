"""The README's newcomer guide runs as written: every snippet after a `<!-- ci: run -->` line, the
Python ones in order in one process (a later one uses what an earlier one made), each bash line
of the others as a command (`python` is this interpreter)."""

from __future__ import annotations

import pathlib
import re
import shlex
import subprocess
import sys

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"
SNIPPET = re.compile(r"<!-- ci: run -->\n```(python|bash)\n(.*?)```", re.S)


def snippets() -> list[tuple[str, str]]:
    return SNIPPET.findall(README.read_text())


def test_the_guide_has_its_four_parts() -> None:
    text = "\n".join(code for _, code in snippets())
    for part in ("manager.generate(", "manager.trace(", "reviva plan", "enable_activation_offload"):
        assert part in text, part


def test_the_readme_is_a_users_page() -> None:
    """Short enough to read (under ~260 lines: a saved cache's snippet took the last ten), the two
    commands first, and no development
    history: measurements live in benchmarks/README.md, design in docs/."""
    text = README.read_text()
    lines = text.splitlines()
    assert len(lines) <= 260, f"README.md is {len(lines)} lines"
    first = re.search(r"```bash\n(.*?)```", text, re.S)
    assert first is not None and [x.split()[0] for x in first.group(1).splitlines()] == [
        "scripts/demo",
        "scripts/test",
    ]
    assert not re.search(r"\b[0-9a-f]{7,40}\b", text), "a commit hash"
    assert not re.search(r"(?i)\bissue \d+|\bsession \d+", text), "an issue or session"


def test_the_guide_runs_as_written(tmp_path: pathlib.Path) -> None:
    python = "\n".join(code for lang, code in snippets() if lang == "python")
    run = subprocess.run(
        [sys.executable, "-c", python], cwd=tmp_path, capture_output=True, text=True, timeout=900
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    assert "generate-trace.json" in run.stdout and (tmp_path / "prompt.rkv").stat().st_size > 0
    assert "bytes of activations went to the host" in run.stdout
    for lang, code in snippets():
        if lang != "bash":
            continue
        for line in filter(None, (x.strip() for x in code.splitlines())):
            argv = shlex.split(line)
            assert argv[0] == "python", line
            cmd = subprocess.run(
                [sys.executable, *argv[1:]],
                cwd=tmp_path,
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert cmd.returncode == 0, (line, cmd.stdout[-2000:], cmd.stderr[-2000:])
            assert "reviva plan:" in cmd.stdout, cmd.stdout
