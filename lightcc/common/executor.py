"""Executing agreed responses: pack -> compress/algorithm -> unpack -> scale, per collective.

Runs on the engine thread only. Each function takes the responses of one bucket and this
rank's local entries for them (``None`` where this rank did not submit the tensor, i.e. it
has called ``join()``), performs the collective over the process set's communicators and
returns the per-entry results; the engine completes the handles.
"""
from __future__ import annotations

import logging
import math
import time
from typing import Any

import numpy as np

from . import algorithms, device_exec, dtypes, faults, fusion
from .arrays import displacements, even_counts
from .compression.base import BucketContext
from .group import Group
from .messages import Coll, Response
from .tracing import Tracer

log = logging.getLogger("lightcc")


class LocalEntry:
    """A tensor this rank submitted: its input, optional output (in-place ops) and handle.

    A slotted class, not a dataclass: one is made per collective on the submitting thread.
    ``submitted_at``/``sent_at`` are ``time.perf_counter()`` at submit and when the coordinator
    was told; ``request`` is this rank's request (its name labels errors and error-feedback
    state); ``stream`` the ordered stream, or None when matched by name.
    """

    __slots__ = ("response_key", "array", "out", "handle", "submitted_at", "sent_at", "request",
                 "stream")

    def __init__(self, response_key: tuple, array: Any, out: Any, handle: Any,
                 submitted_at: float = 0.0, request: Any = None,
                 stream: int | None = None) -> None:
        self.response_key = response_key
        self.array = array
        self.out = out
        self.handle = handle
        self.submitted_at = submitted_at
        self.sent_at = 0.0
        self.request = request
        self.stream = stream


def _prod(shape: tuple[int, ...]) -> int:
    return int(math.prod(shape))


def _scale_integer_average(buf: Any, n: int, xp: Any = np) -> None:
    """Integer average that truncates toward zero, exactly (no float round trip)."""
    quotient = xp.abs(buf) // n
    xp.copyto(buf, xp.where(buf < 0, -quotient, quotient), casting="unsafe")


def _float_factor(op: str, n: int, postscale: float) -> float:
    """What a floating-point sum is multiplied by at the end (average and postscale)."""
    return postscale / n if op == "average" else postscale


def prescale(buf: Any, dtype: str, factor: float, xp: Any = np) -> None:
    """Multiply a reduction buffer by the prescale factor in place (Horovod's float64 scaling
    for integers; bool is never scaled). ``xp``: NumPy, or CuPy for a device buffer."""
    if factor == 1.0:
        return
    if dtype in dtypes.FLOATING:
        buf *= factor
    elif dtype in dtypes.INTEGER:
        dtypes.scale_integers(buf, factor, xp=xp)


def _finish_scaling(buf: Any, op: str, dtype: str, n: int, postscale: float,
                    xp: Any = np) -> None:
    """Average and postscale of a reduced buffer, on the host or (``xp`` CuPy) the device."""
    if dtype in dtypes.FLOATING:
        factor = _float_factor(op, n, postscale)
        if factor != 1.0:
            buf *= factor
    elif dtype in dtypes.INTEGER and postscale != 1.0:     # Horovod's float64 scaling
        factor = _float_factor(op, n, postscale)
        if factor != 1.0:
            dtypes.scale_integers(buf, factor, xp=xp)
    elif op == "average" and dtype in dtypes.INTEGER:
        _scale_integer_average(buf, n, xp)


