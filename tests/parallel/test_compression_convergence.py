"""Issue 7 item 6: an MLP on scikit-learn's digits, 2 ranks, each compressor vs none.

Bars (accuracy drop vs uncompressed, points): fp16/bf16/fp8 0.5, TopK 1 % + EF 1.5,
PowerSGD r=2 1.0. The worker drives each compressor over an MPICommunicator.
"""
from pathlib import Path

import pytest

from tests.mpi_harness import run_mpi

WORKER = Path(__file__).resolve().parent / "workers_compression" / "convergence_worker.py"


def test_convergence_within_bars():
    pytest.importorskip("sklearn")
    out = run_mpi(2, [str(WORKER)], env={"NUMBA_NUM_THREADS": "1"}, timeout=240).stdout
    assert "OK convergence" in out, out[-3000:]
