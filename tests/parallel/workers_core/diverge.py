"""Ranks that diverge: rank 1 leaves the training loop early (as after a caught exception) and
waits in a barrier, rank 0 still waits in the loop's allreduce. With a short
LCC_STALL_SHUTDOWN_TIME both get a StallError naming the collective, who submitted it and what
the other rank waits in instead; neither hangs. Prints ``diverge ok`` per rank."""
from __future__ import annotations

import numpy as np

import lightcc as lcc
from lightcc.common.exceptions import StallError

lcc.init()
r = lcc.rank()
steps = 2 if r == 1 else 5
try:
    for step in range(steps):
        lcc.allreduce(np.ones(4, np.float32), name="grad")
    lcc.barrier()                       # rank 1 gets here; rank 0 is still in the loop
    raise SystemExit(f"rank {r}: no StallError")
except StallError as exc:
    text = str(exc)
    print(f"rank {r} StallError: {text}", flush=True)
    if r == 0:
        assert "allreduce 'grad'" in text and "submitted by rank 0, never by rank 1" in text, text
        assert "rank 1 waits in barrier" in text, text
    else:
        assert "barrier" in text and "submitted by rank 1, never by rank 0" in text, text
        assert "rank 0 waits in allreduce 'grad'" in text, text
# the collectives fail one after the other: a rank that shut down at once would fail the
# other's, still waiting, with ShutdownError instead of its StallError (seen at load 15)
from mpi4py import MPI  # noqa: E402

MPI.COMM_WORLD.Barrier()
print(f"diverge ok {r}", flush=True)
lcc.shutdown()
