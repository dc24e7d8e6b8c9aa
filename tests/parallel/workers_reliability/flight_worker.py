"""Flight-recorder scenarios under lccrun (tests/parallel/test_flight_recorder.py).

argv: mode victim. Every rank allreduces ``step<i>.grad`` (and a small ``step<i>.loss``) for
10 steps; at step 5 the victim, instead of submitting ``step5.grad``:
  raise - raises RuntimeError (the others wait in step5.grad);
  stop  - stops itself with SIGSTOP (the others wait until LCC_STALL_SHUTDOWN_TIME fails them)
          and, when Open MPI's teardown sends it SIGCONT, stays hung (sleeps) instead of
          going on to submit step5.grad after the others have already failed on it;
  sleep - sleeps 600 s (a rank busy outside lightcc; the test asks lccrun for a summary).
"""
from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np

import lightcc as lcc

mode, victim = sys.argv[1], int(sys.argv[2])
lcc.init()
R = lcc.rank()
x = np.ones((8, 4), np.float32)


def wait_for_peers(handle):
    return lcc.synchronize(handle)          # the waiting frame the summary should show


for step in range(10):
    if step == 5 and R == victim:
        if mode == "raise":
            raise RuntimeError(f"planned failure on rank {R} before step5.grad")
        if mode == "sleep":
            time.sleep(600)
        if mode == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
            time.sleep(600)
    h = lcc.allreduce_async(x, name=f"step{step}.grad")
    wait_for_peers(h)
    lcc.allreduce(np.ones(1, np.float64), name=f"step{step}.loss")
print(f"rank {R}: finished without failure", flush=True)
