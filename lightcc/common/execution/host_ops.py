"""The host strategy for the collectives other than allreduce: allgather, broadcast, alltoall
and reducescatter over the process set's world communicator, plus the control-only responses
(barrier, join, process-set changes) that move no data here."""
from __future__ import annotations

from typing import Any

import numpy as np

from .. import dtypes
from ..arrays import even_counts
from ..control.messages import Coll, Response
from .group import Group
from .reduction import (fault, finish_scaling, nan_mask, needs_nan_mask, prescale, prod, reduce_dtype,
                     restore_nans)


def single(group: Group, resp: Response, entry: Any) -> Any:
    """Run a non-allreduce response; returns the entry's result."""
    coll = resp.request.coll
    if coll in _RUN:
        return _RUN[coll](group, resp, entry)
    if coll in (Coll.BARRIER, Coll.REMOVE_PSET):
        return None
    if coll in (Coll.JOIN, Coll.ADD_PSET):
        return resp.value
    raise AssertionError(f"unexpected collective {coll!r}")


def allgather(group: Group, resp: Response, entry: Any) -> Any:
    req = resp.request
    row = prod(req.shape[1:])
    firsts = list(resp.per_rank)
    dt = dtypes.SUPPORTED[req.dtype]
    out = np.empty((sum(firsts), *req.shape[1:]), dtype=dt)
    send = (np.ascontiguousarray(entry.array).reshape(-1) if entry is not None
            else np.empty(0, dtype=dt))
    fault("early", req.name)
    group.topo.world.allgatherv(send, out.reshape(-1), [f * row for f in firsts])
    fault("end", req.name)
    return out


def broadcast(group: Group, resp: Response, entry: Any) -> Any:
    req = resp.request
    if entry.out is not None and entry.out.flags.c_contiguous:
        buf = entry.out
        if buf is not entry.array:
            np.copyto(buf, entry.array)
    else:
        buf = np.array(entry.array, order="C", copy=True)
    fault("early", req.name)
    group.topo.world.bcast(buf.reshape(-1), req.root)
    fault("end", req.name)
    if entry.out is not None and entry.out is not buf:
        entry.out[...] = buf
        return entry.out
    return buf


def alltoall(group: Group, resp: Response, entry: Any) -> tuple[Any, Any]:
    req = resp.request
    me = group.topo.rank
    row = prod(req.shape[1:])
    matrix = [list(s) for s in resp.per_rank]
    send_rows = matrix[me]
    recv_rows = [matrix[src][me] for src in range(len(matrix))]
    dt = dtypes.SUPPORTED[req.dtype]
    out = np.empty((sum(recv_rows), *req.shape[1:]), dtype=dt)
    send = np.ascontiguousarray(entry.array).reshape(-1)
    fault("early", req.name)
    group.topo.world.alltoallv(send, [r * row for r in send_rows], out.reshape(-1),
                               [r * row for r in recv_rows])
    fault("end", req.name)
    return out, np.asarray(recv_rows, dtype=np.int32)


def reducescatter(group: Group, resp: Response, entry: Any) -> Any:
    req = resp.request
    n = group.topo.size
    me = group.topo.rank
    rdt = reduce_dtype(req.dtype)
    row = prod(req.shape[1:])
    rows = even_counts(req.shape[0], n)
    send = np.ascontiguousarray(np.asarray(entry.array), dtype=rdt).reshape(-1)
    if req.prescale != 1.0:
        if np.may_share_memory(send, np.asarray(entry.array)):
            send = send.copy()                      # the input stays as it was
        prescale(send, req.dtype, req.prescale)
    recv = np.empty(rows[me] * row, dtype=rdt)
    counts = [r * row for r in rows]
    fault("early", req.name)
    mask = None
    if needs_nan_mask(req.dtype, req.op):
        mask = np.empty(counts[me], np.uint8)
        group.topo.world.reduce_scatterv(nan_mask(send), mask, counts, "max")
    group.topo.world.reduce_scatterv(send, recv, counts, dtypes.backend_op(req.op, req.dtype))
    if mask is not None:
        restore_nans(recv, mask)
    fault("end", req.name)
    finish_scaling(recv, req.op, req.dtype, n, req.postscale)
    return recv.reshape((rows[me], *req.shape[1:])).astype(dtypes.SUPPORTED[req.dtype],
                                                          copy=False)


_RUN = {Coll.ALLGATHER: allgather, Coll.BROADCAST: broadcast, Coll.ALLTOALL: alltoall,
        Coll.REDUCESCATTER: reducescatter}
