"""Every allreduce algorithm against a NumPy reference on real ``mpirun`` jobs.

Each launch runs ``workers_algorithms/check_algorithms.py``: 5 algorithms x 4 ops x 4 dtypes x
sizes {0, 1, 2, 7, 1003} plus ~1M-element buffers, the compressor path and ``auto``, on one
simulated node layout (``local_size`` consecutive ranks per node; uneven layouts included).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.mpi_harness import run_mpi

WORKER = str(Path(__file__).parent / "workers_algorithms" / "check_algorithms.py")

LAYOUTS = [
    (2, 1),  # 2 nodes x 1 rank
    (2, 2),  # 1 node x 2 ranks
    (3, 1),  # 3 nodes x 1 rank (not a power of two)
    (3, 2),  # uneven: 2 + 1
    (4, 2),  # 2 nodes x 2 ranks
    (4, 3),  # uneven: 3 + 1
]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("np_,local_size", LAYOUTS, ids=[f"np{n}-local{l}" for n, l in LAYOUTS])
def test_algorithms_match_numpy(np_: int, local_size: int) -> None:
    out = run_mpi(np_, [WORKER, str(local_size)], timeout=80).stdout
    assert "OK" in out and f"p={np_}" in out, out[-3000:]
