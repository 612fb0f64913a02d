"""reviva._C's type stubs (python/reviva/_C.pyi, shipped with py.typed): every public name of the
built module, and every method of its classes, is in the stubs, and the stubs name nothing the
module lacks. A binding changed without its stubs fails here."""

from __future__ import annotations

import ast
import inspect
import pathlib

import reviva
from reviva import _C

STUBS = pathlib.Path(reviva.__file__).with_name("_C.pyi")


def _stub_names() -> dict[str, set[str]]:
    tree = ast.parse(STUBS.read_text())
    out: dict[str, set[str]] = {"": set()}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            out[""].add(node.name)
            out[node.name] = {
                n.name for n in node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
            }
        elif isinstance(node, ast.FunctionDef):
            out[""].add(node.name)
    return out


def _public(obj: object) -> set[str]:
    return {n for n in dir(obj) if not n.startswith("_") or n == "__init__"}


def test_stubs_match_the_built_module() -> None:
    assert (STUBS.parent / "py.typed").exists(), "py.typed is shipped beside the stubs"
    stubs = _stub_names()
    module = {n for n in dir(_C) if not n.startswith("_")}
    assert stubs[""] == module, stubs[""] ^ module
    for name in module:
        obj = getattr(_C, name)
        if not inspect.isclass(obj) or issubclass(obj, BaseException):
            continue
        own = {n for n in _public(obj) if n in vars(obj)}  # (methods and properties)
        assert own <= stubs[name] | {"__init__"}, (name, own - stubs[name])
        assert stubs[name] - {"__init__", "__repr__", "__enter__", "__exit__"} <= own, (
            name,
            stubs[name] - own,
        )
