"""Compressed allreduce on 2, 3 and 4 ranks against an independent NumPy simulation.

The worker (workers_compression/allreduce_worker.py) checks bitwise equality with the
simulation, identical results on all ranks, wire bytes vs formula, TopK's k and residuals,
PowerSGD factors and residuals, extreme and non-finite inputs, fusion independence.
"""
from pathlib import Path

import pytest

from tests.mpi_harness import run_mpi

WORKERS = Path(__file__).resolve().parent / "workers_compression"
ENV = {"NUMBA_NUM_THREADS": "1"}   # ranks share 2 cores; numba threads would oversubscribe


@pytest.mark.parametrize("np_", [2, 3, 4])
def test_compressed_allreduce_matches_simulation(np_):
    out = run_mpi(np_, [str(WORKERS / "allreduce_worker.py")], env=ENV, timeout=240).stdout
    assert f"checks on {np_} ranks" in out, out[-3000:]
