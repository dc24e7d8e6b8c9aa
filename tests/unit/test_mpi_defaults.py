"""``init()`` gives Open MPI ``btl_tcp_links = LCC_NUM_LINKS`` when it starts MPI itself.

Each case runs in a fresh interpreter (a singleton MPI job): whether MPI was already started
is process state."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import os, sys
if sys.argv[1] == "mpi-first":
    from mpi4py import MPI
import lightcc.common.api as api
api.init()
print("LINKS", os.environ.get("OMPI_MCA_btl_tcp_links", "unset"))
api.shutdown()
"""


def _links(mode: str, **env: str) -> str:
    full = {k: v for k, v in os.environ.items()
            if k not in ("OMPI_MCA_btl_tcp_links", "LCC_NUM_LINKS")}
    full.update(env)
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True,
                         timeout=120, cwd=REPO, env=full)
    assert out.returncode == 0, out.stdout + out.stderr
    return [line for line in out.stdout.splitlines() if line.startswith("LINKS")][-1].split()[1]


@pytest.mark.parametrize("env,want", [({}, "2"), ({"LCC_NUM_LINKS": "3"}, "3"),
                                      ({"OMPI_MCA_btl_tcp_links": "5"}, "5"),
                                      ({"LCC_NUM_LINKS": "3", "OMPI_MCA_btl_tcp_links": "1"}, "1")])
def test_init_sets_tcp_links_unless_given(env, want):
    assert _links("lightcc-first", **env) == want


def test_mpi_started_before_init_is_left_alone():
    assert _links("mpi-first") == "unset"
