"""Allreduce through the same-host shared-memory path of the MPI-free plane (backends/shm.py):
sum/min/max over several dtypes and sizes (below, inside and across the segment's chunk size),
checked against NumPy's reduction of every rank's input, plus the segment's name gone from
/dev/shm once mapped. ``SHM_KILL=1``: rank 1 kills itself (SIGKILL) after the checks;
``SHM_KILL=mid``: inside the first barrier of a segment allreduce. ``SHM_HOST``: the host name this rank reports. ``SHM_LINK_BARRIER=1``: the
barriers other architectures use (one-byte link messages) instead of x86's flag words."""
import os
import signal
import socket

import numpy as np

import lightcc as lcc
from lightcc.common.backends import shm, tcpcomm
from lightcc.common.backends.shm import CHUNK_BYTES

if os.environ.get("SHM_HOST"):                  # this rank claims to run on another host
    socket.gethostname = lambda: os.environ["SHM_HOST"]
if os.environ.get("SHM_LINK_BARRIER"):
    tcpcomm.FLAG_BARRIER = False

lcc.init()
rank, size = lcc.rank(), lcc.size()
if os.environ.get("SHM_KILL") == "mid" and rank == 1:
    shm.Segment.barrier = lambda self, check: os.kill(os.getpid(), signal.SIGKILL)
UFUNC = {"sum": np.add, "min": np.minimum, "max": np.maximum}
CASES = [("float32", "sum", 1000), ("float32", "sum", 20_011),
         ("float32", "sum", 2 * CHUNK_BYTES // 4 + 7), ("float64", "sum", CHUNK_BYTES // 8 + 3),
         ("int32", "min", CHUNK_BYTES // 4 + 5), ("int64", "max", 3 * CHUNK_BYTES // 8 + 1),
         ("float16", "max", CHUNK_BYTES + 9), ("uint8", "max", 2 * CHUNK_BYTES + 1),
         ("float32", "min", 5 * CHUNK_BYTES // 4 - 1)]


def data(r, case, dtype, n):
    rng = np.random.default_rng(1000 * case + r)
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal(n).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(max(info.min, -1000), min(info.max, 1000), n, endpoint=True).astype(dtype)


for i, (dtype, op, n) in enumerate(CASES):
    every = [data(r, i, dtype, n) for r in range(size)]
    want = every[0].copy()
    for r in range(1, size):
        UFUNC[op](want, every[r], out=want)            # rank order, as one rank reduces
    got = every[rank].copy()
    lcc.allreduce(got, op=op, name=f"case{i}", out=got)
    if op == "sum" and np.dtype(dtype).kind == "f":
        assert np.allclose(got, want, rtol=1e-5, atol=1e-5), (dtype, op, n)
    else:
        assert np.array_equal(got, want), (dtype, op, n, np.flatnonzero(got != want)[:5])
for name in os.listdir("/dev/shm"):
    if name.startswith("lightcc-"):
        st = os.stat(os.path.join("/dev/shm", name))
        assert st.st_uid != os.getuid() or st.st_mode & 0o077 == 0, oct(st.st_mode)
print(f"shm checks passed rank {rank}", flush=True)
if os.environ.get("SHM_KILL") == "1" and rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
lcc.shutdown()
