"""Elastic details after a shrink, on the NumPy core under plain ``mpirun --with-ft ulfm``
(3 ranks): process sets added before the failure, the exit code of ``sys.exit(n)``, and the
reset limit. Launch rank r listed in KILLS as ``r@step`` kills itself at that step. Process
sets [0, 1] and [1, 2] (launch numbering) are added first; after every step each rank checks
a Sum over every set it is in, against the set's size, and prints what happened to the sets
after each reset. The survivors end with ``sys.exit(EXIT)``.

Usage: gaps_numpy.py KILLS EXIT     (e.g. "2@4" 3, or "2@4,1@8" 0)
"""
import os
import sys

import numpy as np

import lightcc as lcc
from lightcc.common import elastic
from lightcc.common.exceptions import InvalidArgumentError

STEPS, COMMIT = 12, 2


def main() -> None:
    kills = dict(tuple(map(int, k.split("@"))) for k in sys.argv[1].split(",") if k)
    code = int(sys.argv[2])
    launch = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    lcc.init()
    sets = {"a": lcc.add_process_set([0, 1]), "b": lcc.add_process_set([1, 2])}
    state = elastic.ObjectState(step=0)

    def after_reset() -> None:
        for name, ps in sets.items():
            try:
                print(f"launch {launch}: set {name} ranks {ps.ranks} size {ps.size()}",
                      flush=True)
            except InvalidArgumentError as exc:
                print(f"launch {launch}: set {name} error: {exc}", flush=True)

    state.register_reset_callbacks([after_reset])

    @elastic.run
    def train(state):
        while state.step < STEPS:
            if kills.get(launch) == state.step:
                os.kill(os.getpid(), 9)
            total = lcc.allreduce(np.ones(2), name="all", op=lcc.Sum)
            assert total[0] == lcc.size(), total
            for name, ps in sets.items():
                if ps.process_set_id is not None and ps.included():
                    got = lcc.allreduce(np.ones(2), name=f"set.{name}", op=lcc.Sum,
                                        process_set=ps)
                    assert got[0] == ps.size(), (name, got, ps.size())
            state.step += 1
            if state.step % COMMIT == 0:
                state.commit()

    train(state)
    print(f"launch {launch}: done size {lcc.size()} step {state.step}", flush=True)
    sys.exit(code)


if __name__ == "__main__":
    main()
