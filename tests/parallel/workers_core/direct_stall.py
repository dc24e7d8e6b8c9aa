"""Failures on the direct path (blocking unnamed small allreduces) end in errors, never hangs.
Run with LCC_STALL_CHECK_TIME=1 LCC_STALL_SHUTDOWN_TIME=2 under mpirun -np N (N >= 3).

1. Rank 0 calls; the others are busy for 3.5 s: rank 0 warns, then fails with StallError, and
   its direct path stays closed. The others' late call meets the call rank 0 gave up on (a
   posted collective cannot be withdrawn) and fails with StallError too, after the same stall
   limit. The engine keeps working for everyone.
2. On a process set of the other ranks, rank N-1 shuts lightcc down while rank 1 waits in a
   direct call: rank 1 fails with ShutdownError well before the stall limit.
Prints ``direct stall ok`` per rank."""
from __future__ import annotations

import time

import numpy as np

import lightcc as lcc
from lightcc import ShutdownError, StallError

lcc.init()
R, N = lcc.rank(), lcc.size()
assert N >= 3
t0 = time.monotonic()
if R == 0:
    try:
        lcc.allreduce(np.ones(2))
        raise SystemExit("no StallError on rank 0")
    except StallError as exc:
        assert "unnamed allreduce #1" in str(exc) and "never made its matching call" in str(exc)
        print(f"rank 0: StallError after {time.monotonic() - t0:.1f} s: {exc}", flush=True)
    try:
        lcc.allreduce(np.ones(2))
        raise SystemExit("the closed direct path took a call")
    except StallError as exc:
        assert "closed by an earlier error" in str(exc), exc
    time.sleep(4.0)   # the others' late call fails after its own stall limit
else:
    time.sleep(3.5)   # busy elsewhere
    try:
        lcc.allreduce(np.ones(2))
        raise SystemExit(f"no StallError on rank {R}")
    except StallError as exc:
        assert "gave up on it" in str(exc), exc
        print(f"rank {R}: StallError: {exc}", flush=True)
got = lcc.allreduce(np.full(2, float(R)), op=lcc.Sum, name="after.stall")
assert np.allclose(got, sum(range(N))), got

ps = lcc.add_process_set(list(range(1, N)))
if R == N - 1:
    time.sleep(0.5)
    lcc.shutdown()
elif R >= 1:
    t1 = time.monotonic()
    try:
        lcc.allreduce(np.ones(2), process_set=ps)
        raise SystemExit("no ShutdownError")
    except ShutdownError as exc:
        took = time.monotonic() - t1
        print(f"rank {R}: ShutdownError after {took:.1f} s: {exc}", flush=True)
else:
    time.sleep(3.0)   # the coordinator stays up: rank 1 must learn of rank N-1 itself
print(f"rank {R}: direct stall ok", flush=True)
lcc.shutdown()