def allreduce_bucket(group: Group, resps: list[Response],
                     entries: list[LocalEntry | None]) -> list[Any]:
    """Fuse, reduce and unpack one bucket of allreduces; returns each entry's result."""
    req = resps[0].request
    if req.device:      # GPU tensors (never fused with host ones): device_exec.py
        return device_exec.allreduce_bucket(group, resps, entries)
    t0 = time.perf_counter() if group.tracer.enabled else 0.0
    n = group.topo.size
    if n == 1 and req.prescale == 1.0 and req.postscale == 1.0:
        return [_alone(e) for e in entries]    # a sum or average over one rank: the input
    rdt = dtypes.reduce_dtype(req.dtype)
    sizes = [_prod(r.request.shape) for r in resps]
    total = sum(sizes)
    floating = req.dtype in dtypes.FLOATING
    comp = None
    spec = fusion.effective_compression(resps[0], group.min_compress_bytes)
    if spec != "none":   # the same for every tensor of the bucket (it is in the fusion key)
        comp = faults.wrap_compressor(group.compressor(spec))
    direct = (len(resps) == 1 and rdt == dtypes.SUPPORTED[req.dtype] and entries[0] is not None)
    if not direct and _takes_parts(group, req, comp, entries, total):
        return _allreduce_parts(group, resps, entries, comp, sizes, t0)
    if direct:
        entry = entries[0]
        if entry.out is not None and entry.out.flags.c_contiguous and entry.out.dtype == rdt:
            if entry.out is not entry.array:
                np.copyto(entry.out, entry.array)
            result = entry.out
        else:
            result = np.array(entry.array, dtype=rdt, order="C", copy=True)
        buf = result.reshape(-1)
    else:
        buf = group.fusion.get(rdt, total)
        offset = 0
        for size, entry in zip(sizes, entries):
            part = buf[offset:offset + size]
            if entry is None:
                part.fill(0)
            else:
                part[...] = np.asarray(entry.array).reshape(-1)
            offset += size
    prescale(buf, req.dtype, req.prescale)
    bctx = _bucket_context(group, resps, entries, sizes)
    offsets = bctx.offsets
    tracer = group.tracer
    t1 = time.perf_counter() if tracer.enabled else 0.0
    if faults.enabled():
        faults.check("algorithm", bctx.names, "early")
        faults.check("backend", bctx.names, "early")
    nan_mask = None
    if floating and req.op in ("min", "max"):
        # MPI's MIN/MAX may drop a NaN depending on rank order; reduce a NaN mask alongside
        nan_mask = np.isnan(buf).astype(np.uint8)
        group.topo.world.allreduce(nan_mask, "max")
    used = algorithms.allreduce(buf, dtypes.backend_op(req.op, req.dtype), group.topo, comp, bctx,
                                group.algorithm, group.settings.auto)
    if nan_mask is not None and nan_mask.any():
        buf[nan_mask.view(bool)] = np.nan
    if faults.enabled():   # the bucket's communication is complete on this rank
        if isinstance(comp, faults.FaultyCompressor):
            comp.raise_deferred()
        faults.check("algorithm", bctx.names)
        faults.check("backend", bctx.names)
    factor = 1.0
    if direct or not floating:
        _finish_scaling(buf, req.op, req.dtype, n, req.postscale)
    else:   # fold the scaling into the copy back (one pass over memory instead of two)
        factor = _float_factor(req.op, n, req.postscale)
    if tracer.enabled:
        t2 = time.perf_counter()
        label = _bucket_label(resps)
        tracer.span(label, "PACK", t0, t1, tensors=len(resps), bytes=int(buf.nbytes))
        tracer.span(label, "ALLREDUCE" if comp is None else "COMPRESSED_ALLREDUCE", t1, t2,
                    algorithm=used, compressor=getattr(comp, "name", "none"),
                    bytes=int(buf.nbytes))
    if direct:
        if tracer.enabled:
            _trace_members(tracer, resps, t0, time.perf_counter())
        return [result]
    results = []
    target = dtypes.SUPPORTED[req.dtype]
    for resp, entry, off, size in zip(resps, entries, offsets, sizes):
        part = buf[off:off + size].reshape(resp.request.shape)
        if entry is None:
            results.append(None)
            continue
        out = entry.out if entry.out is not None else np.empty(resp.request.shape, target)
        if factor != 1.0:
            np.multiply(part, np.float32(factor) if rdt == np.float32 else factor, out=out,
                        casting="unsafe")
        else:
            np.copyto(out, part, casting="unsafe")
        results.append(out)
    if tracer.enabled:
        t3 = time.perf_counter()
        tracer.span(_bucket_label(resps), "UNPACK", t2, t3, tensors=len(resps))
        _trace_members(tracer, resps, t0, t3)
    return results


def _bucket_context(group: Group, resps: list[Response], entries: list,
                    sizes: list[int]) -> BucketContext:
    """Where each tensor of a bucket lies in it, and its name (this rank's own request's name
    where it has one: it labels errors and error-feedback state)."""
    names = tuple(r.request.name if e is None or e.request is None else e.request.name
                  for r, e in zip(resps, entries))
    return BucketContext(names, tuple(displacements(sizes)), tuple(sizes), 0, group.step,
                         tuple(r.request.shape for r in resps))


def _takes_parts(group: Group, req: Any, comp: Any, entries: list, total: int) -> bool:
    """Whether a fused bucket is reduced as its tensors, without packing (``_allreduce_parts``):
    a compressor that can (TopK with error feedback), float32 tensors written in place,
    and an algorithm that hands the compressor the whole bucket over the world."""
    if comp is None or not getattr(comp, "takes_parts", False) or faults.enabled():
        return False
    if req.dtype != "float32" or req.prescale != 1.0 or \
            dtypes.backend_op(req.op, req.dtype) != "sum":
        return False
    for e in entries:
        if e is None or e.out is None or e.out.dtype != np.float32 or \
                not e.out.flags.c_contiguous:
            return False
    name = algorithms.choose(group.algorithm, 4 * total, group.topo, group.settings.auto)
    return name in ("flat", "ring")


