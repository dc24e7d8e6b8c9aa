"""What the host, device and direct strategies share: the queue entry, reduction dtypes,
scaling, NaN masks, bucket labels and trace spans, fault hooks.

Every function takes ``xp`` (NumPy, or CuPy for a device buffer) or reads the array module from
the buffer itself, so one implementation serves host and GPU memory.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from .. import dtypes
from ..arrays import array_module, displacements
from ..compression.base import BucketContext
from ..control.messages import Response
from ..observability import faults
from ..tracing import Tracer


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


def prod(shape: tuple[int, ...]) -> int:
    return int(math.prod(shape))


# ---- dtypes ---------------------------------------------------------------------------------
#: on the GPU, stored narrow and reduced wider: 16-bit floats in float32 (as on the host); 16-bit
#: integers in int32, since NCCL has no 16-bit integer type (sum, min and max give the host's
#: results, as the cast back wraps around; an average of sums beyond 16 bits does not wrap
#: before dividing)
WIDENED = {"float16": np.dtype(np.float32), "bfloat16": np.dtype(np.float32),
           "int16": np.dtype(np.int32), "uint16": np.dtype(np.int32)}


def reduce_dtype(name: str, device: bool = False) -> np.dtype:
    """The dtype a bucket of lightcc dtype ``name`` is reduced in, on the host or the GPU."""
    return (device and WIDENED.get(name)) or dtypes.reduce_dtype(name)


# ---- scaling --------------------------------------------------------------------------------
def _scale_integer_average(buf: Any, n: int, xp: Any = np) -> None:
    """Integer average that truncates toward zero, exactly (no float round trip)."""
    quotient = xp.abs(buf) // n
    xp.copyto(buf, xp.where(buf < 0, -quotient, quotient), casting="unsafe")


def float_factor(op: str, n: int, postscale: float) -> float:
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


def finish_scaling(buf: Any, op: str, dtype: str, n: int, postscale: float,
                   xp: Any = np) -> None:
    """Average and postscale of a reduced buffer, on the host or (``xp`` CuPy) the device."""
    if dtype in dtypes.FLOATING:
        factor = float_factor(op, n, postscale)
        if factor != 1.0:
            buf *= factor
    elif dtype in dtypes.INTEGER and postscale != 1.0:     # Horovod's float64 scaling
        factor = float_factor(op, n, postscale)
        if factor != 1.0:
            dtypes.scale_integers(buf, factor, xp=xp)
    elif op == "average" and dtype in dtypes.INTEGER:
        _scale_integer_average(buf, n, xp)


# ---- NaN masks ------------------------------------------------------------------------------
def needs_nan_mask(dtype: str, op: str) -> bool:
    """MPI's and NCCL's MIN/MAX may drop a NaN depending on rank order: floating min/max reduce
    a NaN mask (max) alongside and put the NaNs back."""
    return dtype in dtypes.FLOATING and op in ("min", "max")


def nan_mask(buf: Any) -> Any:
    """1 where ``buf`` holds a NaN, as uint8 (to be max-reduced like the data)."""
    return array_module(buf).isnan(buf).astype(np.uint8)


def restore_nans(buf: Any, mask: Any) -> None:
    """Put NaN where the reduced ``mask`` is set (no host sync for device buffers)."""
    array_module(buf).copyto(buf, buf.dtype.type(np.nan), where=mask.view(bool))


# ---- labels, contexts, traces ---------------------------------------------------------------
def bucket_label(resps: list[Response]) -> str:
    first = resps[0].request.name
    return first if len(resps) == 1 else f"bucket[{first} +{len(resps) - 1}]"


def bucket_context(step: int, resps: list[Response], entries: list,
                   sizes: list[int]) -> BucketContext:
    """Where each tensor of a bucket lies in it, and its name (this rank's own request's name
    where it has one: it labels errors and error-feedback state)."""
    names = tuple(r.request.name if e is None or e.request is None else e.request.name
                  for r, e in zip(resps, entries))
    return BucketContext(names, tuple(displacements(sizes)), tuple(sizes), 0, step,
                         tuple(r.request.shape for r in resps))


def trace_members(tracer: Tracer, resps: list[Response], start: float, end: float) -> None:
    label = bucket_label(resps)
    for r in resps:
        tracer.span(r.request.name, "EXECUTE", start, end, bucket=label,
                    bytes=r.request.nbytes)


def trace_bucket(tracer: Tracer, resps: list[Response], nbytes: int, used: str, comp: Any,
                 t0: float, t1: float, t2: float, **extra: Any) -> None:
    """The PACK and (COMPRESSED_)ALLREDUCE spans of a bucket."""
    label = bucket_label(resps)
    tracer.span(label, "PACK", t0, t1, tensors=len(resps), bytes=nbytes, **extra)
    tracer.span(label, "ALLREDUCE" if comp is None else "COMPRESSED_ALLREDUCE", t1, t2,
                algorithm=used, compressor=getattr(comp, "name", "none"), bytes=nbytes)


def fault(mode: str, name: str) -> None:
    """Fault injection at a single collective's backend call (test-only, faults.py)."""
    if faults.enabled():
        faults.check("backend", (name,), mode)
