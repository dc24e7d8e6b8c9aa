"""Elastic training on the NumPy core (lightcc.common.elastic, ObjectState) under plain
``mpirun --with-ft ulfm``: least squares by gradient descent, rank r of n takes sample
(step * n + r) % N at each step; launch rank VICTIM kills itself at step KILL_AT. Rank 0 of
the final group prints the weights.

Usage: train_numpy.py VICTIM KILL_AT
"""
import os
import sys

import numpy as np

import lightcc as lcc
from lightcc.common import elastic

N, DIM, STEPS, COMMIT, LR = 16, 4, 12, 4, 0.1


def main() -> None:
    victim, kill_at = int(sys.argv[1]), int(sys.argv[2])
    launch_rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    rng = np.random.default_rng(5)
    x, y = rng.standard_normal((N, DIM)), rng.standard_normal(N)
    lcc.init()
    state = elastic.ObjectState(w=np.zeros(DIM), step=0)

    @elastic.run
    def train(state):
        while state.step < STEPS:
            if launch_rank == victim and state.step == kill_at:
                os.kill(os.getpid(), 9)
            i = (state.step * lcc.size() + lcc.rank()) % N
            grad = x[i] * (x[i] @ state.w - y[i])
            state.w -= LR * lcc.allreduce(grad, name="grad", op=lcc.Average)
            state.step += 1
            if state.step % COMMIT == 0:
                state.commit()

    train(state)
    if lcc.rank() == 0:
        print("W " + " ".join(f"{v:.12e}" for v in state.w) + f" size {lcc.size()}", flush=True)


if __name__ == "__main__":
    main()
