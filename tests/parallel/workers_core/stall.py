"""A tensor only rank 0 submits: the stall warning names it and the missing ranks; with a
stall shutdown time it fails with StallError, and the engine keeps working.
Run with LCC_STALL_CHECK_TIME=1 LCC_STALL_SHUTDOWN_TIME=3 under mpirun -np N, with
LCC_TEST_EVENTS naming an empty directory shared by the ranks: the other ranks start their
next collective once rank 0 got its StallError (a file there), not after a sleep."""
from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

import lightcc as lcc
from lightcc import StallError

EVENT = Path(os.environ["LCC_TEST_EVENTS"]) / "rank0_stall_error"
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
    EVENT.write_text("")
else:
    # busy elsewhere, never submits 'only.rank0'; a collective submitted before rank 0 gave
    # up would wait as long as 'only.rank0' and could fail with it
    deadline = time.monotonic() + 120.0       # only a hang waits this long
    while not EVENT.exists():
        assert time.monotonic() < deadline, f"rank {R}: rank 0 never got its StallError"
        time.sleep(0.02)
got = lcc.allreduce(np.full(2, float(R)), op=lcc.Sum, name="after.stall")
assert np.allclose(got, sum(range(N))), got
print(f"rank {R}: stall ok", flush=True)
lcc.shutdown()
