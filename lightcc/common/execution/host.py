"""The host strategy for allreduce buckets: pack -> prescale -> (compress +) algorithm over the
process set's communicators -> unpack with the average folded in. Runs on the engine thread.

A single tensor whose reduction dtype is its own is reduced in place in its output (no fusion
buffer); a compressed bucket of float32 tensors written in place (TopK with error feedback,
fp16, bf16, fp8) is reduced in the tensors' own memory (:func:`_allreduce_parts`).
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np

from .. import dtypes
from ..observability import faults, ranges
from .group import Group
from .plan import BucketPlan
from .reduction import (bucket_context, bucket_label, finish_scaling, float_factor, nan_mask,
                     needs_nan_mask, prescale, reduce_dtype, restore_nans, trace_bucket,
                     trace_members)


def allreduce(group: Group, plan: BucketPlan, resps: list, entries: list) -> list[Any]:
    """Fuse, reduce and unpack one bucket of allreduces; returns each entry's result."""
    if plan.alone:
        return [_alone(e) for e in entries]
    req = resps[0].request
    t0 = time.perf_counter() if group.tracer.enabled else 0.0
    rdt = reduce_dtype(req.dtype)
    comp = faults.wrap_compressor(plan.compressor) if plan.compressor is not None else None
    ordered = comp is None and _in_rank_order(group, req, rdt)
    if ordered:
        comp = _ordered_sum()
    inplace = len(resps) == 1 and rdt == dtypes.SUPPORTED[req.dtype] and entries[0] is not None
    if not inplace and _takes_parts(plan, req, comp, entries):
        comm = group.topo.world if ordered else _whole_bucket_comm(plan.algorithm, group.topo)
        if comm is not None:
            return _allreduce_parts(group, comm, plan, resps, entries, comp, t0)
    if inplace:
        result = _inplace_buffer(entries[0], rdt)
        buf = result.reshape(-1)
    else:
        tok = ranges.enter("lightcc::pack")
        buf = _pack(group.fusion.get(rdt, plan.total), entries, plan.sizes)
        ranges.leave(tok)
    prescale(buf, req.dtype, req.prescale)
    bctx = bucket_context(group.step, resps, entries, plan.sizes)
    t1 = time.perf_counter() if group.tracer.enabled else 0.0
    if faults.enabled():
        faults.check("algorithm", bctx.names, "early")
        faults.check("backend", bctx.names, "early")
    mask = None
    if needs_nan_mask(req.dtype, req.op):
        mask = nan_mask(buf)
        group.topo.world.allreduce(mask, "max")
    tok = ranges.enter("lightcc::wire" if comp is None else "lightcc::compress+wire")
    if ordered:       # the whole bucket over the world, every element summed in rank order
        comp.allreduce(group.topo.world, buf, bctx)
        used = "ordered"
    else:
        plan.reduce(buf, dtypes.backend_op(req.op, req.dtype), group.topo, comp, bctx)
        used = plan.algorithm
    ranges.leave(tok)
    if mask is not None:
        restore_nans(buf, mask)
    if faults.enabled():   # the bucket's communication is complete on this rank
        if isinstance(comp, faults.FaultyCompressor):
            comp.raise_deferred()
        faults.check("algorithm", bctx.names)
        faults.check("backend", bctx.names)
    floating = req.dtype in dtypes.FLOATING
    factor = 1.0
    if inplace or not floating:
        finish_scaling(buf, req.op, req.dtype, group.topo.size, req.postscale)
    else:   # fold the scaling into the copy back (one pass over memory instead of two)
        factor = float_factor(req.op, group.topo.size, req.postscale)
    t2 = time.perf_counter() if group.tracer.enabled else 0.0
    if group.tracer.enabled:
        trace_bucket(group.tracer, resps, int(buf.nbytes), used, comp, t0, t1, t2)
    if inplace:
        if group.tracer.enabled:
            trace_members(group.tracer, resps, t0, time.perf_counter())
        return [result]
    tok = ranges.enter("lightcc::unpack")
    results = _unpack(buf, resps, entries, bctx.offsets, plan.sizes, factor, req.dtype)
    ranges.leave(tok)
    if group.tracer.enabled:
        t3 = time.perf_counter()
        group.tracer.span(bucket_label(resps), "UNPACK", t2, t3, tensors=len(resps))
        trace_members(group.tracer, resps, t0, t3)
    return results


_ORDERED: list = []


def _ordered_sum() -> Any:
    """The process's rank-ordered sum (one instance, so its arena is reused)."""
    if not _ORDERED:
        from ..compression.fp import ordered_sum

        _ORDERED.append(ordered_sum())
    return _ORDERED[0]


def _in_rank_order(group: Group, req: Any, rdt: np.dtype) -> bool:
    """``LCC_DETERMINISTIC``: an uncompressed float32 sum on 3 or more ranks is reduced with
    every element summed in rank order (its bits then do not depend on its bucket or offset;
    with 2 ranks the order cannot change a sum)."""
    return group.settings.deterministic and rdt == np.float32 and group.topo.size >= 3 and \
        dtypes.backend_op(req.op, req.dtype) == "sum"


