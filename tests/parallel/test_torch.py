"""lightcc.torch on real ``mpirun -np 2`` jobs: collectives, autograd, errors, optimizer.

One launch that runs many checks against references every rank computes itself from
seeded per-rank inputs (see workers_torch/). A failing check aborts the whole job, so the test
fails with the rank, the case and the difference.
"""
from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")

from tests.mpi_harness import Cases  # noqa: E402

W = Path(__file__).parent / "workers_torch"
pytestmark = pytest.mark.timeout(600)        # the first test runs the job


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Cases:
    """The four workers as cases of one ``mpirun -np 2`` job (workers_core/cases.py), each
    with a folder of its own for the files its ranks signal each other with."""
    base = tmp_path_factory.mktemp("torch_cases")
    c = Cases(base, timeout=540)
    for name in ("check_ops", "check_train"):
        (base / name).mkdir()
        c.add(2, name, str(W / f"{name}.py"), env={"LCC_TEST_TMP": str(base / name)})
    for overlap in ("0", "1"):
        c.add(2, f"poll-{overlap}", str(W / "check_poll.py"), env={"LCC_OVERLAP": overlap})
    return c


def test_collectives_autograd_errors_join_process_sets(job):
    out = job.output(2, "check_ops")
    assert out.count("OK 16 cases") == 2, out[-4000:]


def test_distributed_optimizer_broadcasts_and_sync_batch_norm(job):
    out = job.output(2, "check_train")
    assert out.count("OK 16 cases") == 2, out[-4000:]


@pytest.mark.parametrize("overlap", ["0", "1"], ids=["lazy", "background"])
def test_poll_reports_readiness_without_waiting(job, overlap):
    """Issue 25 item 5: in lazy mode poll() executed the collective on the calling thread
    (waiting for the other ranks), so Horovod's test_horovod_reducescatter_async_fused saw
    it always True."""
    out = job.output(2, f"poll-{overlap}")
    assert out.count("OK 3 cases") == 2, out[-4000:]
