"""The REVIVA_* environment switches (reviva/switches.py): read in that module alone, "0",
"false", "off" and "no" alike (any case), a value that is neither on nor off refused naming the
variable, and each one's effect where it acts."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

from reviva import switches, trace
from reviva.cache import window_rings

PACKAGE = pathlib.Path(switches.__file__).parent


@pytest.mark.parametrize("word", ["0", "false", "off", "no", "OFF", "False", " no "])
def test_off_reads_alike(monkeypatch: pytest.MonkeyPatch, word: str) -> None:
    monkeypatch.setenv("REVIVA_WINDOW_RINGS", word)
    assert window_rings.rings_wanted() is False
    monkeypatch.setenv("REVIVA_PROGRESS", word)
    assert trace.PrefillProgress.wanted(True, 1 << 20) is True  # (an explicit True: the caller's)
    assert trace.PrefillProgress.wanted("auto", 1 << 20) is False
    assert switches.progress() is False


@pytest.mark.parametrize("word", ["1", "true", "on", "yes", "ON", "", None])
def test_on_and_unset_read_alike(monkeypatch: pytest.MonkeyPatch, word: str | None) -> None:
    for name in ("REVIVA_WINDOW_RINGS", "REVIVA_FETCH_WINDOWS", "REVIVA_SHARE_PROMPT"):
        if word is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, word)
    assert window_rings.rings_wanted() and switches.fetch_windows() and switches.share_prompt()


@pytest.mark.parametrize("word", ["2", "disable", "of"])
def test_a_value_neither_on_nor_off_is_refused_by_name(
    monkeypatch: pytest.MonkeyPatch, word: str
) -> None:
    monkeypatch.setenv("REVIVA_ROUTED_EXPERTS", word)
    with pytest.raises(ValueError, match=rf"REVIVA_ROUTED_EXPERTS='{word}': expected one of"):
        switches.routed_experts()


def test_valued_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REVIVA_HOST_ATTENTION_THREADS", "3")
    assert switches.host_attention_threads() == 3
    for bad in ("0", "-1", "four"):
        monkeypatch.setenv("REVIVA_HOST_ATTENTION_THREADS", bad)
        with pytest.raises(ValueError, match=f"REVIVA_HOST_ATTENTION_THREADS='{bad}'"):
            switches.host_attention_threads()
    monkeypatch.delenv("REVIVA_HOST_ATTENTION_THREADS")
    assert switches.host_attention_threads() >= 1
    monkeypatch.setenv("REVIVA_PIN_HOST_COPIES", "before_compute")
    assert switches.pin_mode() == "before_compute"
    monkeypatch.setenv("REVIVA_PIN_HOST_COPIES", "later")
    with pytest.raises(ValueError, match="REVIVA_PIN_HOST_COPIES must be one of"):
        switches.pin_mode()


def test_the_environment_is_read_in_switches_alone() -> None:
    """No other module of the package reads os.environ or os.getenv."""
    readers = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "switches.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv"):
                readers.append(f"{path.name}:{node.lineno}")
    assert not readers, readers


def test_every_switch_read_is_documented() -> None:
    text = (PACKAGE / "switches.py").read_text()
    doc = ast.get_docstring(ast.parse(text)) or ""
    named = set(re.findall(r'"(REVIVA_[A-Z0-9_]+)"', text))  # (the names the code reads)
    assert len(named) == 9 and {n for n in named if n not in doc} == set(), named


def test_an_upper_bound_on_host_attention_threads() -> None:
    """A thread count the binding cannot take (a C int) or the core should not start is refused
    naming the variable and the value (2^64 raised pybind's TypeError mid-call)."""
    mp = pytest.MonkeyPatch()
    try:
        for bad in ("99999999999999999999", str(1 << 31), "4097"):
            mp.setenv("REVIVA_HOST_ATTENTION_THREADS", bad)
            with pytest.raises(ValueError, match=rf"REVIVA_HOST_ATTENTION_THREADS='{bad}'.*4096"):
                switches.host_attention_threads()
        mp.setenv("REVIVA_HOST_ATTENTION_THREADS", "4096")
        assert switches.host_attention_threads() == 4096
    finally:
        mp.undo()


# (a value each switch refuses)
BAD = {
    "REVIVA_PROGRESS": "maybe",
    "REVIVA_FETCH_WINDOWS": "banana",
    "REVIVA_SHARE_PROMPT": "2",
    "REVIVA_ROUTED_EXPERTS": "of",
    "REVIVA_WINDOW_RINGS": "disable",
    "REVIVA_DECODE_ROW_OPS": "nope",
    "REVIVA_PIN_HOST_COPIES": "later",
    "REVIVA_HOST_ATTENTION_THREADS": "99999999999999999999",
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_bad_value_is_refused_at_the_call_whichever_path_it_takes(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A value a switch refuses is refused by a generate call naming the variable, also where
    the call's path never reads that switch (REVIVA_FETCH_WINDOWS on the CPU, where no window is
    fetched: it was accepted), before any work; the same call runs once it is unset."""
    import torch
    from test_generate import tiny_model

    from reviva import RevivaManager

    manager = RevivaManager(tiny_model("llama", seed=30))
    ids = torch.randint(1, 211, (1, 12), generator=torch.Generator().manual_seed(31))
    monkeypatch.setenv(name, BAD[name])
    with pytest.raises(ValueError, match=name):
        manager.generate(ids, max_new_tokens=2, do_sample=False)
    monkeypatch.delenv(name)
    assert manager.generate(ids, max_new_tokens=2, do_sample=False).shape == (1, 14)


def test_every_switch_is_read_by_the_package() -> None:
    """Each reader in switches.py has a caller in another module of the package (a switch no
    path reads would be accepted and do nothing)."""
    tree = ast.parse((PACKAGE / "switches.py").read_text())
    readers = {
        f.name
        for f in tree.body
        if isinstance(f, ast.FunctionDef) and f.name not in ("flag", "check_all")
    }
    called = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "switches.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                if node.value.id == "switches":
                    called.add(node.attr)
    assert readers - called == set(), readers - called
