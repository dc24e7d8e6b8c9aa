"""The README documents every LCC_* variable and starts with the two commands."""
from pathlib import Path

from lightcc.common.config import KNOBS

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def test_every_env_var_is_in_readme():
    missing = [k.env for k in KNOBS if f"`{k.env}`" not in README]
    assert not missing, f"README lacks {missing}"


def test_readme_starts_with_the_two_commands():
    blocks = README.split("```bash")[1:3]
    assert "lccrun -np 2 python examples/mnist.py" in blocks[0]
    assert "pip install -e \".[test]\" && pytest" in blocks[1]


def test_ci_runs_the_readme_test_command():
    ci = (Path(__file__).resolve().parents[2] / ".ci" / "run").read_text()
    command = README.split("```bash")[2].split("```")[0].strip()
    assert command in ci
