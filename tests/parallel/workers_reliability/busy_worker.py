"""A job whose engine is busy (allreduces back to back) when one rank fails; run under lccrun.

argv: mode victim stamp_file [iterations]. Modes:
  kill   - the victim SIGKILLs itself between collectives it has submitted (engine busy);
  raise  - the victim raises RuntimeError in the training thread with collectives in flight;
  early  - the victim's backend raises *before* communicating (LCC_TEST_FAULT early mode):
           peers block inside MPI, the victim's error agreement times out and aborts;
  sigint - nobody fails; ranks train until lccrun is interrupted (stamp_file is a directory
           where each rank writes ready-<rank> once it is busy).
The victim writes the wall-clock time of its failure to ``stamp_file``.
"""
from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np

import lightcc as lcc
from lightcc.common.observability import faults

mode, victim, stamp = sys.argv[1], int(sys.argv[2]), sys.argv[3]   # argv[4]: a marker
lcc.init()
R = lcc.rank()
x = np.ones(1 << 16, np.float32)
if mode == "early":
    faults.set_spec(f"backend:doomed:{victim}:early")
if mode == "sigint":
    with open(os.path.join(stamp, f"ready-{R}"), "w") as fh:
        fh.write(str(os.getpid()))
for step in range(100000):
    handles = [lcc.allreduce_async(x, name=f"grad.{i}") for i in range(4)]
    if step == 20 and R == victim and mode in ("kill", "raise"):
        with open(stamp, "w") as fh:
            fh.write(repr(time.time()))
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(f"planned failure on rank {R} with collectives in flight")
    if step == 20 and mode == "early":
        if R == victim:
            with open(stamp, "w") as fh:
                fh.write(repr(time.time()))
        handles.append(lcc.allgather_async(x[:10], name="doomed"))
    for h in handles:
        lcc.synchronize(h)
print(f"rank {R}: finished without failure", flush=True)
