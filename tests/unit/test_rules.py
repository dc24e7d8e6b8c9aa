"""Rules about how lightcc's objects are written (issue 37), checked from the source with ast.

Beside test_layers.py (who may import whom), these say who may touch whose state:

- no mixin class in lightcc/common: a class that uses attributes of ``self`` that neither it
  nor its (lightcc) bases define lives off the state of whatever class inherits it, so two
  files write one object's fields and nobody owns them;
- no module reads another module's ``_private`` attribute (lightcc's own objects included):
  ``obj._x`` (``self._x`` too) is allowed only in a module that itself defines ``_x`` (a
  ``def``, a class, a ``self._x =`` assignment, a class-level name or a ``__slots__`` entry).
  Public names of the standard library that start with ``_`` (``namedtuple._replace``,
  ``os._exit``, ``sys._getframe``) are allowed. The check is by attribute name, not by type:
  a module that defines ``_x`` for its own objects may also read another object's ``_x``
  unseen (the cost of checking without importing anything);
- no file anywhere in lightcc/ over 400 lines.

Where a rule does not hold yet, the places that break it are listed below by name; each list
may only shrink (an entry that holds again fails the test until it is removed).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "lightcc"
MAX_LINES = 400
FILES = sorted(PKG.rglob("*.py"))
COMMON = [p for p in FILES if "common" in p.relative_to(PKG).parts[:1]]

#: Underscore names that are public API of the standard library (namedtuple, os, sys).
STDLIB_PUBLIC = {"_replace", "_asdict", "_fields", "_make", "_exit", "_getframe",
                 "_current_frames"}

#: Files over MAX_LINES lines, by path below lightcc/ (may only shrink).
LONG_FILES: set[str] = set()     # (runner/supervise.py was split by issue 38's work)

#: Mixins still in lightcc/common: "module:Class" (may only shrink).
MIXINS = {
    "lightcc.common.control.outcomes:Outcomes",
}

#: Private reads across modules still there: "path below lightcc/" -> the attribute names
#: (may only shrink).
PRIVATE_READS = {
    "common/api/lifecycle.py": {"_engine", "_lock"},
    "common/backends/mpi.py": {"_typedict"},
    "common/compression/autoprobe.py": {"_compressor"},
    "common/control/controller.py": {"_by_priority", "_forget_name", "_missing", "_respond",
                                     "_scan", "_type_mismatches"},
    "common/control/outcomes.py": {"_mark_ready", "_names", "_push", "_sorted", "_suspects",
                                   "_where"},
    "common/elastic/recovery.py": {"_added_sets", "_engine"},
    "common/engine.py": {"_set"},
    "common/execution/run.py": {"_set"},
    "common/kernels/ef_topk.py": {"_ef_gather"},
    "common/mca.py": {"_Environ"},
    "common/observability/flight.py": {"_chained", "_error", "_lightcc_flight"},
    "gpucheck/engine_check.py": {"_sleep"},
    "runner/args.py": {"_actions"},
    "torch/_tensor.py": {"_tensor"},
    "torch/autograd.py": {"_allreduce_now", "_base_name", "_grouped_allreduce_submit"},
    # torch's c10d registry has no public way to declare a backend's devices or to drop a
    # group that failed in its creator (issue 41: dcp.async_save needs the CPU device)
    "torch/c10d/backend.py": {"_device_types", "_lightcc_original", "_plugins",
                              "_rendezvous_handlers", "_timeout", "_unregister_process_group"},
    "torch/c10d/group.py": {"_key"},
    "torch/c10d/movement.py": {"_kw", "_merge", "_route", "_what", "_work"},
    "torch/c10d/p2p.py": {"_keep", "_timeout", "_what"},
    "torch/collectives.py": {"_reset_hooks"},
    "torch/elastic/state.py": {"_handlers"},
    # torch's profiler has no public enter/exit for a range that spans two calls (issue 38)
    "torch/profiler_ranges.py": {"_is_profiler_enabled", "_record_function_enter_new",
                                 "_record_function_exit"},
    "torch/sync_batch_norm.py": {"_allreduce_submit"},
}


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def defined_names(tree: ast.AST) -> set[str]:
    """The attribute names a module defines for its own objects (see module docstring)."""
    out: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            out.add(n.id)
        elif isinstance(n, ast.Attribute) and isinstance(n.ctx, (ast.Store, ast.Del)) \
                and _is_self(n.value):
            out.add(n.attr)
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            out.add(n.target.id)
        elif isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__slots__"
                                               for t in n.targets):
            if isinstance(n.value, (ast.Tuple, ast.List)):
                out.update(e.value for e in n.value.elts if isinstance(e, ast.Constant))
    return out


def private_reads(tree: ast.AST) -> set[str]:
    """``_names`` read as attributes in ``tree`` that the module does not define itself."""
    mine = defined_names(tree)
    return {n.attr for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and n.attr.startswith("_")
            and not n.attr.startswith("__") and n.attr not in STDLIB_PUBLIC
            and n.attr not in mine}


def _class_defines(cls: ast.ClassDef) -> set[str]:
    out: set[str] = set()
    for n in ast.walk(cls):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n in cls.body:
            out.add(n.name)
        elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and _is_self(n.value):
            out.add(n.attr)
    for stmt in cls.body:
        targets = []
        if isinstance(stmt, ast.Assign):
            targets = stmt.targets
        elif isinstance(stmt, ast.AnnAssign):
            targets = [stmt.target]
        for t in targets:
            if isinstance(t, ast.Name):
                out.add(t.id)
                if t.id == "__slots__" and isinstance(stmt.value, (ast.Tuple, ast.List)):
                    out.update(e.value for e in stmt.value.elts if isinstance(e, ast.Constant))
        if isinstance(stmt, ast.ClassDef):
            out.add(stmt.name)
    return out


def _classes() -> dict[str, tuple[str, ast.ClassDef]]:
    """Every class of lightcc by name -> (module, node); a name defined twice keeps both
    under ``module:Name``."""
    out: dict[str, tuple[str, ast.ClassDef]] = {}
    for path in FILES:
        mod = _module(path)
        for node in _tree(path).body:
            if isinstance(node, ast.ClassDef):
                out[f"{mod}:{node.name}"] = (mod, node)
    return out


CLASSES = _classes()


def _base_names(cls: ast.ClassDef) -> list[str]:
    return [b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else ""
            for b in cls.bases]


def _lightcc_bases(mod: str, cls: ast.ClassDef) -> list[tuple[str, ast.ClassDef]] | None:
    """The lightcc classes ``cls`` inherits from, or None when one base is not lightcc's (its
    attributes are unknown here)."""
    out = []
    for name in _base_names(cls):
        if name in ("object", "Generic", "Protocol"):
            continue
        found = [v for k, v in CLASSES.items() if k.endswith(f":{name}")]
        if not found:
            return None
        same = [v for v in found if v[0] == mod]
        out.append((same or found)[0])
    return out


def _all_defined(mod: str, cls: ast.ClassDef, seen: frozenset = frozenset()) -> set[str] | None:
    """What ``cls`` and its bases define (None: a base is not lightcc's, so anything may be)."""
    bases = _lightcc_bases(mod, cls)
    if bases is None or cls.name in seen:
        return None
    out = _class_defines(cls)
    for bmod, base in bases:
        more = _all_defined(bmod, base, seen | {cls.name})
        if more is None:
            return None
        out |= more
    return out


def mixins() -> set[str]:
    """Classes of lightcc/common that read attributes of ``self`` that neither they nor their
    bases define, or that inherit from more than one lightcc class."""
    out = set()
    for key, (mod, cls) in CLASSES.items():
        if not mod.startswith("lightcc.common"):
            continue
        bases = _lightcc_bases(mod, cls)
        if bases is not None and len(bases) > 1:
            out.add(key)
            continue
        defined = _all_defined(mod, cls)
        if defined is None:
            continue
        used = {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute)
                and isinstance(n.ctx, ast.Load) and _is_self(n.value)}
        if used - defined - {"__class__", "__dict__"}:
            out.add(key)
    return out


