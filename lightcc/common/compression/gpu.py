"""Device (CuPy) versions of the CPU codecs, for buckets that live on a GPU.

Same names, arguments and results as the CPU modules, bit for bit where noted, so a compressor
picks the implementation by the buffer's type (see :func:`codec_module`):

* ``kernels/floatcast.py``: :func:`block_amax`, :func:`scale_exponents`, :func:`exps_to_scales`,
  :func:`encode`, :func:`decode` (identical bits, except that decoded values below 2**-126 in
  magnitude flush to zero because CuPy compiles kernels with ``-ftz=true``);
* ``kernels/sparse.py``: :func:`topk_indices` (identical indices), :func:`scatter_add`
  (identical sums when ``idx`` has no repeats, as in the TopK compressor);
* ``compression/fp.py`` wire payloads: :func:`encode_into`, :func:`decode_into` (one fused
  launch decodes and sums every rank's payload);
* fusion buckets: :func:`pack`, :func:`unpack` (one launch for many tensors).

Kernels come from ``csrc/quantize.cu``, ``csrc/topk.cu`` and ``csrc/pack.cu`` through
``kernels/cuda.py``; they run on CuPy's current stream. CuPy is imported lazily.
"""
from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np

from ..exceptions import InvalidArgumentError, LightCCError
from ..kernels import cuda as kc
from ..kernels import floatcast as fc
from ..kernels.gpu_pack import pack, unpack  # noqa: F401  (fusion buckets, re-exported)
from ..kernels.sparse import SAMPLE, trivial_topk

THREADS = kc.THREADS
WARP_AMAX_MAX_BLOCK = 8192     # scaling blocks up to this size: one warp each
_seeds = itertools.count(12345)
_NULL = np.uint64(0)           # a null pointer kernel argument


_i64, _launch, _check = kc.i64, kc.launch, kc.check_device_array


def is_device_array(x: Any) -> bool:
    """True for a CuPy array (without importing CuPy when it is not loaded)."""
    mod = type(x).__module__
    return mod.startswith("cupy") and hasattr(x, "data") and hasattr(x.data, "ptr")


def codec_module(x: Any) -> Any:
    """The module with encode/decode/topk_indices/scatter_add for ``x``: this one or the CPU's."""
    if is_device_array(x):
        import sys

        return sys.modules[__name__]
    from .. import kernels

    return kernels


