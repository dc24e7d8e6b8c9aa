"""Run under lccrun: start a child process that leaves this rank's process group (as a data
loader or a daemon might), write a ready file, then wait to be interrupted.

argv: ready directory, marker string (also passed to the child so tests can look for it).
"""
import os
import signal
import subprocess
import sys
import time

from mpi4py import MPI

ready_dir, marker = sys.argv[1], sys.argv[2]
rank = MPI.COMM_WORLD.rank
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", marker],
                         start_new_session=True)
signal.signal(signal.SIGINT, signal.SIG_IGN)  # a stubborn rank: must still be stopped
with open(os.path.join(ready_dir, f"ready-{rank}"), "w") as fh:
    fh.write(f"{os.getpid()} {child.pid}\n")
time.sleep(120)
