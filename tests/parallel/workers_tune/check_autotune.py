"""Worker: LCC_AUTOTUNE on real ranks; every rank must apply the same settings in the same cycle.

argv: expected mode ("tune" or "cached"). Rank 0 prints the tuner's state; all ranks
record (cycle, settings) each time the engine applies settings, and the records must agree.
"""
import sys

import numpy as np
from mpi4py import MPI

import lightcc as lcc
from lightcc.common import api
from lightcc.common.tuning import autotune

mode = sys.argv[1]
steps = int(sys.argv[2])
lcc.init(fusion_threshold=4096, algorithm="flat")
eng = api.engine()
applied = []
orig = eng.executor.apply_settings


def record(settings):
    applied.append((eng.batches, tuple(sorted(settings.items()))))
    orig(settings)


eng.executor.apply_settings = record
r, n = lcc.rank(), lcc.size()
grads = [np.full(k, r + 1.0, np.float32) for k in (3, 100, 2000, 30_000, 100, 7)]
for step in range(steps):
    hs = [lcc.allreduce_async(g, name=f"layer{i}", op=lcc.Sum) for i, g in enumerate(grads)]
    for h, g in zip(hs, grads):
        out = lcc.synchronize(h)
        assert np.allclose(out, n * (n + 1) / 2), (step, out[:3])
lcc.barrier()
everyone = MPI.COMM_WORLD.allgather(applied)
assert all(a == everyone[0] for a in everyone), everyone
assert everyone[0], "no settings were ever applied"
final = MPI.COMM_WORLD.allgather((eng.fusion_threshold, eng.algorithm))
assert len(set(final)) == 1, final
if r == 0:
    tuner = autotune.active()
    print(f"STATE {tuner.state} changes={len(applied)} final={final[0]}", flush=True)
    if mode == "tune":
        assert tuner.state == "done" and tuner.loop.settled_at <= 300, tuner.state
        assert (eng.fusion_threshold, eng.algorithm) == (tuner.loop.best.fusion_threshold,
                                                            tuner.loop.best.algorithm)
    else:
        assert tuner.state == "cached" and len(applied) == 1, (tuner.state, applied)
lcc.shutdown()
print(f"OK rank {r} of {n}", flush=True)
