"""MPICommunicator.allreduce_init (the direct path's persistent requests), and its fallback for
MPI libraries without MPI-4 persistent collectives: restarted several times on changing
contents, checked against NumPy."""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

from lightcc.common.backends.mpi import MPICommunicator, _Persistent, _Restartable


class _MPI3Comm:
    """A communicator of an MPI library older than MPI-4 (no MPI_Allreduce_init)."""

    def __init__(self, comm):
        self._comm = comm

    def Allreduce_init(self, *args, **kwargs):
        raise NotImplementedError("MPI_Allreduce_init")

    def __getattr__(self, name):
        return getattr(self._comm, name)


world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()
for label, raw, kind in (("persistent", world.Dup(), _Persistent),
                         ("fallback", _MPI3Comm(world.Dup()), _Restartable)):
    comm = MPICommunicator(raw, label)
    buf = np.zeros(7, np.float64)
    out = np.zeros(7, np.float64)
    flags = np.zeros(3, np.uint8)
    summed = comm.allreduce_init(buf, None, "sum")       # in place
    maxed = comm.allreduce_init(buf, out, "max")         # into out
    anded = comm.allreduce_init(flags, None, "max")
    assert isinstance(summed, kind) and isinstance(maxed, kind), (label, type(summed))
    for step in range(4):
        contrib = [np.arange(7) * (r + 1) - 3 * step + r for r in range(size)]
        buf[:] = contrib[rank]
        maxed.start()
        maxed.wait()
        np.testing.assert_array_equal(out, np.max(contrib, axis=0))
        summed.start()
        while not summed.test():
            pass
        np.testing.assert_array_equal(buf, np.sum(contrib, axis=0))
        flags[:] = [rank == step % size, 0, 1]
        anded.start()
        anded.wait()
        np.testing.assert_array_equal(flags, [1, 0, 1])
    for req in (summed, maxed, anded):
        req.free()
    raw.Free()
    print(f"[rank {rank}] OK {label}", flush=True)

# the direct path keeps 64 payload shapes with a persistent request: 150 shapes, then the first
# ones again (created anew after the cache was emptied at the same call on every rank)
import lightcc.common.api as lcc  # noqa: E402

lcc.init()
path = lcc.engine().groups[0].direct
for n in [*range(1, 151), *range(1, 11)]:
    x = (np.arange(n, dtype=np.float32) + rank * 0.5) * (1 + n % 3)
    got = lcc.allreduce(x, op=lcc.Sum)
    want = sum((np.arange(n, dtype=np.float32) + r * 0.5) * (1 + n % 3) for r in range(size))
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert got is not x and not np.shares_memory(got, x)
assert path.reduced == 160 and len(path._payloads) <= 64, (path.reduced, len(path._payloads))
lcc.shutdown()
print(f"[rank {rank}] OK shapes", flush=True)
