"""Rank ``argv[1]`` raises (``argv[2]`` = raise) or kills itself (kill) after a first allreduce while the others start the next one; they
must fail with an error naming it (the test checks their output and exit codes)."""
import os
import signal
import sys

import numpy as np

import lightcc as lcc

lcc.init()
victim = int(sys.argv[1])
lcc.allreduce(np.ones(4), name="first")
print(f"rank {lcc.rank()}: first done", flush=True)
if lcc.rank() == victim and sys.argv[2] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if lcc.rank() == victim:
    raise RuntimeError("planned failure in fail.py")
try:
    lcc.allreduce(np.ones(4), name="second")
except lcc.LightCCError as exc:
    print(f"rank {lcc.rank()}: LightCCError: {exc}", flush=True)
    raise
print(f"rank {lcc.rank()}: survived (should not happen)", flush=True)
