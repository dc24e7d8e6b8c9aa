"""A tensor only rank 0 submits: the stall warning names it and the missing ranks; with a
stall shutdown time it fails with StallError, and the engine keeps working.
Run with LCC_STALL_CHECK_TIME=1 LCC_STALL_SHUTDOWN_TIME=3 under mpirun -np N."""
from __future__ import annotations

import time

import numpy as np

import lightcc as lcc
from lightcc import StallError

lcc.init()
R, N = lcc.rank(), lcc.size()
if R == 0:
    t0 = time.monotonic()
    try:
        lcc.allreduce(np.ones(2), name="only.rank0")
    except StallError as exc:
        assert "only.rank0" in str(exc) and "never by rank" in str(exc), exc
        print(f"rank 0: StallError after {time.monotonic() - t0:.1f} s: {exc}", flush=True)
    else:
        raise AssertionError("no StallError")
else:
    time.sleep(4.0)  # busy elsewhere, never submits 'only.rank0'
got = lcc.allreduce(np.full(2, float(R)), op=lcc.Sum, name="after.stall")
assert np.allclose(got, sum(range(N))), got
print(f"rank {R}: stall ok", flush=True)
lcc.shutdown()
