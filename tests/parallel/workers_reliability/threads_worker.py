"""Concurrent user threads, and init()/shutdown()/init() cycles with process sets
(mpirun -np 3). Prints ``threads ok`` per rank.

Threads: T threads per rank each run S steps; a step submits a few uniquely named collectives
(allreduce, allgather, broadcast, grouped allreduce) and waits for them, so several threads
block in synchronize at once and take turns driving the engine. Each rank starts its threads
in its own order. Every result is checked against NumPy.
"""
from __future__ import annotations

import os
import threading
import time

import numpy as np

import lightcc as lcc
from lightcc.common import api

T = int(os.environ.get("LCC_TEST_THREADS", "6"))
S = int(os.environ.get("LCC_TEST_STEPS", "40"))


def thread_body(tid: int, errors: list) -> None:
    try:
        rng = np.random.default_rng(tid)               # same sizes on every rank
        for step in range(S):
            n = int(rng.integers(1, 2000))
            x = np.arange(n, dtype=np.float64) + R
            hs = [lcc.allreduce_async(x, op=lcc.Sum, name=f"t{tid}.ar.{step}"),
                  lcc.allgather_async(np.full((R + 1, 2), tid, np.int32), name=f"t{tid}.ag.{step}"),
                  lcc.broadcast_async(np.full(3, R * 10 + tid), root_rank=step % N,
                                      name=f"t{tid}.bc.{step}")]
            if step % 3 == 0:     # a blocking call while other threads' work is in flight
                got = lcc.allreduce(np.full(5, float(R)), op=lcc.Max, name=f"t{tid}.blk.{step}")
                assert np.all(got == N - 1), got
            g = lcc.grouped_allreduce([np.full(4, R, np.int64), x[:3]], op=lcc.Sum,
                                      name=f"t{tid}.grp.{step}")
            want = np.arange(n, dtype=np.float64) * N + sum(range(N))
            assert np.allclose(lcc.synchronize(hs[0]), want), f"thread {tid} step {step}"
            ag = lcc.synchronize(hs[1])
            assert ag.shape == (sum(r + 1 for r in range(N)), 2) and np.all(ag == tid)
            assert np.all(lcc.synchronize(hs[2]) == (step % N) * 10 + tid)
            assert np.all(g[0] == sum(range(N))) and np.allclose(g[1], want[:3])
    except BaseException as exc:          # reported by the main thread
        errors.append((tid, repr(exc)))


def run_threads() -> float:
    errors: list = []
    threads = [threading.Thread(target=thread_body, args=(t, errors), name=f"user-{t}")
               for t in range(T)]
    order = np.random.default_rng(100 + R).permutation(T)   # per-rank start order
    t0 = time.monotonic()
    for i in order:
        threads[i].start()
    for t in threads:
        t.join(120)
        assert not t.is_alive(), f"thread {t.name} hung"
    assert not errors, errors
    return time.monotonic() - t0


lcc.init()
R, N = lcc.rank(), lcc.size()
took = run_threads()
eng = api.engine()
assert eng._drivers == 0, f"driver counter drifted to {eng._drivers}"
# pure-async progress still works after the threads (the background thread drives it)
# (no deadline: a handle that never completes is a hang, which run_mpi's timeout reports)
h = lcc.allreduce_async(np.ones(2), op=lcc.Sum, name="async.only")
while not lcc.poll(h):
    time.sleep(0.001)
assert np.all(lcc.synchronize(h) == N)
lcc.shutdown()

# ---- init / shutdown / init cycles, with different process sets --------------------------
stale = None
for cycle in range(4):
    members = [[0, 2], [1, 2], [0, 1, 2], [2, 0]][cycle]
    ps = lcc.ProcessSet(members)
    lcc.init(process_sets=[ps])
    assert lcc.is_initialized() and lcc.size() == N
    if R in members:
        got = lcc.allreduce(np.array([R + 1.0]), op=lcc.Sum, name="cycle", process_set=ps)
        assert got[0] == sum(r + 1 for r in members), (cycle, got)
    got = lcc.allreduce(np.array([cycle * 1.0]), op=lcc.Sum, name="cycle.world")
    assert got[0] == cycle * N
    if cycle == 1 and stale is not None:
        # a ProcessSet from an earlier init must not silently run on a new set's ranks
        try:
            lcc.allreduce(np.ones(1), op=lcc.Sum, name="stale", process_set=stale)
            print(f"rank {R}: STALE-PSET-ACCEPTED", flush=True)
        except lcc.LightCCError as exc:
            print(f"rank {R}: stale process set rejected: {exc}", flush=True)
    stale = ps
    lcc.shutdown()
    assert not lcc.is_initialized()

# a sub-communicator job on ranks 0 and 1 while rank 2 waits, then the world again
if R < 2:
    lcc.init(comm=[0, 1])
    assert lcc.size() == 2 and lcc.rank() == R
    assert lcc.allreduce(np.array([1.0]), op=lcc.Sum, name="sub")[0] == 2
    lcc.shutdown()
from mpi4py import MPI  # noqa: E402

MPI.COMM_WORLD.Barrier()
lcc.init()
assert lcc.allreduce(np.array([1]), op=lcc.Sum, name="last")[0] == N
lcc.shutdown()

# a small unnamed allreduce (the direct path) right before shutdown(), 30 times: the first rank
# to finish it shuts down, and the announcement of that must not fail a rank whose copy of the
# same call is still completing (it did, in 3 of 3 runs of 40 cycles at 2 ranks, before the fix)
for cycle in range(30):
    lcc.init()
    got = lcc.allreduce(np.full(3, R + 1.0, np.float32), op=lcc.Sum)
    assert (got == N * (N + 1) / 2).all(), (cycle, got)
    lcc.shutdown()
print(f"rank {R}: threads ok ({T} threads x {S} steps in {took:.1f} s)", flush=True)
