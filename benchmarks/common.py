"""What every Reviva benchmark records beside its figures: git sha, GPU, versions, command line.

Also a tiny table printer, so each benchmark ends with a short table a reader can check.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"


def git_sha() -> str:
    """The commit measured, with '-dirty' when the tree had uncommitted changes. REVIVA_GIT_SHA
    wins: the GPU machine's copy of the tree may carry a stale .git."""
    if os.environ.get("REVIVA_GIT_SHA"):
        return os.environ["REVIVA_GIT_SHA"]
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("REVIVA_GIT_SHA", "unknown")


def environment(cuda: bool = True) -> dict[str, Any]:
    """cuda=False leaves the device alone (a card-mode driver: its workers report the GPU)."""
    import torch

    env: dict[str, Any] = {
        "git_sha": git_sha(),
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
    }
    if cuda and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env["gpu"] = props.name
        env["gpu_memory_bytes"] = props.total_memory
        env["gpu_count"] = torch.cuda.device_count()
    else:
        env["gpu"] = None
    if not cuda:
        return env
    try:
        import reviva

        env["reviva_core"] = reviva.core_version()
    except ImportError:
        env["reviva_core"] = None
    return env


def result_path(name: str, env: dict[str, Any], out_dir: Path | None = None) -> Path:
    """benchmarks/results/<name>-<date>-<sha>.json (or in out_dir), with -2, -3... when taken:
    for a run that rewrites its file as results arrive and must not overwrite an earlier run's."""
    out_dir = out_dir or RESULTS
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{name}-{env['date_utc'][:10]}-{env['git_sha'][:12]}"
    path, n = out_dir / f"{stem}.json", 1
    while path.exists():
        n += 1
        path = out_dir / f"{stem}-{n}.json"
    return path


def write_json(path: Path, payload: dict[str, Any]) -> Path:
    """Writes through a temporary file and a rename: a run killed mid-write leaves the previous
    complete file, never half of one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=False, default=str) + "\n")
    os.replace(tmp, path)
    return path


def write_result(name: str, payload: dict[str, Any], out_dir: Path | None = None) -> Path:
    """Writes benchmarks/results/<name>-<date>-<sha>.json (or into out_dir) and returns the path."""
    out_dir = out_dir or RESULTS
    out_dir.mkdir(parents=True, exist_ok=True)
    env = payload.get("environment") or environment()
    payload = {"environment": env, **payload}
    stamp = env["date_utc"][:10]
    path = out_dir / f"{name}-{stamp}-{env['git_sha'][:12]}.json"
    return write_json(path, payload)


def cell(x: Any, spec: str) -> str:
    """A table cell: `x` formatted by `spec`, or '-' when it is None (a figure not measured)."""
    return "-" if x is None else format(x, spec)


def print_table(headers: list[str], rows: list[list[Any]]) -> None:
    """Prints rows as an aligned text table (floats with 2 decimals)."""

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.2f}"
        return str(v)

    cells = [[fmt(v) for v in row] for row in rows]
    widths = [
        max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)
    ]
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True)))
    for r in cells:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))


def run_worker(cmd: list[str], extra_env: dict[str, str], timeout: float) -> dict[str, Any]:
    """A benchmark's worker in a fresh process, torch's allocator at its defaults (DESIGN.md,
    "Measuring as a user runs it": PYTORCH_*ALLOC_CONF dropped), `extra_env` set: the JSON of the
    last line it prints as "WORKER {...}", or {"error": ...} when it prints none or times out."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
    }
    env.update(extra_env)
    print("# " + " ".join(cmd), flush=True)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        return {"error": f"timed out after {e.timeout:.0f} s"}
    sys.stdout.write(proc.stdout[-4000:])
    found = [ln for ln in proc.stdout.splitlines() if ln.startswith("WORKER ")]
    if found:
        return json.loads(found[-1][7:])
    return {"error": f"worker exited {proc.returncode}", "stderr": proc.stderr[-3000:]}
