"""A rank dies while the others are (most likely) inside an 8 MB allreduce: launch rank VICTIM
starts a timer at step 10 that SIGKILLs it DELAY seconds later, whatever it is doing. The
survivors must see MPI's failure (or lightcc's lost-rank error), re-form the group and finish
60 steps with correct sums on the smaller group. With DELAY "direct" the collectives are
small unnamed blocking allreduces (the direct path, MPI called on the training thread) and the
victim dies at step 10, before its call.

Usage: midkill_numpy.py VICTIM DELAY|direct
"""
import os
import sys
import threading

import numpy as np

import lightcc as lcc
from lightcc.common import elastic


def main() -> None:
    victim, direct = int(sys.argv[1]), sys.argv[2] == "direct"
    delay = 0.0 if direct else float(sys.argv[2])
    launch = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    lcc.init()
    state = elastic.ObjectState(step=0)
    big = np.ones(4 if direct else 2 << 20, np.float32)

    @elastic.run
    def train(state):
        while state.step < 60:
            if launch == victim and state.step == 10:
                if direct:
                    os.kill(os.getpid(), 9)
                threading.Timer(delay, lambda: os.kill(os.getpid(), 9)).start()
            out = lcc.allreduce(big, name=None if direct else "big", op=lcc.Sum)
            assert np.all(out == lcc.size()), (out[:4], lcc.size())
            state.step += 1
            if state.step % 5 == 0:
                state.commit()

    train(state)
    print(f"launch {launch}: done size {lcc.size()} step {state.step}", flush=True)


if __name__ == "__main__":
    main()
