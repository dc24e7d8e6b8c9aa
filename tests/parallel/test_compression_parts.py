"""Compressed buckets reduced in the tensors' own memory (no fusion buffer): the path is taken
and the results equal NumPy's computation of the format's sum, over the world (2 ranks, flat)
and over the hosts (3 ranks, each its own simulated host, native's compressed cross phase)."""
from pathlib import Path

import pytest

from tests.mpi_harness import run_mpi

WORKER = Path(__file__).resolve().parent / "workers_compression" / "parts_worker.py"
ENV = {"NUMBA_NUM_THREADS": "1"}


@pytest.mark.parametrize("np_,env", [(2, {}),
                                     (3, {"LCC_LOCAL_SIZE": "1", "LCC_ALGORITHM": "native"})])
def test_unpacked_compressed_buckets(np_, env):
    out = run_mpi(np_, [str(WORKER)], env={**ENV, **env}, timeout=240).stdout
    assert out.count("unpacked compressed buckets ok") == np_, out[-3000:]
