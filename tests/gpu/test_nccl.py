"""The NCCL communicator on one GPU (size-1 communicators run the full code path). Needs a GPU.

NCCL refuses two ranks on one GPU, so multi-rank NCCL is left to machines with several GPUs:
``mpirun -np 2 python -m pytest tests/gpu/test_nccl.py`` there runs the same checks with
real peers (each rank uses device ``rank % device_count``).
"""
from __future__ import annotations

import numpy as np
import pytest

from .gpu_common import require_gpu

pytestmark = pytest.mark.gpu
cupy = require_gpu()
MPI = pytest.importorskip("mpi4py.MPI", reason="NCCL bootstrap needs mpi4py")

from lightcc.common.arrays import even_counts  # noqa: E402
from lightcc.common.backends.nccl import NCCLCommunicator, nccl_available  # noqa: E402


@pytest.fixture(scope="module")
def comm():
    if not nccl_available():
        pytest.skip("CuPy has no NCCL (pip install nvidia-nccl-cu13)")
    world = MPI.COMM_WORLD
    cupy.cuda.Device(world.Get_rank() % cupy.cuda.runtime.getDeviceCount()).use()
    c = NCCLCommunicator(world.Dup(), "world", timeout=60.0)
    yield c
    c.free()


def test_allreduce_ops(comm):
    p, r = comm.size, comm.rank
    for dtype in (np.float32, np.float16, np.float64, np.int32, np.int64):
        buf = cupy.full(1000, r + 1, dtype)
        comm.allreduce(buf, "sum")
        assert (buf.get() == sum(range(1, p + 1))).all(), dtype
    buf = cupy.full(7, r, np.float32)
    comm.allreduce(buf, "max")
    assert (buf.get() == p - 1).all()


def test_allgatherv_and_reduce_scatterv(comm):
    p, r = comm.size, comm.rank
    for counts in ([5] * p, [r2 + 1 for r2 in range(p)]):
        send = cupy.full(counts[r], r, np.float32)
        recv = cupy.empty(sum(counts), np.float32)
        comm.allgatherv(send, recv, counts)
        want = np.concatenate([np.full(c, r2, np.float32) for r2, c in enumerate(counts)])
        np.testing.assert_array_equal(recv.get(), want)
        total = sum(counts)
        send = cupy.arange(total, dtype=np.float32)
        out = cupy.empty(counts[r], np.float32)
        comm.reduce_scatterv(send, out, counts)
        start = sum(counts[:r])
        np.testing.assert_array_equal(out.get(), p * np.arange(start, start + counts[r]))


def test_alltoallv_bcast_p2p_barrier(comm):
    p, r = comm.size, comm.rank
    counts = even_counts(3 * p + 1, p)
    send = cupy.arange(sum(counts), dtype=np.uint8)
    recv = cupy.empty(counts[r] * p, np.uint8)
    comm.alltoallv(send, counts, recv, [counts[r]] * p)
    start = sum(counts[:r])
    np.testing.assert_array_equal(recv.get(), np.tile(np.arange(start, start + counts[r]), p))
    buf = cupy.full(33, r, np.int64)
    comm.bcast(buf, root=p - 1)
    assert (buf.get() == p - 1).all()
    out = cupy.full(4, r, np.float32)
    inc = cupy.empty(4, np.float32)
    right, left = (r + 1) % p, (r - 1) % p
    reqs = [comm.isend(out, right), comm.irecv(inc, left)]
    for q in reqs:
        q.wait()
    assert (inc.get() == left).all()
    comm.barrier()


def test_split_and_stream_ordering(comm):
    sub = comm.split(comm.rank % 2, comm.rank, "half")
    try:
        x = cupy.ones(1 << 20, np.float32)
        x *= 2                                   # queued on the current stream before the call
        sub.allreduce(x)
        assert float(x[0]) == 2 * sub.size and float(x[-1]) == 2 * sub.size
    finally:
        sub.free()


def test_nonblocking_mode_orders_consumer_stream(comm):
    c = NCCLCommunicator(comm.mpi.Dup(), "nb", blocking=False)
    try:
        x = cupy.ones(1 << 22, np.float32)
        c.allreduce(x)
        y = x * 1                                # runs after the allreduce on the current stream
        c.synchronize()
        assert float(y[-1]) == c.size
    finally:
        c.free()
