"""The README documents every LCC_* variable and starts with the two commands; they install the
pinned versions that CI tests, and the pins stay inside setup.py's ranges."""
import re
import runpy
from pathlib import Path

import pytest

from lightcc.common.config import KNOBS

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
CONSTRAINTS = REPO / ".ci" / "constraints.txt"


def test_every_env_var_is_in_readme():
    missing = [k.env for k in KNOBS if f"`{k.env}`" not in README]
    assert not missing, f"README lacks {missing}"


def test_readme_starts_with_the_two_commands():
    blocks = README.split("```bash")[1:3]
    assert "lccrun -np 2 python examples/mnist.py" in blocks[0]
    assert "pip install -e \".[test]\" && pytest" in blocks[1]
    for block in blocks:       # both install what CI tests, the build backend included
        assert "PIP_CONSTRAINT=.ci/constraints.txt pip install -e" in block, block


def test_ci_runs_the_readme_test_command():
    ci = (Path(__file__).resolve().parents[2] / ".ci" / "run").read_text()
    command = README.split("```bash")[2].split("```")[0].strip()
    assert command in ci


def _setup_kwargs() -> dict:
    """The keyword arguments setup.py passes to setuptools.setup (nothing is built)."""
    import setuptools

    seen: dict = {}
    real = setuptools.setup
    setuptools.setup = lambda **kw: seen.update(kw)
    try:
        runpy.run_path(str(REPO / "setup.py"))
    finally:
        setuptools.setup = real
    return seen


def _pins() -> dict[str, str]:
    pins = {}
    for line in CONSTRAINTS.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version.strip()
    return pins


def test_constraints_pin_every_requirement_inside_its_range():
    """Every package setup.py asks for (install_requires, the torch/test/autotune/dev extras)
    and the build backend has one exact version in .ci/constraints.txt, and that version is
    inside setup.py's range (a range moved past the pin fails here, not in CI's resolver)."""
    requirements = pytest.importorskip("packaging.requirements")
    kw = _setup_kwargs()
    pins = _pins()
    wanted = list(kw["install_requires"]) + ["setuptools>=64", "wheel"]
    for extra in ("torch", "test", "autotune", "dev"):
        wanted += kw["extras_require"][extra]
    for text in wanted:
        req = requirements.Requirement(text)
        if req.marker is not None and not req.marker.evaluate():
            continue
        name = re.sub(r"[-_.]+", "-", req.name).lower()
        assert name in pins, f"{req.name} is not pinned in {CONSTRAINTS.name}"
        assert req.specifier.contains(pins[name], prereleases=True), \
            f"{req.name}=={pins[name]} in {CONSTRAINTS.name} is outside setup.py's {req}"


def test_torch_is_a_range_that_contains_the_pinned_torch():
    kw = _setup_kwargs()
    torch = [r for r in kw["extras_require"]["torch"] if r.startswith("torch")]
    assert torch and "==" not in torch[0] and ">=" in torch[0], torch
    assert all(torch[0] in kw["extras_require"][e] for e in ("test", "dev")), kw["extras_require"]
    assert f"`{torch[0]}`" in README


def test_ci_has_a_latest_mode_and_the_torch_script_lists_every_torch_test():
    ci = (REPO / ".ci" / "run").read_text()
    assert "--latest" in ci and "--latest" in README
    script = (REPO / ".ci" / "torch-version").read_text()
    listed = set(re.findall(r"^\s+(tests/\S+\.py)$", script, re.M))
    uses_torch = set()
    for path in (REPO / "tests").rglob("test_*.py"):
        rel = path.relative_to(REPO).as_posix()
        text = path.read_text()
        if rel.startswith("tests/gpu/") or path == Path(__file__).resolve():
            continue                  # tests/gpu needs a GPU: python -m lightcc.gpucheck
        if re.search(r"^\s*(import|from) torch\b|importorskip\(\"torch\"|workers_torch/|"
                     r"examples/(ddp_|mnist|horovod)", text, re.M):
            uses_torch.add(rel)
    assert listed and all((REPO / t).exists() for t in listed), listed
    assert uses_torch <= listed, f"torch tests missing from .ci/torch-version: {uses_torch - listed}"
