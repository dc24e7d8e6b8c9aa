"""Run under lccrun: rank ``argv[2]`` fails in the way ``argv[1]`` names while the others
wait in a barrier (which would hang forever if the job were not torn down).

Modes: exit (sys.exit(3)), kill (SIGKILL itself), raise (RuntimeError). The victim writes
the wall-clock time of its failure to ``argv[3]`` (the test checks it got that far).
"""
import os
import signal
import sys
import time

from mpi4py import MPI

comm = MPI.COMM_WORLD
mode, victim, stamp = sys.argv[1], int(sys.argv[2]), sys.argv[3]
comm.Barrier()  # everyone is up and MPI is initialised
if comm.rank == victim:
    time.sleep(0.2)
    with open(stamp, "w") as fh:
        fh.write(repr(time.time()))
    if mode == "exit":
        sys.exit(3)
    elif mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif mode == "raise":
        raise RuntimeError("planned failure in fail.py")
comm.Barrier()  # the survivors block here
time.sleep(60)
print("survivor finished", flush=True)  # only reached if the job was not torn down
