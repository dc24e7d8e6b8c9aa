"""The decisions about one bucket, made once before it runs (:class:`BucketPlan`).

Whether a compressor applies, which algorithm reduces it and whether the ranks must agree on
its success afterwards all depend only on values equal on every rank (the bucket's responses,
the process set's settings and topology, ``LCC_MIN_COMPRESS_BYTES``, fault injection), so every
rank plans alike. The strategies (host.py, gpu.py) read the plan and decide nothing again.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import algorithms
from ..control.messages import Coll, Response
from ..observability import faults
from .fusion import effective_compression
from .group import Group
from .reduction import prod, reduce_dtype

#: algorithms that are one MPI call, with no Python code of their own that could raise on one
#: rank: a plain bucket of theirs needs no agreement (docs/reliability.md)
NO_AGREEMENT = ("flat", "native")
#: collectives that move data, so a rank may fail in them alone
_DATA = (Coll.ALLREDUCE, Coll.ALLGATHER, Coll.BROADCAST, Coll.ALLTOALL, Coll.REDUCESCATTER)


@dataclass
class BucketPlan:
    """How one bucket runs (see module docstring)."""

    coll: Coll
    device: bool
    sizes: list[int]                 # elements per tensor (allreduce buckets)
    compression: str = "none"        # the spec that applies to every tensor, or "none"
    compressor: Any = None           # the process set's compressor for it
    algorithm: str = "flat"          # the concrete allreduce algorithm (``auto`` resolved)
    reduce: Any = None               # its function: reduce(buf, op, topo, compressor, ctx)
    agreed: bool = False             # ranks agree on its success after it ran
    alone: bool = False              # an unscaled sum or average over one rank: the input
    error: Exception | None = None   # raised when it runs (the same on every rank)

    @property
    def total(self) -> int:
        return sum(self.sizes)


def make(group: Group, resps: list[Response]) -> BucketPlan:
    """Plan a bucket of ``resps`` (all of one fusion key) on ``group``."""
    req = resps[0].request
    coll = Coll(req.coll)
    if coll != Coll.ALLREDUCE:
        return BucketPlan(coll, req.device, [], agreed=faults.enabled() and coll in _DATA)
    plan = BucketPlan(coll, req.device, [prod(r.request.shape) for r in resps])
    if group.topo.size == 1 and req.prescale == 1.0 and req.postscale == 1.0:
        plan.alone, plan.agreed = True, faults.enabled()
        return plan
    plan.compression = effective_compression(resps[0], group.min_compress_bytes)
    if plan.compression != "none":   # the same for the whole bucket (it is in the fusion key)
        plan.compressor = group.compressor(plan.compression)
    nbytes = plan.total * np.dtype(reduce_dtype(req.dtype, req.device)).itemsize
    try:
        topo = group.device_comms().topo if req.device and not group.settings.cpu_reduce \
            else group.topo
        if req.op == "adasum":     # an op with its own algorithm (LCC_ALGORITHM not applied)
            plan.algorithm, plan.reduce = "adasum", algorithms.adasum_reduce
        else:
            plan.algorithm = algorithms.choose(group.algorithm, nbytes, topo,
                                               group.settings.auto)
            plan.reduce = algorithms.get(plan.algorithm)
    except Exception as exc:      # an unknown algorithm fails on every rank alike
        plan.error = exc
    plan.agreed = (faults.enabled() or plan.error is not None
                   or plan.algorithm not in NO_AGREEMENT
                   or _may_fail(plan.compressor, topo, plan.algorithm))
    return plan


def _may_fail(comp: Any, topo: Any, algorithm: str) -> bool:
    """Whether a compressor may fail on one rank alone (then the ranks agree afterwards):
    any compressor, except ``auto`` under ``flat`` (which hands it the world) while it sends
    everything uncompressed there (its ``needs_agreement``, the same on every rank)."""
    if comp is None:
        return False
    check = getattr(comp, "needs_agreement", None)
    return True if check is None or algorithm != "flat" else bool(check(topo.world))
