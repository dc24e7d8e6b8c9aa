"""The device strategy: buckets whose tensors live on a GPU (the twin of host.py/host_ops.py).

Every function runs on the process set's device (``Group.device_comms()``: GPU, engine stream,
device communicators from the backend factory) with the engine's stream current:

1. the stream waits on each input's ready event (recorded on the producer's stream at submit);
2. pack into the device fusion buffer (one launch; fp16/bf16 widened to fp32, the prescale
   folded in), compress and run the planned algorithm over the device communicators (NCCL, or
   MPI through pinned memory), unpack (the average's ``1/size`` folded in);
3. an event recorded on the stream completes each handle (:class:`~..gpu_arrays.Completion`): the
   consumer's stream waits on it in ``synchronize()``. No step waits on the host, except what a
   compressor or a staged (MPI) call needs by nature (TopK's candidate count, MPI reading host
   memory).

``LCC_CPU_REDUCE=1``: an allreduce bucket is packed on the GPU, copied once into pinned host
memory, reduced by the host algorithm (and host compressor) over MPI, and copied back.
"""
from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from .. import dtypes
from ..arrays import displacements, even_counts
from ..backends import staged
from ..compression.base import BucketContext
from ..control.messages import Coll, Response
from ..gpu_arrays import Completion, record_event
from ..kernels import cuda as kc
from .group import Group
from .plan import BucketPlan
from .reduction import (WIDENED, bucket_context, bucket_label, finish_scaling, float_factor, nan_mask,
                     needs_nan_mask, prescale, reduce_dtype, restore_nans, trace_bucket,
                     trace_members)


def storage_dtype(name: str) -> np.dtype:
    """How a tensor of lightcc dtype ``name`` is held on the GPU (bfloat16 as uint16 bits)."""
    return np.dtype(np.uint16) if name == "bfloat16" else dtypes.SUPPORTED[name]


def _flat(dt: Any, as_dtype: Any = None) -> Any:
    """1-D view of a DeviceTensor's memory, re-typed to ``as_dtype`` (same element size)."""
    arr = dt.array.reshape(-1)
    return arr if as_dtype is None or arr.dtype == as_dtype else arr.view(as_dtype)


# ---- float16 / bfloat16 <-> float32 (CuPy element-wise ops; same bits as the host path) ----
def widen(cupy: Any, src: Any, name: str, out: Any) -> None:
    """``out`` (float32 / int32) = ``src`` (float16, bfloat16 bits in any 2-byte integer
    type, int16 or uint16)."""
    if name == "bfloat16":
        bits = src.view(np.uint16).astype(np.uint32)
        cupy.left_shift(bits, 16, out=out.view(np.uint32))
    else:
        cupy.copyto(out, src, casting="same_kind")


def narrow(cupy: Any, src: Any, name: str, out: Any, scale: float = 1.0) -> None:
    """``out`` = ``src * scale`` rounded to nearest even (fp16: Inf beyond range; bf16 bits,
    NaN kept with its sign, as ml_dtypes does)."""
    x = src * np.float32(scale) if scale != 1.0 else src
    if name != "bfloat16":                # fp16: IEEE rounding; 16-bit ints wrap around
        cupy.copyto(out, x, casting="unsafe")
        return
    u = x.view(np.uint32)
    rne = (u + (np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1)))) >> 16
    nan = ((u >> 16) & np.uint32(0x8000)) | np.uint32(0x7FC0)
    cupy.copyto(out.view(np.uint16), cupy.where(cupy.isnan(x), nan, rne), casting="unsafe")


# ---- stream bracket ---------------------------------------------------------------------------
def _run(group: Group, entries: list, body: Any) -> Any:
    """``body(cupy, dev)`` on the set's GPU with the engine stream current, after every
    input's ready event; the handles complete with the stream's done event."""
    cupy = kc.cupy_or_raise()
    dev = group.device_comms()
    with cupy.cuda.Device(dev.device), dev.stream:
        for e in entries:
            if e is not None and e.array is not None and e.array.ready is not None:
                dev.stream.wait_event(e.array.ready)
        results = body(cupy, dev)
        done = Completion(record_event(dev.device, dev.stream), dev.device, (entries, results))
    for e in entries:
        if e is not None:
            e.handle.device_done = done
    return results


