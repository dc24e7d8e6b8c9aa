"""The torch layer's rules (DESIGN.md, "Rooms"; issue 24), checked from the source with ast.

lightcc/torch is a thin adapter over lightcc.common's public door: no import cycle between its
modules (an import deferred into a function counts: dodging a cycle that way is still a
cycle), no mpi4py (point-to-point, the c10d bootstrap and the thread level go through
``lightcc.common.backends.mpi``), no private name of lightcc.common imported or used (nor
``api.engine()``: the engine object is not the door), and no file over 400 lines.
"""
from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TORCH = ROOT / "lightcc" / "torch"
MAX_LINES = 400
NOT_THE_DOOR = {"engine"}      # public names of lightcc.common the torch layer must not use


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


FILES = sorted(TORCH.rglob("*.py"))
MODULES = {module_name(p): p for p in FILES}


def _resolve(mod: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    parts = mod.split(".") if is_pkg else mod.split(".")[:-1]
    parts = parts[:len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def _private(dotted: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__")
               for part in dotted.split("."))


def scan(mod: str, is_pkg: bool, source: str, known: set[str]) -> tuple[set[str], list[str]]:
    """(the modules of ``known`` that ``mod`` imports anywhere in ``source``, the rule
    violations found, each with its line)."""
    tree = ast.parse(source)
    deps: set[str] = set()
    problems: list[str] = []
    common_names: set[str] = set()   # local names bound to lightcc.common modules or objects
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "mpi4py":
                    problems.append(f"line {node.lineno}: imports mpi4py")
                if a.name.startswith("lightcc.common"):
                    if _private(a.name):
                        problems.append(f"line {node.lineno}: imports private {a.name}")
                    if a.asname:
                        common_names.add(a.asname)
                if a.name in known:
                    deps.add(a.name)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(mod, is_pkg, node)
            if base.split(".")[0] == "mpi4py":
                problems.append(f"line {node.lineno}: imports mpi4py")
            for a in node.names:
                full = f"{base}.{a.name}"
                if base == "lightcc.common" or base.startswith("lightcc.common."):
                    if _private(full):
                        problems.append(f"line {node.lineno}: imports private {full}")
                    common_names.add(a.asname or a.name)
                if full in known:
                    deps.add(full)
                elif base in known:
                    deps.add(base)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id in common_names:
            if _private(node.attr) or node.attr in NOT_THE_DOOR:
                problems.append(f"line {node.lineno}: uses {node.value.id}.{node.attr}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and isinstance(node.func.value, ast.Name) and node.func.value.id in common_names:
            for kw in node.keywords:
                if kw.arg and _private(kw.arg):
                    problems.append(f"line {node.lineno}: passes {kw.arg}= to "
                                    f"{node.func.value.id}.{node.func.attr}")
    deps.discard(mod)
    return deps, problems


def a_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of ``graph`` (its modules, the first repeated at the end), or []."""
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as exc:
        return list(exc.args[1])
    return []


def _scan_file(path: Path) -> tuple[set[str], list[str]]:
    return scan(module_name(path), path.name == "__init__.py", path.read_text(),
                set(MODULES))


def test_the_torch_layer_is_found():
    assert "lightcc.torch.optimizer" in MODULES and "lightcc.torch.c10d.group" in MODULES


def test_no_import_cycles_in_the_torch_layer():
    graph = {mod: _scan_file(path)[0] for mod, path in MODULES.items()}
    assert a_cycle(graph) == []


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_only_the_public_door_of_common_and_no_mpi4py(path):
    _, problems = _scan_file(path)
    assert problems == [], f"{path.relative_to(ROOT)}: {problems}"


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_torch_file_over_400_lines(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(ROOT)} has {lines} lines"


def test_the_checker_sees_each_violation():
    """The rules above can fail: each planted violation is reported."""
    known = {"lightcc.torch.a", "lightcc.torch.b"}
    source_a = (
        "from ..common import api as _api\n"
        "from ..common.api import _pset_id\n"
        "from . import b\n"
        "def f():\n"
        "    from mpi4py import MPI\n"
        "    return _api.engine(), _api._root_index, MPI\n"
        "_api.allreduce_async(x, _wake=False)\n")
    deps, problems = scan("lightcc.torch.a", False, source_a, known)
    assert deps == {"lightcc.torch.b"}
    text = "\n".join(problems)
    for expected in ("imports private lightcc.common.api._pset_id", "imports mpi4py",
                     "uses _api.engine", "uses _api._root_index",
                     "passes _wake= to _api.allreduce_async"):
        assert expected in text, (expected, problems)
    # a deferred import back to a is still an edge, and a cycle
    deps_b, _ = scan("lightcc.torch.b", False, "def g():\n    from .a import x\n", known)
    assert deps_b == {"lightcc.torch.a"}
    assert sorted(set(a_cycle({"lightcc.torch.a": deps, "lightcc.torch.b": deps_b}))) == \
        ["lightcc.torch.a", "lightcc.torch.b"]
    clean, none = scan("lightcc.torch.a", False,
                       "from ..common import api\nx = api.allreduce_async\n", known)
    assert clean == set() and none == []