# ---- scaled float formats ---------------------------------------------------------------------
def block_amax(x: Any, bs: int) -> Any:
    """Largest finite |x| per block of ``bs`` elements (float32, 0 for an all-non-finite block)."""
    cupy = kc.cupy_or_raise()
    _check(x, "x", np.float32)
    n, bs = x.size, max(int(bs), 1)
    nb = max(1, -(-n // bs))
    out = cupy.zeros(nb, np.float32)
    if n == 0:
        return out
    if bs <= WARP_AMAX_MAX_BLOCK and nb > 1:
        grid = min(-(-nb * 32 // THREADS), 1 << 16)
        _launch("quantize.cu", "lcc_amax_warp", grid, (x, _i64(n), _i64(bs), _i64(nb), out))
    else:
        per = max(1, min(-(-min(bs, n) // (THREADS * 16)), max(1, 4096 // nb)))
        _launch("quantize.cu", "lcc_amax_big", nb * per, (x, _i64(n), _i64(bs), _i64(per), out))
    return out


def scale_exponents(amax: Any, fmax: float) -> Any:
    """Smallest ``e`` with ``amax * 2**-e <= fmax`` per block, in [-126, 126] (int32)."""
    cupy = kc.cupy_or_raise()
    amax = cupy.ascontiguousarray(amax, dtype=np.float32)
    exps = cupy.empty(amax.size, np.int32)
    if amax.size:
        _launch("quantize.cu", "lcc_scale_exponents", kc.grid_for(amax.size),
                (amax, _i64(amax.size), np.float32(fmax), exps, _NULL))
    return exps


def exps_to_scales(exps: Any) -> Any:
    """``2**exps`` as float32 (exact)."""
    cupy = kc.cupy_or_raise()
    return cupy.ldexp(cupy.ones(len(exps), np.float32), cupy.asarray(exps, np.int32))


def encode(x: Any, f: fc.FloatFormat, exps: Any = None, bs: int | None = None,
           out: Any = None) -> Any:
    """Codes of ``x * 2**-exps[block]`` in format ``f`` (blocks of ``bs``; unscaled if None)."""
    cupy = kc.cupy_or_raise()
    _check(x, "x", np.float32)
    n = x.size
    if out is None:
        out = cupy.empty(n, f.code_dtype)
    _check(out, "out", f.code_dtype)
    if n == 0:
        return out
    if exps is None:
        e_arg, bs = _NULL, max(n, 1)
    else:
        e_arg = cupy.ascontiguousarray(exps, dtype=np.int32)
    _launch("quantize.cu", f"lcc_quantize_{f.name}", kc.grid_for(n, per_thread=8),
            (x, _i64(n), _i64(bs), e_arg, out))
    return out


def decode(codes: Any, f: fc.FloatFormat, scales: Any = None, bs: int | None = None,
           out: Any = None, accumulate: bool = False) -> Any:
    """float32 of ``codes`` times ``scales[block]``; adds into ``out`` when ``accumulate``."""
    return decode_sum(codes, f, scales, bs, out, accumulate, nsrc=1)


def decode_sum(codes: Any, f: fc.FloatFormat, scales: Any = None, bs: int | None = None,
               out: Any = None, accumulate: bool = False, nsrc: int = 1) -> Any:
    """Sum over ``nsrc`` equal-length sources stacked in ``codes`` (and ``scales``), in order.

    Equals ``nsrc`` calls of :func:`decode` with ``accumulate=True`` (same float32 order).
    """
    cupy = kc.cupy_or_raise()
    _check(codes, "codes", f.code_dtype)
    if codes.size % max(nsrc, 1):
        raise InvalidArgumentError(f"{codes.size} codes do not split into {nsrc} sources")
    n = codes.size // max(nsrc, 1)
    if out is None:
        out = cupy.zeros(n, np.float32)
        accumulate = False
    _check(out, "out", np.float32)
    if out.size != n:
        raise InvalidArgumentError(f"out has {out.size} elements, sources have {n}")
    if n == 0:
        return out
    if scales is None:
        s_arg, bs, s_stride = _NULL, max(n, 1), 0
    else:
        s_arg = cupy.ascontiguousarray(scales, dtype=np.float32)
        s_stride = s_arg.size // max(nsrc, 1)
    _launch("quantize.cu", f"lcc_dequant_sum_{f.name}", kc.grid_for(n, per_thread=8),
            (codes, s_arg, _i64(n), _i64(nsrc), _i64(n), _i64(s_stride), _i64(bs), _i64(0),
             np.int32(bool(accumulate)), out))
    return out


def _codec_bs(codec: Any, n: int) -> int:
    """Elements per scale of ``FloatCodec`` ``codec`` encoding ``n`` elements."""
    return int(codec.unit) or max(n, 1)


def encode_into(codec: Any, x: Any, out: Any) -> None:
    """GPU ``FloatCodec.encode_into``: ``nscales`` float32 scales then the codes, into ``out``."""
    n, ns = x.size, codec.nscales(x.size)
    f = codec.fmt
    codes = out[4 * ns:].view(f.code_dtype)
    if ns == 0:
        encode(x, f, out=codes)
        return
    bs = _codec_bs(codec, n)
    exps = scale_exponents(block_amax(x, bs), f.max)
    out[:4 * ns] = exps_to_scales(exps).view(np.uint8)
    encode(x, f, exps, bs, out=codes)


def decode_into(codec: Any, payload: Any, n: int, out: Any, accumulate: bool,
                nsrc: int = 1) -> None:
    """GPU ``FloatCodec.decode_into``; with ``nsrc > 1`` sums that many consecutive payloads.

    One launch replaces the loop over ranks in phase 1 of the two-phase allreduce.
    """
    _check(payload, "payload", np.uint8)
    _check(out, "out", np.float32)
    ns = codec.nscales(n)
    src_bytes = codec.nbytes(n)
    if payload.size < src_bytes * nsrc:
        raise InvalidArgumentError(f"payload of {payload.size} bytes is shorter than {nsrc} x "
                                   f"{src_bytes}")
    if n == 0:
        return
    f = codec.fmt
    _launch("quantize.cu", f"lcc_decode_payload_{f.name}", kc.grid_for(n, per_thread=8),
            (payload, _i64(n), _i64(nsrc), _i64(src_bytes), _i64(ns), _i64(_codec_bs(codec, n)),
             np.int32(bool(accumulate)), out))


def quantize(x: Any, fmt: str | fc.FloatFormat, scaling: str | None = None,
             block_size: int = 256) -> tuple[Any, Any]:
    """``(codes, scales)`` of ``x``; ``scaling`` None (scales None), "bucket" or "block"."""
    f = fc.FORMATS[fmt] if isinstance(fmt, str) else fmt
    if scaling is None:
        return encode(x, f), None
    bs = int(block_size) if scaling == "block" else max(x.size, 1)
    exps = scale_exponents(block_amax(x, bs), f.max)
    return encode(x, f, exps, bs), exps_to_scales(exps)


def dequantize(codes: Any, fmt: str | fc.FloatFormat, scales: Any = None,
               scaling: str | None = None, block_size: int = 256, out: Any = None,
               accumulate: bool = False) -> Any:
    """Inverse of :func:`quantize` (fp32), optionally accumulated into ``out``."""
    f = fc.FORMATS[fmt] if isinstance(fmt, str) else fmt
    bs = int(block_size) if scaling == "block" else max(codes.size, 1)
    return decode(codes, f, scales, bs, out, accumulate)


# ---- TopK -------------------------------------------------------------------------------------
def _select(x: Any, thr: float, capacity: int, thr_dev: Any = None) -> tuple[int, Any]:
    """Candidates ``not |x| < thr`` (or ``*thr_dev``) as 64-bit keys (csrc/topk.cu); returns
    (count, keys[:min(count, capacity)]). Reading the count waits for the device."""
    cupy = kc.cupy_or_raise()
    count = cupy.zeros(1, np.uint64)
    keys = cupy.empty(max(capacity, 1), np.uint64)
    _launch("topk.cu", "lcc_topk_select", kc.grid_for(x.size, per_thread=8),
            (x, _i64(x.size), np.float32(thr), _NULL if thr_dev is None else thr_dev,
             _i64(capacity), count, keys))
    c = int(count.get()[0])
    return c, keys[:min(c, capacity)]


_RADIX = ((21, 11), (10, 11), (0, 10))   # (shift, bits) of the select passes over |x| bits
DEVICE_SAMPLE = 8192                     # csrc/topk.cu LCC_TOPK_SAMPLE


def _finish(keys: Any, k: int, n: int) -> Any:
    """The ``k`` best candidate keys' indices, ascending (int64), without sorting anything.

    Three radix-select passes over the candidates' |x| bits find the k-th largest value and how
    many of its ties to take (the lowest indices); two bitmasks over ``n`` indices and a scan
    of their counts then give every chosen index its output position (csrc/topk.cu). About
    ten small launches and no wait for the device.
    """
    cupy = kc.cupy_or_raise()
    m = keys.size
    state = cupy.empty(4, np.uint64)                 # written by the first pick
    hist = cupy.zeros(1 << max(b for _, b in _RADIX), np.uint32)
    hist_grid = min(kc.grid_for(m), 1024)
    for p, (shift, bits) in enumerate(_RADIX):
        _launch("topk.cu", "lcc_topk_hist", hist_grid,
                (keys, _i64(m), state, np.int32(shift), np.int32(bits), np.int32(p == 0), hist))
        _launch("topk.cu", "lcc_topk_pick", 1,
                (hist, state, np.int32(shift), np.int32(bits), _i64(k if p == 0 else 0)))
    nwords = -(-n // 32)
    masks = cupy.zeros(2 * nwords, np.uint32)
    gt, tie = masks[:nwords], masks[nwords:]
    _launch("topk.cu", "lcc_topk_mark", min(kc.grid_for(m), 4096), (keys, _i64(m), state, gt, tie))
    nb = kc.grid_for(nwords, max_blocks=1 << 40)            # one word a thread, no stride
    counts = cupy.empty(2 * nb, np.int64)
    _launch("topk.cu", "lcc_topk_block_counts", nb, (gt, tie, _i64(nwords), counts))
    _launch("topk.cu", "lcc_topk_scan_blocks", 1, (counts, _i64(nb)))
    out = cupy.empty(k, np.int64)
    _launch("topk.cu", "lcc_topk_emit", nb, (gt, tie, _i64(nwords), counts, state, out))
    return out


def topk_indices(x: Any, k: int) -> Any:
    """Indices of the ``k`` largest ``|x|`` (exactly ``k``; ascending; int64; NaN/Inf largest).

    Same result as ``kernels.sparse.topk_indices`` (ties broken by the lower index). Large
    inputs: a threshold from a sample, picked on the device, keeps about 1.5 k candidates in
    one read of ``x``; one wait for the device reads their count. When the sample misjudged
    (too few or too many candidates), the host-driven loop below retries with a bigger sample.
    """
    cupy = kc.cupy_or_raise()
    _check(x, "x", np.float32)
    n = x.size
    k, trivial = trivial_topk(n, k, cupy)
    if trivial is not None:
        return trivial
    if n >= 1 << 32:
        raise InvalidArgumentError(f"topk on {n} elements: at most 2**32 - 1 supported")
    if n > 4 * SAMPLE:
        want = 1.5 * k
        rank = int(math.ceil(want * DEVICE_SAMPLE / n)) + 1
        if rank <= DEVICE_SAMPLE // 2:
            thr = cupy.empty(1, np.float32)
            _launch("topk.cu", "lcc_topk_threshold", 1,
                    (x, _i64(n), np.uint64(next(_seeds)), _i64(rank), thr))
            cap = min(n, int(2 * want) + 1024)
            count, keys = _select(x, 0.0, cap, thr_dev=thr)
            if k <= count <= cap:
                return _finish(keys, k, n)
        sample = cupy.empty(SAMPLE, np.float32)
        _launch("topk.cu", "lcc_topk_sample", kc.grid_for(SAMPLE),
                (x, _i64(n), _i64(SAMPLE), np.uint64(next(_seeds)), sample))
        sample = cupy.sort(sample).get()
        want = 1.25 * k
        for _ in range(8):
            pos = SAMPLE - int(math.ceil(want * SAMPLE / n)) - 1
            if pos <= 0:
                break
            thr = float(sample[pos])
            cap = min(n, int(2 * want) + 1024)
            count, keys = _select(x, thr, cap)
            if count > cap:                       # more than room: same threshold, exact room
                count, keys = _select(x, thr, count)
            if count >= k:
                return _finish(keys, k, n)
            want *= 2
    count, keys = _select(x, 0.0, n)              # every element is a candidate
    return _finish(keys, k, n)


def scatter_add(idx: Any, vals: Any, out: Any, check: bool = True) -> None:
    """``out[idx[j]] += vals[j]`` (fp32 atomics; repeated indices add in unspecified order).

    With ``check`` an index outside ``out`` raises InvalidArgumentError (one device sync).
    """
    cupy = kc.cupy_or_raise()
    _check(out, "out", np.float32)
    _check(vals, "vals", np.float32)
    _check(idx, "idx")
    if idx.size != vals.size:
        raise InvalidArgumentError(f"scatter_add: {idx.size} indices but {vals.size} values")
    if idx.dtype not in (np.dtype(np.int32), np.dtype(np.int64)):
        raise InvalidArgumentError(f"scatter_add: indices must be int32 or int64, got {idx.dtype}")
    if idx.size == 0:
        return
    bad = cupy.zeros(1, np.uint64)
    func = "lcc_scatter_add_i32" if idx.dtype == np.int32 else "lcc_scatter_add_i64"
    _launch("topk.cu", func, kc.grid_for(idx.size),
            (out, _i64(out.size), idx, vals, _i64(idx.size), bad))
    if check:
        nbad = int(bad.get()[0])
        if nbad:
            raise InvalidArgumentError(f"scatter_add: {nbad} of {idx.size} indices outside "
                                       f"[0, {out.size})")


# ---- fusion buckets ---------------------------------------------------------------------------
def require_device(x: Any) -> None:
    """LightCCError unless ``x`` is a CuPy array (used by callers that dispatch by type)."""
    if not is_device_array(x):
        raise LightCCError(f"expected a CuPy array, got {type(x).__name__}")
