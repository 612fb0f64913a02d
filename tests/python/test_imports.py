"""The package's layers, read from its imports without running them (AST): no import circle,
and no import that runs up the layers the folders draw (each subpackage's __init__.py says what it
may import):

    cli                          the command line
    reviva (__init__.py)         the public names
    generate | train             peers: neither imports the other
    plan                         the memory model and its plans
    cache | weights | activations  peers
    leaves at the top            config, sizes, stats, trace, switches, resources, adapters, ...
    reviva._C                    the core binding

Every import counts: at a module's top, inside a function, and under `if TYPE_CHECKING:` (a
reader follows those too). A module imports its own subpackage, a lower layer, or the leaves."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "python" / "reviva"

# A subpackage's (or the top's) layer; a leaf at the top is layer 0.
LAYERS = {
    "cache": 1,
    "weights": 1,
    "activations": 1,
    "plan": 2,
    "generate": 3,
    "train": 3,
    "reviva": 4,  # the package's __init__.py: the public names
    "cli": 5,
    "reviva.__main__": 6,
}


def modules(root: Path = PACKAGE) -> dict[str, Path]:
    """Every module of the package by its dotted name."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that `name` imports, anywhere in its text."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            # `from reviva.cache import fp8` imports the module reviva.cache.fp8
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names
            ]
        else:
            continue
        found.update(t for t in targets if t in known and t != name)
    return found


def graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    found = modules(root)
    return {name: imports_of(name, path, set(found)) for name, path in found.items()}


def group(name: str) -> str:
    """A module's layer group: its subpackage, the package itself, __main__, or a leaf."""
    parts = name.split(".")
    if name in ("reviva", "reviva.__main__"):
        return name
    if len(parts) > 2 or parts[1] in LAYERS:
        return parts[1]
    return "leaf"


def layer(name: str) -> int:
    return LAYERS.get(group(name), 0)


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def upward(edges: dict[str, set[str]]) -> list[str]:
    """Each import that reaches a higher layer, or a peer subpackage of the same layer."""
    wrong = []
    for importer, targets in sorted(edges.items()):
        for target in sorted(targets):
            same = group(importer) == group(target)
            if not same and layer(target) >= layer(importer):
                wrong.append(f"{importer} -> {target}")
    return wrong


def test_the_walk_sees_the_whole_package() -> None:
    edges = graph()
    assert len(edges) > 60
    assert {"cache", "weights", "activations", "plan", "generate", "train", "cli"} <= {
        group(n) for n in edges
    }
    # (lazy and TYPE_CHECKING imports are seen: the manager's offload_activations)
    assert "reviva.activations.offload" in edges["reviva.generate.manager"]


def test_no_import_circles() -> None:
    assert circles(graph()) == []


def test_no_import_runs_up_the_layers() -> None:
    assert upward(graph()) == []


def test_every_subpackage_says_what_it_owns_and_may_import() -> None:
    for folder in sorted(p for p in PACKAGE.iterdir() if p.is_dir() and p.name in LAYERS):
        doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text()))
        assert doc and "May import" in doc, folder


def test_no_module_keeps_a_list_of_names_it_reexports() -> None:
    """Each internal name has one home: only the package's __init__.py re-exports (its public
    names)."""
    kept = []
    for name, path in modules().items():
        text = path.read_text()
        if name != "reviva" and ("__all__" in text or "re-export" in text):
            kept.append(name)
    assert kept == []


@pytest.mark.parametrize(
    ("text", "wrong"),
    [
        ("from reviva.generate.manager import RevivaManager", "circle_or_up"),
        ("from reviva.train import plan", "up"),
    ],
)
def test_the_checks_catch_a_circle_and_an_upward_import(
    tmp_path: Path, text: str, wrong: str
) -> None:
    """The checks themselves: a copy of the package with one import added to plan/planner.py
    fails them (a test that could not fail would prove nothing)."""
    import shutil

    copy = tmp_path / "reviva"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("*.so*", "__pycache__"))
    planner = copy / "plan" / "planner.py"
    planner.write_text(planner.read_text() + f"\n\ndef _added() -> None:\n    {text}\n")
    edges = graph(copy)
    assert upward(edges), "an import from plan up to generate/train passed"
    if wrong == "circle_or_up":
        assert circles(edges), "plan -> generate.manager -> ... -> plan is a circle"
