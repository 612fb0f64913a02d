"""The package's shape: every module small enough to read in one sitting (one concept each), the
core's sources too, and the benchmark scripts; the public names where the package says they are.
The layers the folders draw are checked in test_imports.py."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "python" / "reviva"
MAX_LINES = 500  # a Python module
MAX_CORE_LINES = 550  # a core source (C++/CUDA)
MAX_BENCHMARK_LINES = 600  # a benchmark script


def _too_long(paths: list[Path], limit: int) -> list[str]:
    lengths = {p.relative_to(REPO): len(p.read_text().splitlines()) for p in paths}
    return [f"{p}: {n} lines" for p, n in sorted(lengths.items()) if n > limit]


def test_every_module_stays_under_500_lines() -> None:
    modules = sorted(PACKAGE.rglob("*.py"))
    assert len(modules) > 60, modules  # (the walk found the package)
    assert _too_long(modules, MAX_LINES) == [], f"split these (at most {MAX_LINES} lines)"


def test_every_core_source_stays_under_550_lines() -> None:
    sources = [
        p
        for folder in ("src", "include", "kernels")
        for p in sorted((REPO / folder).rglob("*"))
        if p.suffix in (".cpp", ".h", ".cu", ".cuh")
    ]
    assert len(sources) > 30, sources
    assert _too_long(sources, MAX_CORE_LINES) == [], f"split these (at most {MAX_CORE_LINES})"


def test_every_benchmark_script_stays_under_600_lines() -> None:
    scripts = sorted((REPO / "benchmarks").rglob("*.py"))
    assert len(scripts) > 5, scripts
    assert _too_long(scripts, MAX_BENCHMARK_LINES) == [], f"split these ({MAX_BENCHMARK_LINES})"


def test_public_names_are_the_package_exports() -> None:
    """Every name in reviva.__all__ resolves (the transformers-backed ones on first use), and each
    class's module is its one home in the subpackages."""
    import reviva

    for name in reviva.__all__:
        assert getattr(reviva, name) is not None, name
    assert reviva.RevivaManager.__module__ == "reviva.generate.manager"
    assert reviva.RevivaCache.__module__ == "reviva.cache.kv_cache"
    assert reviva.Finetune.__module__ == "reviva.train.finetune"
    assert reviva.ActivationOffload.__module__ == "reviva.activations.offload"
    assert reviva.RevivaOffloadCallback.__module__ == "reviva.activations.hf_trainer"
    assert reviva.SavedCache.__module__ == reviva.load_cache.__module__ == "reviva.cache.saved"


@pytest.mark.parametrize("command", ["demo", "transfers", "plan"])
def test_command_line_names_each_command(command: str) -> None:
    """`python -m reviva` and the console script reach one parser (reviva/cli/main.py)."""
    import reviva.__main__ as entry
    from reviva.cli.main import main

    assert entry.main is main
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
