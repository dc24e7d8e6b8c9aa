"""The one door into execution: :func:`run` takes one agreed bucket (the same on every rank, in
the same order) and completes its handles, with a result or an error.

It plans the bucket once (plan.py), readies the per-bucket agreement when the plan needs one,
hands the bucket to its strategy (host.py / host_ops.py for host memory, gpu.py for GPU
memory), and on failure fails every handle of the bucket on every rank that the agreement
reached. :func:`execute` is the same without handles or failure handling (tests call it).
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

from ..control.messages import Coll, Response
from ..exceptions import (CollectiveError, InvalidArgumentError, LightCCError, MismatchError,
                          ShutdownError, StallError)
from ..observability import faults, ranges
from . import gpu, host, host_ops
from .group import Group
from .plan import BucketPlan, make

log = logging.getLogger("lightcc")

_ERROR_TYPES = {"mismatch": MismatchError, "stall": StallError, "shutdown": ShutdownError,
                "join": MismatchError}


def execute(group: Group, resps: list[Response], entries: list,
            plan: BucketPlan | None = None) -> list[Any]:
    """Run one bucket with its strategy; returns each entry's result (raises on failure).
    What :func:`run` does between its agreement steps, without handles (for tests)."""
    plan = make(group, resps) if plan is None else plan
    if plan.error is not None:
        raise plan.error
    if plan.coll == Coll.ALLREDUCE:
        return (gpu if plan.device else host).allreduce(group, plan, resps, entries)
    return [(gpu if plan.device else host_ops).single(group, resps[0], entries[0])]


def run(group: Group | None, resps: list[Response], entries: list, joined: bool, tracer: Any,
        notify: Callable[..., None]) -> bool:
    """Execute one bucket and complete its handles; True when it succeeded on every rank.

    ``entries`` are this rank's (None where it submitted nothing: it joined, or is not a
    member); ``joined``: this rank is inside ``join()`` (it adds zeros to allreduces);
    ``notify(event, **info)`` tells listeners (the autotuner) ``bucket_start``/``bucket_done``.
    """
    first = resps[0]
    if first.error:
        exc_type = _ERROR_TYPES.get(first.error_kind, LightCCError)
        if entries[0] is not None:
            entries[0].handle._set(error=exc_type(first.error))
        elif first.error_kind == "stall":
            log.error("%s", first.error)
        notify("bucket_error", responses=resps, kind=first.error_kind)   # metrics: stalls
        return False
    req = first.request
    if group is None or group.topo is None:
        for e in entries:   # not a member: nothing to do (members only submit)
            if e is not None:
                e.handle._set(error=InvalidArgumentError(f"process set {req.pset} is gone"))
        return False
    if all(e is None for e in entries) and not (joined and req.coll == Coll.ALLREDUCE):
        return False
    start = time.perf_counter()
    if tracer.enabled:
        for e, r in zip(entries, resps):
            if e is not None:
                tracer.span(r.request.name, "QUEUE", e.submitted_at, e.sent_at)
                tracer.span(r.request.name, "NEGOTIATE", e.sent_at, start)
    notify("bucket_start", responses=resps, entries=entries, start=start)  # + metrics: waits
    tok = ranges.enter("lightcc::bucket")                         # torch.profiler range
    plan = make(group, resps)
    if plan.agreed:
        group.topo.world.prepare_agreement()
    local_exc: Exception | None = None
    try:
        if plan.error is not None:
            raise plan.error
        if plan.coll == Coll.ALLREDUCE:
            results = (gpu if plan.device else host).allreduce(group, plan, resps, entries)
        else:
            results = [(gpu if plan.device else host_ops).single(group, first, entries[0])]
        if tracer.enabled and plan.coll != Coll.ALLREDUCE:
            tracer.span(req.name, req.coll.name, start, time.perf_counter())
    except Exception as exc:
        local_exc = exc
    ranges.leave(tok)
    failed: list[int] = []
    if plan.agreed:     # positions in the set -> world ranks
        failed = [group.ranks[i] for i in
                  group.topo.world.agree(local_exc is not None, req.describe(),
                                         faults.agreement_timeout())]
    if local_exc is not None or failed:
        _fail(resps, entries, local_exc, failed or [group.ranks[group.topo.rank]])
        return False
    notify("bucket_done", responses=resps, seconds=time.perf_counter() - start, plan=plan,
           nranks=group.topo.size)                               # + metrics: compression
    for e, res in zip(entries, results):
        if e is not None:
            e.handle._set(result=res)
    return True


def _fail(resps: list[Response], entries: list, exc: Exception | None,
          ranks: list[int]) -> None:
    """Fail every handle of a bucket that failed here or (agreed) on other ranks."""
    what = resps[0].request.describe()
    if len(resps) > 1:
        what += f" (bucket of {len(resps)} tensors)"
    where = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
    detail = f": {exc}" if exc is not None else " (see that rank's error for the cause)"
    for e in entries:
        if e is not None:
            err = CollectiveError(f"{what} failed on {where}{detail}")
            err.__cause__ = exc
            e.handle._set(error=err)
