"""Open MPI's ``btl_tcp_links`` under plain mpirun (issue 25 item 6).

lightcc puts ``OMPI_MCA_btl_tcp_links`` = ``LCC_NUM_LINKS`` into the environment when it is
imported before MPI starts; when the script started MPI first (``from mpi4py import MPI``
before ``import lightcc``) it is too late, and ``init()`` says so once, on rank 0, with the fix,
for jobs that span several hosts (simulated here with ``LCC_LOCAL_SIZE=1``: two nodes).
"""
from __future__ import annotations

import pytest

from tests.mpi_harness import run_mpi

WARNING = "MPI was started before lightcc could configure it"
FIX = "'mpirun --mca btl_tcp_links 2'"
TWO_NODES = {"LCC_LOCAL_SIZE": "1"}



@pytest.fixture(autouse=True)
def _no_links_variable(monkeypatch):
    """The ranks inherit this process's environment, where an earlier ``import lightcc`` (any
    test in this session) has put the variable already."""
    monkeypatch.delenv("OMPI_MCA_btl_tcp_links", raising=False)

MPI_FIRST = """
import os
from mpi4py import MPI
import lightcc
lightcc.init()
assert lightcc.allreduce(__import__("numpy").ones(2), op=lightcc.Sum).tolist() == [2.0, 2.0]
lightcc.shutdown()
lightcc.init()                  # a second init() does not repeat the warning
print("seen:", MPI.COMM_WORLD.Get_rank(), os.environ.get("OMPI_MCA_btl_tcp_links"), flush=True)
"""

LIGHTCC_FIRST = """
import os
import lightcc
seen = os.environ.get("OMPI_MCA_btl_tcp_links")     # before MPI starts: Open MPI reads it
from mpi4py import MPI
lightcc.init()
print("seen:", MPI.COMM_WORLD.Get_rank(), seen, flush=True)
"""


@pytest.mark.timeout(120)
def test_mpi_started_first_warns_once_with_the_fix():
    out = run_mpi(2, ["-c", MPI_FIRST], env=TWO_NODES, timeout=110).stdout
    assert out.count(WARNING) == 1, out[-3000:]
    assert FIX in out and "import lightcc before mpi4py" in out, out[-3000:]
    assert out.count("seen:") == 2 and "seen: 0 None" in out, out[-3000:]


@pytest.mark.timeout(120)
def test_lightcc_imported_first_sets_the_links_before_mpi_starts():
    out = run_mpi(2, ["-c", LIGHTCC_FIRST], env={**TWO_NODES, "LCC_NUM_LINKS": "3"},
                  timeout=110).stdout
    assert "seen: 0 3" in out and "seen: 1 3" in out, out[-3000:]
    assert WARNING not in out, out[-3000:]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("env", [
    pytest.param({**TWO_NODES, "OMPI_MCA_btl_tcp_links": "2"}, id="mpirun-mca-given"),
    pytest.param({}, id="one-host"),
    pytest.param({**TWO_NODES, "LCC_NUM_LINKS": "1"}, id="one-link-wanted"),
])
def test_no_warning_when_nothing_is_lost(env):
    out = run_mpi(2, ["-c", MPI_FIRST], env=env, timeout=110).stdout
    assert out.count("seen:") == 2 and WARNING not in out, out[-3000:]


@pytest.mark.timeout(150)
def test_torch_backend_started_after_mpi_warns():
    pytest.importorskip("torch")
    script = ("from mpi4py import MPI\nimport lightcc.torch\nimport torch.distributed as dist\n"
              "dist.init_process_group('lightcc')\nprint('ok', dist.get_rank(), flush=True)\n"
              "dist.destroy_process_group()\n")
    out = run_mpi(2, ["-c", script], env=TWO_NODES, timeout=140).stdout
    assert out.count(WARNING) == 1 and "ok 0" in out and "ok 1" in out, out[-3000:]