def _inplace_buffer(entry: Any, rdt: np.dtype) -> Any:
    """The array a single tensor is reduced in: its output when it can be, else a copy."""
    if entry.out is not None and entry.out.flags.c_contiguous and entry.out.dtype == rdt:
        if entry.out is not entry.array:
            np.copyto(entry.out, entry.array)
        return entry.out
    return np.array(entry.array, dtype=rdt, order="C", copy=True)


def _pack(buf: np.ndarray, entries: list, sizes: list[int]) -> np.ndarray:
    """Copy the entries into the fusion buffer ``buf`` (zeros for a joined rank's share)."""
    offset = 0
    for size, entry in zip(sizes, entries):
        part = buf[offset:offset + size]
        if entry is None:
            part.fill(0)
        else:
            part[...] = np.asarray(entry.array).reshape(-1)
        offset += size
    return buf


def _unpack(buf: np.ndarray, resps: list, entries: list, offsets: tuple, sizes: list[int],
            factor: float, dtype: str) -> list[Any]:
    """Each entry's result from the reduced buffer, times ``factor`` on the way out."""
    results = []
    target = dtypes.SUPPORTED[dtype]
    for resp, entry, off, size in zip(resps, entries, offsets, sizes):
        part = buf[off:off + size].reshape(resp.request.shape)
        if entry is None:
            results.append(None)
            continue
        out = entry.out if entry.out is not None else np.empty(resp.request.shape, target)
        if factor != 1.0:
            np.multiply(part, np.float32(factor) if buf.dtype == np.float32 else factor,
                        out=out, casting="unsafe")
        else:
            np.copyto(out, part, casting="unsafe")
        results.append(out)
    return results


def _takes_parts(plan: BucketPlan, req: Any, comp: Any, entries: list) -> bool:
    """Whether a fused bucket is reduced as its tensors, without packing (``_allreduce_parts``):
    a compressor that can (TopK with error feedback, the two-phase formats), float32 tensors
    written in place, and an algorithm that hands the compressor the whole bucket
    (:func:`_whole_bucket_comm`)."""
    if comp is None or not getattr(comp, "takes_parts", False) or faults.enabled():
        return False
    if req.dtype != "float32" or req.prescale != 1.0 or \
            dtypes.backend_op(req.op, req.dtype) != "sum":
        return False
    for e in entries:
        if e is None or e.out is None or e.out.dtype != np.float32 or \
                not e.out.flags.c_contiguous:
            return False
    return True


def _whole_bucket_comm(algorithm: str, topo: Any) -> Any:
    """The communicator over which ``algorithm`` gives a compressor the whole bucket, or None:
    ``flat`` and ``ring`` over the world; ``native`` and ``hierarchical`` over the hosts when
    every host runs one rank (their only phase is then the compressed one across hosts)."""
    if algorithm in ("flat", "ring"):
        return topo.world
    if algorithm in ("native", "hierarchical") and topo.is_homogeneous and topo.local.size == 1:
        return topo.cross
    return None


def _allreduce_parts(group: Group, comm: Any, plan: BucketPlan, resps: list, entries: list,
                     comp: Any, t0: float) -> list[Any]:
    """A fused bucket reduced without packing: the compressor works on the tensors' own memory
    (``allreduce_parts``) over ``comm``, with the results, residuals and wire bytes of the
    packed path. Saves copying the bucket in and out (resmlp's 25 MB TopK bucket: ~8 ms of a
    90 ms step at 1 Gbit)."""
    req = resps[0].request
    outs = []
    for e in entries:
        if e.out is not e.array:
            np.copyto(e.out, e.array)
        outs.append(e.out.reshape(-1))
    bctx = bucket_context(group.step, resps, entries, plan.sizes)
    t1 = time.perf_counter() if group.tracer.enabled else 0.0
    tok = ranges.enter("lightcc::compress+wire")
    comp.allreduce_parts(comm, list(zip(bctx.offsets, outs)), bctx)
    ranges.leave(tok)
    factor = float_factor(req.op, group.topo.size, req.postscale)
    if factor != 1.0:
        for out in outs:
            np.multiply(out, np.float32(factor), out=out)
    if group.tracer.enabled:
        t2 = time.perf_counter()
        group.tracer.span(bucket_label(resps), "COMPRESSED_ALLREDUCE", t1, t2,
                          algorithm="parts", compressor=getattr(comp, "name", ""),
                          bytes=4 * plan.total)
        trace_members(group.tracer, resps, t0, t2)
    return [e.out for e in entries]


def _alone(entry: Any) -> Any:
    """The result of an unscaled allreduce over a single rank (no packing, no copy in place)."""
    if entry is None:
        return None
    if entry.out is None:
        return np.array(entry.array, copy=True)
    if entry.out is not entry.array:
        np.copyto(entry.out, entry.array)
    return entry.out
