"""The ``lightcc`` torch.distributed backend's allreduce on CUDA tensors through the engine's
device path, with the CuPy / NCCL / torch.cuda doubles (tests/doubles)."""
from __future__ import annotations

import pytest

from tests.mpi_harness import run_mpi

W = "tests/parallel/workers_core/"


@pytest.mark.parametrize("np_,backend", [(1, "nccl"), (2, "mpi")])
def test_c10d_allreduce_of_cuda_tensors_takes_the_device_path(np_, backend):
    """Device requests (not host staging), results in the tensor's own memory, torch's current
    stream waits on the result; one rank over the fake NCCL: no device -> host copy and no
    host synchronization. Checked to fail with host staging and without the stream wait."""
    out = run_mpi(np_, [W + "c10d_device_doubles.py"], env={"LCC_BACKEND": backend},
                  timeout=400).stdout
    assert out.count("ok c10d allreduce on the device path") == np_, out