def _allreduce_parts(group: Group, resps: list[Response], entries: list, comp: Any,
                     sizes: list[int], t0: float) -> list[Any]:
    """A fused bucket reduced without packing: the compressor works on the tensors' own memory
    (``allreduce_parts``), with the results, residuals and wire bytes of the packed path. Saves
    copying the bucket in and out (resmlp's 25 MB TopK bucket: ~8 ms of a 90 ms step at 1
    Gbit)."""
    req = resps[0].request
    outs = []
    for e in entries:
        if e.out is not e.array:
            np.copyto(e.out, e.array)
        outs.append(e.out.reshape(-1))
    bctx = _bucket_context(group, resps, entries, sizes)
    tracer = group.tracer
    t1 = time.perf_counter() if tracer.enabled else 0.0
    comp.allreduce_parts(group.topo.world, list(zip(bctx.offsets, outs)), bctx)
    factor = _float_factor(req.op, group.topo.size, req.postscale)
    if factor != 1.0:
        for out in outs:
            np.multiply(out, np.float32(factor), out=out)
    if tracer.enabled:
        t2 = time.perf_counter()
        label = _bucket_label(resps)
        tracer.span(label, "COMPRESSED_ALLREDUCE", t1, t2, algorithm="parts",
                    compressor=getattr(comp, "name", ""), bytes=4 * sum(sizes))
        _trace_members(tracer, resps, t0, t2)
    return [e.out for e in entries]


def _alone(entry: LocalEntry) -> Any:
    """The result of an unscaled allreduce over a single rank (no packing, no copy in place)."""
    if entry.out is None:
        return np.array(entry.array, copy=True)
    if entry.out is not entry.array:
        np.copyto(entry.out, entry.array)
    return entry.out


def _bucket_label(resps: list[Response]) -> str:
    first = resps[0].request.name
    return first if len(resps) == 1 else f"bucket[{first} +{len(resps) - 1}]"


def _trace_members(tracer: Tracer, resps: list[Response], start: float, end: float) -> None:
    label = _bucket_label(resps)
    for r in resps:
        tracer.span(r.request.name, "EXECUTE", start, end, bucket=label,
                    bytes=r.request.nbytes)


def allgather(group: Group, resp: Response, entry: LocalEntry | None) -> Any:
    req = resp.request
    row = _prod(req.shape[1:])
    firsts = list(resp.per_rank)
    dt = dtypes.SUPPORTED[req.dtype]
    out = np.empty((sum(firsts), *req.shape[1:]), dtype=dt)
    send = (np.ascontiguousarray(entry.array).reshape(-1) if entry is not None
            else np.empty(0, dtype=dt))
    _fault("early", req.name)
    group.topo.world.allgatherv(send, out.reshape(-1), [f * row for f in firsts])
    _fault("end", req.name)
    return out


def broadcast(group: Group, resp: Response, entry: LocalEntry) -> Any:
    req = resp.request
    if entry.out is not None and entry.out.flags.c_contiguous:
        buf = entry.out
        if buf is not entry.array:
            np.copyto(buf, entry.array)
    else:
        buf = np.array(entry.array, order="C", copy=True)
    _fault("early", req.name)
    group.topo.world.bcast(buf.reshape(-1), req.root)
    _fault("end", req.name)
    if entry.out is not None and entry.out is not buf:
        entry.out[...] = buf
        return entry.out
    return buf


def alltoall(group: Group, resp: Response, entry: LocalEntry) -> tuple[Any, Any]:
    req = resp.request
    me = group.topo.rank
    row = _prod(req.shape[1:])
    matrix = [list(s) for s in resp.per_rank]
    send_rows = matrix[me]
    recv_rows = [matrix[src][me] for src in range(len(matrix))]
    dt = dtypes.SUPPORTED[req.dtype]
    out = np.empty((sum(recv_rows), *req.shape[1:]), dtype=dt)
    send = np.ascontiguousarray(entry.array).reshape(-1)
    _fault("early", req.name)
    group.topo.world.alltoallv(send, [r * row for r in send_rows], out.reshape(-1),
                             [r * row for r in recv_rows])
    _fault("end", req.name)
    return out, np.asarray(recv_rows, dtype=np.int32)


