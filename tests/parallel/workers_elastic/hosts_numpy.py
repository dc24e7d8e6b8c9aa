"""A host leaves and comes back (the 2-simulated-host test, tests/netns/test_netns_elastic.py),
on the NumPy core: the test plays lccrun and publishes host lists in $LCC_RUNNER_STATUS_DIR;
here launch rank 0 publishes list 2 (only HOST0) at step LEAVE and list 3 (HOST0 and NEW,
which defaults to HOST1) at step BACK, each followed by a 2 s pause so every rank sees it
before the next commit. The ranks of HOST1 leave at the first reset; at the second, with
``LCC_ELASTIC_MAX_NP``, new ones start on NEW and join. Every step checks a Sum against the
group's size; rank 0 of the final group prints the weights of a least-squares descent whose
sample order depends on the group size (as train_numpy.py).

Usage: hosts_numpy.py HOST0:SLOTS HOST1:SLOTS LEAVE BACK [NEW:SLOTS]
"""
import os
import sys
import time

import numpy as np
from lsq import DIM, LR, data, gradient, weights_line

import lightcc as lcc
from lightcc.common import elastic
from lightcc.common.elastic import hosts

STEPS, COMMIT = 24, 2


def main() -> None:
    first, second = (h.split(":") for h in sys.argv[1:3])
    leave, back = int(sys.argv[3]), int(sys.argv[4])
    new = sys.argv[5].split(":") if len(sys.argv) > 5 else second
    directory = os.environ["LCC_RUNNER_STATUS_DIR"]
    x, y = data()
    lcc.init()
    state = elastic.ObjectState(w=np.zeros(DIM), step=0)
    state.register_reset_callbacks([lambda: lcc.rank() == 0 and print(
        f"RESET step {state.step} size {lcc.size()}", flush=True)])

    @elastic.run
    def train(state):
        while state.step < STEPS:
            if state.step in (leave, back):
                version = 2 if state.step == leave else 3
                if lcc.rank() == 0 and hosts.published(directory) < version:
                    listed = [(first[0], int(first[1]))]
                    if state.step == back:
                        listed.append((new[0], int(new[1])))
                    hosts.write(directory, version, listed)
                time.sleep(2)
            total = lcc.allreduce(np.ones(1), name="count", op=lcc.Sum)
            assert total[0] == lcc.size(), (total, lcc.size())
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