# ---- the checker itself -----------------------------------------------------------------------
def test_the_checkers_see_what_they_should(tmp_path):
    tree = ast.parse("class A:\n    __slots__ = ('_a',)\n    def f(self, o):\n"
                     "        return self._a + o._b + o._replace()\n")
    assert private_reads(tree) == {"_b"}
    src = ("class M:\n    def f(self):\n        return self.queue\n"
           "class Own:\n    def __init__(self):\n        self.queue = []\n"
           "    def f(self):\n        return self.queue\n")
    classes = {f"x:{c.name}": ("x", c) for c in ast.parse(src).body}
    saved = dict(CLASSES)
    try:
        CLASSES.clear()
        CLASSES.update(classes)
        assert mixins() == set()        # not in lightcc.common: out of scope
        CLASSES.clear()
        CLASSES.update({k.replace("x:", "lightcc.common.x:"): ("lightcc.common.x", c)
                        for k, (_, c) in classes.items()})
        assert mixins() == {"lightcc.common.x:M"}
    finally:
        CLASSES.clear()
        CLASSES.update(saved)


# ---- the rules ----------------------------------------------------------------------------------
def test_no_mixins_in_common():
    found = mixins()
    assert found <= MIXINS, f"new mixins: {sorted(found - MIXINS)}"
    assert MIXINS <= found, f"no longer mixins, remove from MIXINS: {sorted(MIXINS - found)}"


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(PKG)))
def test_no_module_reads_another_modules_privates(path):
    rel = path.relative_to(PKG).as_posix()
    found = private_reads(_tree(path))
    allowed = PRIVATE_READS.get(rel, set())
    assert found <= allowed, f"{rel} reads private names it does not define: " \
                             f"{sorted(found - allowed)}"
    assert allowed <= found, f"{rel} no longer reads {sorted(allowed - found)}: remove them " \
                             f"from PRIVATE_READS"


def test_the_allow_lists_name_real_files():
    for rel in list(PRIVATE_READS) + list(LONG_FILES):
        assert (PKG / rel).exists(), rel


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(PKG)))
def test_no_file_in_lightcc_over_400_lines(path):
    rel = path.relative_to(PKG).as_posix()
    n = len(path.read_text().splitlines())
    if rel in LONG_FILES:
        assert n > MAX_LINES, f"{rel} has {n} lines now: remove it from LONG_FILES"
    else:
        assert n <= MAX_LINES, f"{rel} has {n} lines"
