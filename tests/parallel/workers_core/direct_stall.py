"""Failures on the direct path (blocking unnamed small allreduces) end in errors, never hangs.
Run with LCC_STALL_CHECK_TIME=1 LCC_STALL_SHUTDOWN_TIME=2 under mpirun -np N (N >= 3), with
LCC_TEST_EVENTS naming an empty directory shared by the ranks.

1. Rank 0 calls; the others are busy until rank 0 has failed: rank 0 warns, then fails with
   StallError, and its direct path stays closed. The others' late call meets the call rank 0
   gave up on (a posted collective cannot be withdrawn) and fails with StallError too, after
   the same stall limit. The engine keeps working for everyone.
2. On a process set of the other ranks (after a re-init with a 60 s stall limit), rank N-1
   shuts lightcc down while rank 1 waits in a direct call: rank 1 fails with ShutdownError,
   not StallError.

The ranks order these steps with files in LCC_TEST_EVENTS (``signal`` / ``wait_for``), not
with sleeps, so a loaded machine that delays a rank changes no outcome. Prints
``direct stall ok`` per rank."""
from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

import lightcc as lcc
from lightcc import ShutdownError, StallError

EVENTS = Path(os.environ["LCC_TEST_EVENTS"])
EVENT_TIMEOUT_S = 120.0    # only a hang waits this long; nothing is timed


def signal(name: str) -> None:
    (EVENTS / name).write_text("")


def wait_for(name: str) -> None:
    """Sleep until another rank signalled ``name`` (no core taken from the ranks that work)."""
    deadline = time.monotonic() + EVENT_TIMEOUT_S
    while not (EVENTS / name).exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"rank {R}: no event {name!r} after {EVENT_TIMEOUT_S:.0f} s")
        time.sleep(0.05)


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
    signal("rank0-gave-up")
    for r in range(1, N):          # the others' late call fails after its own stall limit
        wait_for(f"rank{r}-stalled")
else:
    wait_for("rank0-gave-up")      # busy elsewhere until rank 0 has given up
    try:
        lcc.allreduce(np.ones(2))
        raise SystemExit(f"no StallError on rank {R}")
    except StallError as exc:
        assert "gave up on it" in str(exc), exc
        print(f"rank {R}: StallError: {exc}", flush=True)
    signal(f"rank{R}-stalled")
    for r in range(1, N):          # all submit the next call together: its stall limit is 2 s
        wait_for(f"rank{r}-stalled")
got = lcc.allreduce(np.full(2, float(R)), op=lcc.Sum, name="after.stall")
assert np.allclose(got, sum(range(N))), got

# part 2 under a stall limit far above any delay of a loaded machine: only the shutdown can end
# rank 1's call in time
lcc.shutdown()
lcc.init(stall_shutdown_time=60.0)
ps = lcc.add_process_set(list(range(1, N)))
if R == N - 1:
    for r in range(1, N - 1):
        wait_for(f"rank{r}-calling")
    time.sleep(0.5)                # most likely they wait inside the call now (either way works)
    lcc.shutdown()
elif R >= 1:
    t1 = time.monotonic()
    signal(f"rank{R}-calling")
    try:
        lcc.allreduce(np.ones(2), process_set=ps)
        raise SystemExit("no ShutdownError")
    except ShutdownError as exc:
        took = time.monotonic() - t1
        print(f"rank {R}: ShutdownError after {took:.1f} s: {exc}", flush=True)
    signal(f"rank{R}-done")
else:
    for r in range(1, N - 1):      # the coordinator stays up: rank 1 must learn of rank N-1 itself
        wait_for(f"rank{r}-done")
print(f"rank {R}: direct stall ok", flush=True)
lcc.shutdown()
