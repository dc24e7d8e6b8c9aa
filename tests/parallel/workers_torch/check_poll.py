"""``poll()`` as Horovod defines it: whether the result is ready, never waiting for it
(mpirun -np 2 or more; run with LCC_OVERLAP=0 and =1).

For every asynchronous op of lightcc.torch, as Horovod's test_torch.py does it
(``test_horovod_reducescatter_async_fused``): start several at once, poll each right after
starting it (at least one poll must say False: a just-started collective is not done), then
poll them until they all say True without ever calling ``synchronize`` (the background
thread must finish them), then check the results against references built from every
rank's inputs. Throughout, the engine records which thread executes each agreed batch: none
may run inside ``poll()`` (a poll that executed the collective waited for the other ranks; in
lazy mode it used to, and then poll() was always True). The c10d backend's
``Work.is_completed()`` is checked the same way.
"""
from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist

import lightcc.torch as hvd
from common import check, close, rank_input, run

from lightcc.common import api

R = N = 0
COUNT = 6
_tls = threading.local()
INSIDE_POLL: list[str] = []          # batches executed by a thread inside poll()


def polled(handle, what: str) -> bool:
    _tls.what = what
    try:
        return hvd.poll(handle)
    finally:
        _tls.what = None


def case_init():
    global R, N
    hvd.init()
    R, N = hvd.rank(), hvd.size()
    eng = api.engine()
    run = eng.executor.run

    def recording():
        what = getattr(_tls, "what", None)
        if what is not None:
            INSIDE_POLL.append(what)
        return run()

    eng.executor.run = recording


def _rows(k: int) -> int:
    return N * (k + 2)


def _ops():
    """(name, start(k) -> handle, reference(k), result -> tensor) per async op."""
    def inp(r, k, dtype=torch.float32):
        return rank_input(r, (_rows(k), 3), dtype, 40 + k)

    def total(k):
        return sum(inp(r, k) for r in range(N))

    def mine(k):
        per = _rows(k) // N
        return slice(R * per, (R + 1) * per)

    ident = (lambda res: res)
    return [
        ("allreduce_async", lambda k: hvd.allreduce_async(inp(R, k), op=hvd.Sum),
         total, ident),
        ("allreduce_async_", lambda k: hvd.allreduce_async_(inp(R, k), op=hvd.Average),
         lambda k: total(k) / N, ident),
        ("grouped_allreduce_async",
         lambda k: hvd.grouped_allreduce_async([inp(R, k), inp(R, k) * 2], op=hvd.Sum),
         lambda k: torch.cat([total(k), 2 * total(k)]), torch.cat),
        ("allgather_async", lambda k: hvd.allgather_async(inp(R, k)),
         lambda k: torch.cat([inp(r, k) for r in range(N)]), ident),
        ("grouped_allgather_async", lambda k: hvd.grouped_allgather_async([inp(R, k)]),
         lambda k: torch.cat([inp(r, k) for r in range(N)]), lambda res: res[0]),
        ("broadcast_async", lambda k: hvd.broadcast_async(inp(R, k), k % N),
         lambda k: inp(k % N, k), ident),
        ("broadcast_async_", lambda k: hvd.broadcast_async_(inp(R, k), k % N),
         lambda k: inp(k % N, k), ident),
        ("alltoall_async", lambda k: hvd.alltoall_async(inp(R, k)),
         lambda k: torch.cat([inp(r, k)[mine(k)] for r in range(N)]), lambda res: res[0]),
        ("reducescatter_async", lambda k: hvd.reducescatter_async(inp(R, k), op=hvd.Sum),
         lambda k: total(k)[mine(k)], ident),
        ("grouped_reducescatter_async",
         lambda k: hvd.grouped_reducescatter_async([inp(R, k)], op=hvd.Sum),
         lambda k: total(k)[mine(k)], lambda res: res[0]),
    ]


def case_poll_of_every_async_op():
    for name, start, reference, result in _ops():
        handles, first = [], []
        for k in range(COUNT):
            h = start(k)
            first.append(polled(h, name))
            handles.append(h)
        check(not all(first), f"{name}: poll() right after the start was always True "
                              f"({COUNT} starts)")
        pending = list(handles)
        while pending:                       # no synchronize: the engine must finish them
            pending = [h for h in pending if not polled(h, name)]
            time.sleep(0.001)                # (no deadline: a hang is the job's timeout)
        for k, h in enumerate(handles):
            check(polled(h, name) is True, f"{name}: poll() went back to False")
            close(result(hvd.synchronize(h)), reference(k), f"{name} #{k}")
        check(not INSIDE_POLL, f"poll() executed collectives on the calling thread: "
                               f"{INSIDE_POLL[:3]}")


def case_c10d_work_is_completed():
    dist.init_process_group("lightcc")
    xs = [rank_input(r, (7,), torch.float32, 50) for r in range(N)]
    works, ts = [], []
    for _ in range(COUNT):
        t = xs[R].clone()
        ts.append(t)
        works.append(dist.all_reduce(t, async_op=True))
    pending = list(works)
    while pending:
        _tls.what = "Work.is_completed"
        pending = [w for w in pending if not w.is_completed()]
        _tls.what = None
        time.sleep(0.001)
    for t in ts:
        close(t, sum(xs), "c10d all_reduce")
    check(not INSIDE_POLL, f"Work.is_completed() executed collectives: {INSIDE_POLL[:3]}")
    dist.destroy_process_group()


run([case_init, case_poll_of_every_async_op, case_c10d_work_is_completed])