# ---- allreduce --------------------------------------------------------------------------------
def allreduce(group: Group, plan: BucketPlan, resps: list[Response], entries: list) -> list[Any]:
    """Device version of :func:`host.allreduce` (see module docstring)."""
    return _run(group, entries,
                lambda cupy, dev: _allreduce(cupy, group, dev, plan, resps, entries))


def _alone(cupy: Any, entry: Any) -> Any:
    src = entry.array.array
    if entry.out is None:
        return src.copy()
    if entry.out.array is not src:
        cupy.copyto(_flat(entry.out, src.dtype), src.reshape(-1))
    return entry.out.array


def _pack(cupy: Any, buf: Any, entries: list, sizes: list[int], name: str,
          scale: float) -> bool:
    """Fill ``buf``; returns whether ``scale`` was applied (fp32 buckets fold it in)."""
    if name not in WIDENED and all(e is not None for e in entries):
        from ..compression import gpu  # not at import: it loads numba's CPU kernels

        folded = buf.dtype == np.float32 and scale != 1.0
        gpu.pack([_flat(e.array, buf.dtype) for e in entries], out=buf,
                 scale=scale if folded else None)
        return folded
    offset = 0
    for size, e in zip(sizes, entries):
        part = buf[offset:offset + size]
        if e is None:
            part.fill(0)
        elif name in WIDENED:
            widen(cupy, _flat(e.array), name, part)
        else:
            cupy.copyto(part, _flat(e.array, buf.dtype))
        offset += size
    return False


def _unpack(cupy: Any, buf: Any, entries: list, outs: list, sizes: list[int], name: str,
            factor: float) -> None:
    if name not in WIDENED and all(e is not None for e in entries) and \
            (factor == 1.0 or buf.dtype == np.float32):
        from ..compression import gpu

        gpu.unpack(buf, [o.reshape(-1).view(buf.dtype) for o in outs],
                   scale=factor if factor != 1.0 else None)
        return
    for o, off, size in zip(outs, displacements(sizes), sizes):
        if o is None:
            continue
        part = buf[off:off + size]
        if name in WIDENED:
            narrow(cupy, part, name, o.reshape(-1), factor)
        elif factor != 1.0:
            cupy.multiply(part, buf.dtype.type(factor), out=o.reshape(-1).view(buf.dtype))
        else:
            cupy.copyto(o.reshape(-1).view(buf.dtype), part)


def _allreduce(cupy: Any, group: Group, dev: Any, plan: BucketPlan, resps: list[Response],
               entries: list) -> list[Any]:
    req = resps[0].request
    if plan.alone:
        return [None if e is None else _alone(cupy, e) for e in entries]
    n = group.topo.size
    t0 = time.perf_counter() if group.tracer.enabled else 0.0
    name = req.dtype
    rdt = reduce_dtype(name, device=True)
    sizes = plan.sizes
    floating = name in dtypes.FLOATING
    comp = plan.compressor
    inplace = len(resps) == 1 and name not in WIDENED and entries[0] is not None
    scaled = False
    if inplace:
        e = entries[0]
        result = _alone(cupy, e) if e.out is not None else e.array.array.copy()
        buf = result.reshape(-1).view(rdt)
    else:
        buf = group.fusion.get(rdt, sum(sizes), xp=cupy)
        scaled = _pack(cupy, buf, entries, sizes, name, req.prescale if floating else 1.0)
    if not scaled:
        prescale(buf, name, req.prescale, xp=cupy)
    bctx = bucket_context(group.step, resps, entries, sizes)
    t1 = time.perf_counter() if group.tracer.enabled else 0.0
    op = dtypes.backend_op(req.op, name)
    mask = None
    if needs_nan_mask(name, req.op):
        mask = nan_mask(buf)
        dev.topo.world.allreduce(mask, "max")
    if group.settings.cpu_reduce:
        used = _host_reduce(group, dev, buf, op, comp, bctx, plan)
    else:
        plan.reduce(buf, op, dev.topo, comp, bctx)
        used = plan.algorithm
    if mask is not None:
        restore_nans(buf, mask)
    factor = 1.0
    if inplace or not floating:
        finish_scaling(buf, req.op, name, n, req.postscale, xp=cupy)
    else:
        factor = float_factor(req.op, n, req.postscale)
    t2 = time.perf_counter() if group.tracer.enabled else 0.0
    if inplace:
        results = [result]
    else:
        outs = [None if e is None else
                (e.out.array if e.out is not None else cupy.empty(r.request.shape,
                                                                  e.array.array.dtype))
                for r, e in zip(resps, entries)]
        _unpack(cupy, buf, entries, outs, sizes, name, factor)
        results = outs
    if group.tracer.enabled:
        trace_bucket(group.tracer, resps, int(buf.nbytes), used, comp, t0, t1, t2, device=True)
        t3 = time.perf_counter()
        group.tracer.span(bucket_label(resps), "UNPACK", t2, t3, tensors=len(resps))
        trace_members(group.tracer, resps, t0, t3)
    return results


