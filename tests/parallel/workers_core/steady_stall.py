"""Ranks that diverge in the steady state: the last rank leaves the loop early and waits in a
barrier while the others wait in the loop's allreduce, already cached (agreed in the control
tree's bit vectors, where no single rank sees who is missing). The tree reports the stuck
allreduce rank by rank, so with LCC_STALL_CHECK_TIME=1 LCC_STALL_SHUTDOWN_TIME=3 rank 0 warns
and every rank gets a StallError naming the collective, who submitted it, who did not and
what those wait in instead. Prints ``steady stall ok`` per rank."""
from __future__ import annotations

import numpy as np

import lightcc as lcc
from lightcc.common.exceptions import StallError

lcc.init()
R, N = lcc.rank(), lcc.size()
last = N - 1
others = list(range(last))
steps = 3 if R == last else 6
try:
    for step in range(steps):
        got = lcc.allreduce(np.full(4, R + 1.0, np.float32), op=lcc.Sum, name="grad")
        assert np.allclose(got, N * (N + 1) / 2), got
    lcc.barrier()                 # the last rank gets here; the others wait in step 3's 'grad'
    raise SystemExit(f"rank {R}: no StallError")
except StallError as exc:
    text = str(exc)
    print(f"rank {R} StallError: {text}", flush=True)
    who = f"rank {others[0]}" if len(others) == 1 else f"ranks {others}"
    if R != last:
        assert "allreduce 'grad'" in text, text
        assert f"submitted by {who}, never by rank {last}" in text, text
        assert f"rank {last} waits in barrier" in text, text
    else:
        assert "barrier" in text and f"submitted by rank {last}, never by {who}" in text, text
        assert "rank 0 waits in allreduce 'grad'" in text, text
# the collectives fail one after the other: a rank that shut down at once would fail the
# other's, still waiting, with ShutdownError instead of its StallError (seen at load 15)
from mpi4py import MPI  # noqa: E402

MPI.COMM_WORLD.Barrier()
print(f"steady stall ok {R}", flush=True)
lcc.shutdown()
