"""Elastic training on the NumPy core (lightcc.common.elastic, ObjectState) under plain
``mpirun --with-ft ulfm``: least squares by gradient descent, rank r of n takes sample
(step * n + r) % N at each step; launch rank VICTIM kills itself at step KILL_AT. Rank 0 of
the final group prints the weights. With NOTICE_AT, launch rank 1 alone posts a host notice
(``state.on_hosts_updated``) at that step: every rank must raise HostsUpdatedInterrupt at the
next commit and the group is re-formed with the same ranks.

Usage: train_numpy.py VICTIM KILL_AT [NOTICE_AT]
"""
import os
import sys
import time

import numpy as np
from lsq import DIM, LR, data, gradient, weights_line

import lightcc as lcc
from lightcc.common import elastic

STEPS, COMMIT = 12, 4


def main() -> None:
    victim, kill_at = int(sys.argv[1]), int(sys.argv[2])
    notice_at = int(sys.argv[3]) if len(sys.argv) > 3 else -1
    launch_rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    x, y = data()
    lcc.init()
    state = elastic.ObjectState(w=np.zeros(DIM), step=0)

    @elastic.run
    def train(state):
        while state.step < STEPS:
            if launch_rank == victim and state.step == kill_at:
                os.kill(os.getpid(), 9)
            if launch_rank == 1 and state.step == notice_at:
                state.on_hosts_updated(time.time())
            grad = gradient(x, y, state.w, state.step, lcc.size(), lcc.rank())
            state.w -= LR * lcc.allreduce(grad, name="grad", op=lcc.Average)
            state.step += 1
            if state.step % COMMIT == 0:
                state.commit()

    train(state)
    if lcc.rank() == 0:
        print(weights_line(state.w, lcc.size()), flush=True)


if __name__ == "__main__":
    main()
