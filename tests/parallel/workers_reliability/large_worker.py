"""Tensors above 2**31 elements *and* bytes through every collective (mpirun -np 2).

int8 / uint8 of 2**31 + 3 elements (2.1 GB each). Peak memory per rank is about 3 such
buffers (input, result, the NumPy check), ~6.5 GB, so ~13 GB for the job. Prints timings and
``large ok`` per rank.
"""
from __future__ import annotations

import resource
import time

import numpy as np

import lightcc as lcc

N_EL = (1 << 31) + 3
lcc.init()
R, N = lcc.rank(), lcc.size()
assert N == 2, "run on 2 ranks"
times = {}


def mark(name: str, t0: float) -> None:
    times[name] = time.monotonic() - t0


# allreduce (sum, int8): the values stay small so int8 does not overflow
x = np.empty(N_EL, np.int8)
x[:] = 1 + R
x[-1] = 5 * (R + 1)
t0 = time.monotonic()
got = lcc.allreduce(x, op=lcc.Sum, name="big.ar")
mark("allreduce", t0)
assert got.size == N_EL and got[0] == 3 and got[N_EL // 2] == 3 and got[-1] == 15, got[-3:]
assert int(np.count_nonzero(got != 3)) == 1
del got
# broadcast from rank 1 (in place)
t0 = time.monotonic()
lcc.broadcast_async(x, 1, name="big.bc", out=x).wait()
mark("broadcast", t0)
assert x[0] == 2 and x[-1] == 10 and int(np.count_nonzero(x != 2)) == 1
del x
# allgather: each rank contributes 2**30 + 2 bytes, 2**31 + 4 in total
half = np.full((1 << 30) + 2, R + 7, np.uint8)
t0 = time.monotonic()
g = lcc.allgather(half, name="big.ag")
mark("allgather", t0)
assert g.size == 2 * half.size and g[0] == 7 and g[half.size - 1] == 7 and g[half.size] == 8 \
    and g[-1] == 8
del g
# alltoall: every rank sends half of a 2**31 + 4 byte buffer to each rank
src = np.empty(2 * half.size, np.uint8)
src[:half.size] = 10 * R
src[half.size:] = 10 * R + 1
t0 = time.monotonic()
a2a = lcc.alltoall(src, name="big.a2a")
mark("alltoall", t0)
assert a2a[0] == R and a2a[half.size - 1] == R and a2a[half.size] == 10 + R and a2a[-1] == 10 + R
del a2a
# reducescatter (sum, uint8): 2**31 + 4 elements, each rank keeps half
t0 = time.monotonic()
rs = lcc.reducescatter(src, op=lcc.Sum, name="big.rs")
mark("reducescatter", t0)
assert rs.size == half.size and int(rs[0]) == (0 + 10 + 2 * R) and int(rs[-1]) == 10 + 2 * R
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 / 1024
print(f"rank {R}: large ok; seconds {times}; peak RSS {peak:.2f} GiB", flush=True)
lcc.shutdown()