def _host_reduce(group: Group, dev: Any, buf: Any, op: str, comp: Any,
                 bctx: BucketContext, plan: BucketPlan) -> str:
    """LCC_CPU_REDUCE: one copy to pinned host memory, the host algorithm, one copy back."""
    host = dev.pinned.view(buf.size, buf.dtype)
    staged.copy_to_host(buf, host, dev.stream)
    plan.reduce(host, op, group.topo, comp, bctx)
    staged.copy_to_device(host, buf, dev.stream)
    dev.pinned.done_with(dev.stream)
    return "cpu-reduce:" + plan.algorithm


# ---- the other collectives ----------------------------------------------------------------------
def single(group: Group, resp: Response, entry: Any) -> Any:
    """Device version of :func:`host_ops.single` for the data collectives."""
    run = {Coll.ALLGATHER: _allgather, Coll.BROADCAST: _broadcast, Coll.ALLTOALL: _alltoall,
           Coll.REDUCESCATTER: _reducescatter}[resp.request.coll]
    return _run(group, [entry], lambda cupy, dev: run(cupy, dev, resp, entry))


def _allgather(cupy: Any, dev: Any, resp: Response, entry: Any) -> Any:
    req = resp.request
    row = int(math.prod(req.shape[1:]))
    firsts = list(resp.per_rank)
    store = entry.array.array.dtype if entry is not None else storage_dtype(req.dtype)
    out = cupy.empty((sum(firsts), *req.shape[1:]), store)
    send = _flat(entry.array) if entry is not None else cupy.empty(0, store)
    dev.topo.world.allgatherv(send, out.reshape(-1), [f * row for f in firsts])
    return out


def _broadcast(cupy: Any, dev: Any, resp: Response, entry: Any) -> Any:
    buf = _alone(cupy, entry)
    dev.topo.world.bcast(buf.reshape(-1), resp.request.root)
    return buf


def _alltoall(cupy: Any, dev: Any, resp: Response, entry: Any) -> tuple[Any, Any]:
    req = resp.request
    world = dev.topo.world
    row = int(math.prod(req.shape[1:]))
    matrix = [list(s) for s in resp.per_rank]
    send_rows = matrix[world.rank]
    recv_rows = [matrix[src][world.rank] for src in range(len(matrix))]
    out = cupy.empty((sum(recv_rows), *req.shape[1:]), entry.array.array.dtype)
    world.alltoallv(_flat(entry.array), [r * row for r in send_rows], out.reshape(-1),
                    [r * row for r in recv_rows])
    return out, np.asarray(recv_rows, dtype=np.int32)


def _reducescatter(cupy: Any, dev: Any, resp: Response, entry: Any) -> Any:
    req = resp.request
    world = dev.topo.world
    n, me, name = world.size, world.rank, req.dtype
    rdt = reduce_dtype(name, device=True)
    row = int(math.prod(req.shape[1:]))
    rows = even_counts(req.shape[0], n)
    counts = [r * row for r in rows]
    if name in WIDENED:
        send = cupy.empty(entry.array.size, rdt)
        widen(cupy, _flat(entry.array), name, send)
    else:
        send = _flat(entry.array, rdt)
    if req.prescale != 1.0:                             # a new array: the input stays
        send = send.copy()
        prescale(send, name, req.prescale, xp=cupy)
    recv = cupy.empty(counts[me], rdt)
    mask = None
    if needs_nan_mask(name, req.op):
        mask = cupy.empty(counts[me], np.uint8)
        world.reduce_scatterv(nan_mask(send), mask, counts, "max")
    world.reduce_scatterv(send, recv, counts, dtypes.backend_op(req.op, name))
    if mask is not None:
        restore_nans(recv, mask)
    finish_scaling(recv, req.op, name, n, req.postscale, xp=cupy)
    store = entry.array.array.dtype
    if name in WIDENED:
        out = cupy.empty(counts[me], store)
        narrow(cupy, recv, name, out)
    else:
        out = recv.view(store)
    return out.reshape((rows[me], *req.shape[1:]))
