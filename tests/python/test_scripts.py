"""scripts/lib.sh's reviva_venv, the environment the README's two commands use: it deletes a
directory only when these scripts made it (issue 16: it ran `rm -rf` on whatever REVIVA_VENV
named when the directory lacked the `.complete` marker, a user's own environment included)."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

LIB = Path(__file__).resolve().parents[2] / "scripts" / "lib.sh"


def fake_python(tmp: Path) -> Path:
    """A python3 stand-in: `--version`, and `-m venv DIR` making DIR/bin/python, whose pip
    installs do nothing (no network, no torch download)."""
    stub = tmp / "fake-python"
    stub.write_text(
        "#!/usr/bin/env bash\n"
        'if [ "$1" = --version ]; then echo "Python 3.0.0"; exit 0; fi\n'
        'if [ "$1 $2" = "-m venv" ]; then mkdir -p "$3/bin"\n'
        '  printf "#!/usr/bin/env bash\\nexit 0\\n" > "$3/bin/python"; chmod +x "$3/bin/python"\n'
        "  exit 0; fi\n"
        "exit 3\n"
    )
    stub.chmod(stub.stat().st_mode | stat.S_IXUSR)
    return stub


def run_venv(tmp: Path, venv: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "REVIVA_VENV": str(venv), "PYTHON": str(fake_python(tmp))}
    return subprocess.run(
        ["bash", "-c", f'source "{LIB}" && reviva_venv && echo "VENV=$VENV"'],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_users_own_directory_is_never_deleted(tmp_path: Path) -> None:
    mine = tmp_path / "my-env"
    mine.mkdir()
    (mine / "precious.txt").write_text("mine")
    r = run_venv(tmp_path, mine)
    assert r.returncode != 0
    assert f"{mine} exists and was not made by these scripts" in r.stderr
    assert (mine / "precious.txt").read_text() == "mine"


def test_a_complete_environment_is_reused_untouched(tmp_path: Path) -> None:
    env = tmp_path / "env"
    env.mkdir()
    (env / ".complete").touch()
    (env / "kept.txt").write_text("x")
    r = run_venv(tmp_path, env)
    assert r.returncode == 0, r.stderr
    assert f"VENV={env}" in r.stdout and (env / "kept.txt").exists()


def test_a_half_made_environment_of_ours_is_made_again(tmp_path: Path) -> None:
    """One these scripts began (.reviva-created) and did not finish (no .complete): deleted and
    made again, then marked complete; a new path is made from nothing the same way."""
    env = tmp_path / "env"
    env.mkdir()
    (env / ".reviva-created").touch()
    (env / "stale.txt").write_text("x")
    r = run_venv(tmp_path, env)
    assert r.returncode == 0, r.stderr
    assert not (env / "stale.txt").exists()
    assert (env / ".complete").exists() and (env / "bin" / "python").exists()
    fresh = tmp_path / "new" / "env"
    r = run_venv(tmp_path, fresh)
    assert r.returncode == 0, r.stderr
    assert (fresh / ".complete").exists() and (fresh / ".reviva-created").exists()
