"""The layering rules of lightcc/common (DESIGN.md, "Rooms"), checked from the source with ast.

Every import counts, also one deferred into a function (a deferred import that dodges a cycle
is still a cycle). Checked: no import cycle between modules, none between folders (so no
folder imports one that imports it back: dependencies point one way); mpi4py imported only in
backends/ and the launcher (runner/); CuPy never in algorithms/ or the control plane; no file
in lightcc/common over 400 lines. Scope: lightcc/__init__.py and lightcc/common (the torch
layer joins once its cycles are gone).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "lightcc"
MAX_LINES = 400


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _files(scope: str) -> list[Path]:
    base = PKG / scope if scope else PKG
    return sorted(base.rglob("*.py")) if scope else [PKG / "__init__.py"]


ALL = {_module_name(p): p for p in PKG.rglob("*.py")}


def _resolve(mod: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    pkg = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
    base = pkg[:len(pkg) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(path: Path) -> set[str]:
    """Every module ``path`` imports, anywhere in the file (lightcc modules resolved to the
    deepest module that exists; others by their top-level name)."""
    mod = _module_name(path)
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(mod, path, node)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in ALL else base
                       for a in node.names]
        else:
            continue
        for t in targets:
            if t.split(".")[0] == "lightcc":
                while t not in ALL and "." in t:
                    t = t.rsplit(".", 1)[0]
            out.add(t)
    return out


SCOPE = [p for s in ("", "common") for p in _files(s)]
GRAPH = {_module_name(p): {t for t in imports_of(p) if t in ALL} for p in SCOPE}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _folder(mod: str) -> str:
    """The room a module belongs to: its package below lightcc.common (or the module itself
    for top-level modules of lightcc.common)."""
    parts = mod.split(".")
    if parts[:2] != ["lightcc", "common"] or len(parts) < 3:
        return mod
    return ".".join(parts[:3])


def test_the_checker_sees_imports_deferred_into_functions(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from mpi4py import MPI\n    import cupy\n")
    assert {"mpi4py", "cupy"} <= imports_of(src)
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles_between_modules():
    assert _cycles(GRAPH) == []


def test_no_import_cycles_between_folders():
    folders: dict[str, set[str]] = {}
    for mod, targets in GRAPH.items():
        src = _folder(mod)
        folders.setdefault(src, set()).update(_folder(t) for t in targets if _folder(t) != src)
    assert _cycles(folders) == []


@pytest.mark.parametrize("path", SCOPE, ids=lambda p: str(p.relative_to(ROOT)))
def test_mpi4py_only_in_backends_and_launcher(path):
    rel = path.relative_to(PKG).as_posix()
    if rel.startswith(("common/backends/", "runner/")):
        return
    assert "mpi4py" not in imports_of(path), f"{rel} imports mpi4py"


CUPY_FREE = ("common/algorithms/", "common/control/")


@pytest.mark.parametrize("path", SCOPE, ids=lambda p: str(p.relative_to(ROOT)))
def test_cupy_never_in_algorithms_or_the_control_plane(path):
    rel = path.relative_to(PKG).as_posix()
    if rel.startswith(CUPY_FREE):
        assert "cupy" not in imports_of(path), f"{rel} imports cupy"


@pytest.mark.parametrize("path", [p for p in SCOPE if "common" in p.parts],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_no_file_in_common_over_400_lines(path):
    n = len(path.read_text().splitlines())
    assert n <= MAX_LINES, f"{path.relative_to(ROOT)} has {n} lines"
