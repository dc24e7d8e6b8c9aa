"""lightcc.torch on real ``mpirun -np 2`` jobs: collectives, autograd, errors, optimizer.

Launches that run many checks against references every rank computes itself from
seeded per-rank inputs (see workers_torch/). A failing check aborts the whole job, so the test
fails with the rank, the case and the difference.
"""
from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")

from tests.mpi_harness import run_mpi  # noqa: E402

W = Path(__file__).parent / "workers_torch"


@pytest.mark.timeout(120)
def test_collectives_autograd_errors_join_process_sets(tmp_path):
    out = run_mpi(2, [str(W / "check_ops.py")], env={"LCC_TEST_TMP": str(tmp_path)},
                  timeout=110).stdout
    assert out.count("OK 16 cases") == 2, out[-4000:]


@pytest.mark.timeout(120)
def test_distributed_optimizer_broadcasts_and_sync_batch_norm(tmp_path):
    out = run_mpi(2, [str(W / "check_train.py")], env={"LCC_TEST_TMP": str(tmp_path)},
                  timeout=110).stdout
    assert out.count("OK 15 cases") == 2, out[-4000:]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("overlap", ["0", "1"], ids=["lazy", "background"])
def test_poll_reports_readiness_without_waiting(overlap):
    """Issue 25 item 5: in lazy mode poll() executed the collective on the calling thread
    (waiting for the other ranks), so Horovod's test_horovod_reducescatter_async_fused saw
    it always True."""
    out = run_mpi(2, [str(W / "check_poll.py")], env={"LCC_OVERLAP": overlap},
                  timeout=140).stdout
    assert out.count("OK 3 cases") == 2, out[-4000:]
