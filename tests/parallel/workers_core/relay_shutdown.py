"""A relay of the control tree shuts down early: with LCC_CONTROL_FANOUT=1 (a chain
0 - 1 - 2 - 3) rank 1 calls shutdown() while ranks 0, 2 and 3 go on with a process set
without it. Rank 1 keeps relaying until its child has shut down (the others' collectives work);
a world collective after it left fails with ShutdownError naming it. Prints ``relay ok``."""
from __future__ import annotations

import numpy as np

import lightcc as lcc
from lightcc import ShutdownError

lcc.init()
R, N = lcc.rank(), lcc.size()
ps = lcc.add_process_set([0, 2, 3])
lcc.allreduce(np.ones(2), name="warm")
if R == 1:
    lcc.shutdown()                         # returns once rank 2 (its child) has shut down
    print(f"relay ok {R}", flush=True)
    raise SystemExit(0)
for step in range(5):
    got = lcc.allreduce(np.full(3, R + step, np.float64), op=lcc.Sum, name="ps.t",
                        process_set=ps)
    assert np.allclose(got, sum(r + step for r in (0, 2, 3))), (R, step, got)
try:
    lcc.allreduce(np.ones(2), name="warm")
    raise SystemExit(f"rank {R}: a world allreduce without rank 1 did not fail")
except ShutdownError as exc:
    assert "rank 1" in str(exc), exc
print(f"relay ok {R}", flush=True)
lcc.shutdown()
