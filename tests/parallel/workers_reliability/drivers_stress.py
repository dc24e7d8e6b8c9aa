"""Many user threads driving the engine at once (issue: a lost update of the driver count could
leave the background thread idle for good). T threads per rank each run S blocking allreduces
under their own names, then one async allreduce is left for the background thread alone: it
must still complete, and the driver count must be back at 0. Prints ``drivers ok``."""
from __future__ import annotations

import os
import threading
import time

import numpy as np

import lightcc as lcc
from lightcc.common import api

T = int(os.environ.get("LCC_TEST_THREADS", "16"))
S = int(os.environ.get("LCC_TEST_STEPS", "60"))

lcc.init()
R, N = lcc.rank(), lcc.size()
errors: list = []


def body(tid: int) -> None:
    try:
        for step in range(S):
            got = lcc.allreduce(np.full(3, R + tid, np.int64), op=lcc.Sum, name=f"s{tid}.{step}")
            assert np.all(got == sum(range(N)) + N * tid), (tid, step, got)
    except BaseException as exc:
        errors.append((tid, repr(exc)))


threads = [threading.Thread(target=body, args=(t,)) for t in range(T)]
for t in threads:
    t.start()
for t in threads:
    t.join(120)
    assert not t.is_alive(), "a driver thread hung"
assert not errors, errors
eng = api.engine()
assert eng._drivers == 0, f"driver count drifted to {eng._drivers}"
h = lcc.allreduce_async(np.ones(2), op=lcc.Sum, name="background")
while not lcc.poll(h):               # nobody drives: the background thread must do it
    time.sleep(0.01)                 # (no deadline: an idle background thread is a hang,
                                     # which run_mpi's timeout reports)
assert np.all(lcc.synchronize(h) == N)
print(f"drivers ok {R}", flush=True)
lcc.shutdown()