def reducescatter(group: Group, resp: Response, entry: LocalEntry) -> Any:
    req = resp.request
    n = group.topo.size
    me = group.topo.rank
    rdt = dtypes.reduce_dtype(req.dtype)
    row = _prod(req.shape[1:])
    rows = even_counts(req.shape[0], n)
    send = np.ascontiguousarray(np.asarray(entry.array), dtype=rdt).reshape(-1)
    if req.dtype in dtypes.FLOATING and req.prescale != 1.0:
        send = send * req.prescale
    elif req.prescale != 1.0 and req.dtype in dtypes.INTEGER:
        send = dtypes.scale_integers(send, req.prescale, out=np.empty_like(send))
    recv = np.empty(rows[me] * row, dtype=rdt)
    counts = [r * row for r in rows]
    _fault("early", req.name)
    mask = None
    if req.dtype in dtypes.FLOATING and req.op in ("min", "max"):
        mask = np.empty(counts[me], np.uint8)
        group.topo.world.reduce_scatterv(np.isnan(send).astype(np.uint8), mask, counts, "max")
    group.topo.world.reduce_scatterv(send, recv, counts, dtypes.backend_op(req.op, req.dtype))
    if mask is not None and mask.any():
        recv[mask.view(bool)] = np.nan
    _fault("end", req.name)
    _finish_scaling(recv, req.op, req.dtype, n, req.postscale)
    return recv.reshape((rows[me], *req.shape[1:])).astype(dtypes.SUPPORTED[req.dtype], copy=False)


def execute_single(group: Group, resp: Response, entry: LocalEntry | None) -> Any:
    """Run a non-allreduce response; returns the entry's result."""
    if resp.request.device:
        return device_exec.execute_single(group, resp, entry)
    coll = resp.request.coll
    if coll == Coll.ALLGATHER:
        return allgather(group, resp, entry)
    if coll == Coll.BROADCAST:
        return broadcast(group, resp, entry)
    if coll == Coll.ALLTOALL:
        return alltoall(group, resp, entry)
    if coll == Coll.REDUCESCATTER:
        return reducescatter(group, resp, entry)
    if coll in (Coll.BARRIER, Coll.REMOVE_PSET):
        return None
    if coll in (Coll.JOIN, Coll.ADD_PSET):
        return resp.value
    raise AssertionError(f"unexpected collective {coll!r}")


# ---- fault injection hooks and the per-bucket error agreement -------------------------------
def _fault(mode: str, name: str) -> None:
    if faults.enabled():
        faults.check("backend", (name,), mode)


_AGREED = (Coll.ALLREDUCE, Coll.ALLGATHER, Coll.BROADCAST, Coll.ALLTOALL, Coll.REDUCESCATTER)


def needs_agreement(group: Group, resps: list[Response]) -> bool:
    """Whether the ranks must agree on this bucket's success after executing it.

    Only where a rank can fail alone after the communication: a compressor or a non-flat
    algorithm is used (their Python code may raise on one rank), or fault injection is on.
    Depends only on values equal on every rank (the bucket, the algorithm setting, the
    topology, ``LCC_MIN_COMPRESS_BYTES``), so all ranks decide alike.
    """
    req = resps[0].request
    if req.coll not in _AGREED:
        return False
    if faults.enabled():
        return True
    if req.coll != Coll.ALLREDUCE:
        return False
    total = sum(_prod(r.request.shape) for r in resps)
    if (req.compression not in ("", "none") and req.dtype in dtypes.FLOATING
            and req.op in ("sum", "average") and total * 4 >= group.min_compress_bytes):
        return True
    if group.algorithm == "flat":
        return False
    nbytes = total * np.dtype(dtypes.reduce_dtype(req.dtype)).itemsize
    try:
        return algorithms.choose(group.algorithm, nbytes, group.topo,
                                 group.settings.auto) != "flat"
    except Exception:       # an unknown algorithm fails on every rank alike: agree anyway
        return True


def prepare_agreement(group: Group) -> None:
    """Ready the process set's communicator for :func:`agree` (collective; the engine calls
    it on every rank before executing a bucket that needs agreement)."""
    group.topo.world.prepare_agreement()


def agree(group: Group, failed: bool, what: str) -> list[int]:
    """Ranks of the process set (positions in it) on which the bucket failed, agreed after its
    communication; a rank that failed gives up waiting after ``faults.agreement_timeout()``
    seconds and aborts the job (its peers are stuck inside the collective for good)."""
    return group.topo.world.agree(failed, what, faults.agreement_timeout())
