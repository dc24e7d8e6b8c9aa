"""fp32 <-> fp16 / bf16 / fp8 (E4M3, E5M2) casts with power-of-two block scales.

Encoding works on the float32 bit pattern with integer arithmetic only: round to nearest even,
**saturate** finite values at the format's largest finite value (never Inf/NaN from finite
input), keep NaN as NaN and ±Inf as ±Inf (E4M3 has no infinity: ±Inf becomes NaN there).
A scale ``2**e`` per block is applied by shifting the exponent, so scaling is exact; the
decoder is a lookup table times the scale. With numba the kernels run in parallel threads; the
NumPy fallback gives the same bits, slower.

Measured on the 2-core dev box, 25 M floats (ms): numpy fp16 cast 43, torch fp16 50,
torch e4m3 27 (but it saturates ±Inf to 448), ml_dtypes e4m3 165 (NaN on overflow); see
benchmarks/compression.py for the numba kernels' rates.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ._threads import keeps_torch_threads

try:  # numba is optional: the NumPy fallback below produces identical bits
    import numba
    from numba import njit, prange

    HAVE_NUMBA = True
except ImportError:  # pragma: no cover - exercised only without numba
    HAVE_NUMBA = False

TILE = 1 << 16  # elements per parallel work item


@dataclass(frozen=True)
class FloatFormat:
    """A small binary float format: ``mbits`` mantissa bits, exponent ``bias``, special codes."""

    name: str
    nbits: int
    mbits: int
    bias: int
    maxcode: int       # largest finite magnitude code
    infcode: int       # code of +Inf (NaN code where the format has no infinity)
    nancode: int
    lut: np.ndarray = field(repr=False, compare=False, hash=False, default=None)

    @property
    def itemsize(self) -> int:
        return self.nbits // 8

    @property
    def code_dtype(self) -> np.dtype:
        return np.dtype(np.uint8 if self.nbits == 8 else np.uint16)

    @property
    def max(self) -> float:
        """Largest finite value."""
        return float(self.lut[self.maxcode])


def _lut(nbits: int, mbits: int, bias: int, infcode: int, nancode: int, has_inf: bool) -> np.ndarray:
    """float32 value of every code, computed from the format's definition."""
    codes = np.arange(1 << nbits, dtype=np.int64)
    mag = codes & ((1 << (nbits - 1)) - 1)
    e = mag >> mbits
    m = (mag & ((1 << mbits) - 1)).astype(np.float64)
    val = np.where(e == 0, m * 2.0 ** (1 - bias - mbits),
                   (1.0 + m / (1 << mbits)) * np.exp2((e - bias).astype(np.float64)))
    emax = (1 << (nbits - 1 - mbits)) - 1
    if has_inf:
        val = np.where(e == emax, np.where(m == 0, np.inf, np.nan), val)
    else:
        val = np.where(mag == nancode, np.nan, val)
    with np.errstate(invalid="ignore"):
        val = np.where(codes >> (nbits - 1), -val, val)
    return val.astype(np.float32)


def _fmt(name, nbits, mbits, bias, maxcode, infcode, nancode, has_inf=True) -> FloatFormat:
    return FloatFormat(name, nbits, mbits, bias, maxcode, infcode, nancode,
                       _lut(nbits, mbits, bias, infcode, nancode, has_inf))


FP16 = _fmt("fp16", 16, 10, 15, 0x7BFF, 0x7C00, 0x7E00)
BF16 = _fmt("bf16", 16, 7, 127, 0x7F7F, 0x7F80, 0x7FC0)
E4M3 = _fmt("e4m3", 8, 3, 7, 0x7E, 0x7F, 0x7F, has_inf=False)
E5M2 = _fmt("e5m2", 8, 2, 15, 0x7B, 0x7C, 0x7E)
FORMATS = {f.name: f for f in (FP16, BF16, E4M3, E5M2)}


def scale_exponents(amax: np.ndarray, fmax: float) -> np.ndarray:
    """Smallest ``e`` with ``amax * 2**-e <= fmax`` per block (0 where amax is 0), in [-126, 126]."""
    amax = np.asarray(amax, dtype=np.float64)
    mant, ex = np.frexp(amax / fmax)
    e = np.where(mant == 0.5, ex - 1, ex)
    e = np.where(amax > 0, e, 0)
    return np.clip(e, -126, 126).astype(np.int64)


# --------------------------------------------------------------------------------------------
# numba kernels: branch-free (selects only) so LLVM vectorises the inner loops
# --------------------------------------------------------------------------------------------
if HAVE_NUMBA:
    from llvmlite import ir
    from numba.core import types
    from numba.extending import intrinsic

    @intrinsic
    def _f32_bits(typingctx, x):  # pragma: no cover - compiled
        """Reinterpret a float32 as int32."""
        if x != types.float32:
            return None

        def codegen(context, builder, sig, args):
            return builder.bitcast(args[0], ir.IntType(32))

        return types.int32(types.float32), codegen

    @njit(parallel=True, cache=True)
    def _amax_blocks(x, bs, out):  # pragma: no cover - compiled
        n = x.size
        for b in prange(out.size):
            m = np.float32(0.0)
            for j in range(b * bs, min(n, (b + 1) * bs)):
                a = abs(x[j])
                a = a if a < np.inf else np.float32(0.0)   # NaN and Inf do not set the scale
                m = max(m, a)
            out[b] = m

    @njit(inline="always", cache=True)
    def _enc_seg(x, start, stop, inv, out, s, half, rebias, minnorm, cbits, cval,
                 maxcode, infcode, nancode, signshift):  # pragma: no cover - compiled
        for j in range(start, stop):
            y = x[j] * inv
            u = np.int64(_f32_bits(y)) & 0xFFFFFFFF
            a = u & 0x7FFFFFFF
            vn = ((a + half + ((a >> s) & 1)) >> s) - rebias      # RNE on the bit pattern
            vs = (np.int64(_f32_bits(abs(y) + cval)) & 0xFFFFFFFF) - cbits   # subnormal units
            v = vs if a < minnorm else vn
            v = min(v, maxcode)
            v = v if a < 0x7F800000 else (infcode if a == 0x7F800000 else nancode)
            out[j] = v | (((u >> 31) & 1) << signshift)

    @njit(parallel=True, cache=True)
    def _encode_kernel(x, bs, invs, s, rebias, minnorm, cbits, cval, maxcode, infcode,
                       nancode, signshift, out):  # pragma: no cover - compiled
        n = x.size
        half = (1 << (s - 1)) - 1
        for t in prange((n + TILE - 1) // TILE):
            j = t * TILE
            stop = min(n, j + TILE)
            while j < stop:
                blk = j // bs
                end = min(stop, (blk + 1) * bs)
                _enc_seg(x, j, end, invs[blk], out, s, half, rebias, minnorm, cbits, cval,
                         maxcode, infcode, nancode, signshift)
                j = end

    @njit(inline="always", cache=True)
    def _dec_seg(codes, start, stop, sc, lut, accumulate, out):  # pragma: no cover
        big = np.float32(3.4028234663852886e38)
        for j in range(start, stop):
            q = lut[codes[j]]
            v = q * sc
            ok = abs(v) < np.inf or abs(q) == np.inf or q != q
            v = v if ok else (big if q > 0 else -big)       # scaled past FLT_MAX: saturate
            out[j] = out[j] + v if accumulate else v

    @njit(parallel=True, cache=True)
    def _decode_kernel(codes, bs, scales, lut, accumulate, out):  # pragma: no cover
        n = codes.size
        for t in prange((n + TILE - 1) // TILE):
            j = t * TILE
            stop = min(n, j + TILE)
            while j < stop:
                blk = j // bs
                end = min(stop, (blk + 1) * bs)
                _dec_seg(codes, j, end, scales[blk], lut, accumulate, out)
                j = end


# --------------------------------------------------------------------------------------------
# NumPy fallback (same bits)
# --------------------------------------------------------------------------------------------
def _encode_numpy(x: np.ndarray, bs: int, biases: np.ndarray, f: FloatFormat) -> np.ndarray:
    n = x.size
    blk_bias = np.repeat(biases, bs)[:n] if biases.size > 1 else np.full(n, biases[0])
    e = f.bias - blk_bias                                   # scale exponent per element
    with np.errstate(over="ignore", invalid="ignore"):
        y = x.astype(np.float64) * np.exp2(-e.astype(np.float64))
        finite = np.isfinite(y)
        y = np.where(finite, np.clip(y, -f.max, f.max), y)
    # exact RNE by table search on the sorted finite non-negative codes
    pos = f.lut[: f.maxcode + 1].astype(np.float64)
    a = np.abs(np.where(finite, y, 0.0))
    hi = np.searchsorted(pos, a, side="left").clip(0, f.maxcode)
    lo = (hi - 1).clip(0)
    dlo, dhi = a - pos[lo], pos[hi] - a
    pick_hi = (dhi < dlo) | ((dhi == dlo) & (hi % 2 == 0))
    code = np.where(pick_hi, hi, lo)
    code = np.where(a == 0, 0, code)
    code = np.where(np.isnan(y), f.nancode, code)
    code = np.where(np.isinf(y), f.infcode, code)
    sign = np.signbit(x).astype(np.int64) << (f.nbits - 1)
    return (code | sign).astype(f.code_dtype)


# --------------------------------------------------------------------------------------------
# public entry points
# --------------------------------------------------------------------------------------------
@keeps_torch_threads
def block_amax(x: np.ndarray, bs: int) -> np.ndarray:
    """Largest finite |x| per block of ``bs`` elements (float32; 0 for an all-non-finite block)."""
    nb = max(1, -(-x.size // bs))
    if x.size == 0:
        return np.zeros(nb, np.float32)
    if HAVE_NUMBA:
        if nb == 1:  # one big block: parallelise over tiles, then combine
            tiles = np.empty(-(-x.size // TILE), np.float32)
            _amax_blocks(x, TILE, tiles)
            return np.array([tiles.max()], np.float32)
        out = np.empty(nb, np.float32)
        _amax_blocks(x, bs, out)
        return out
    a = np.abs(x)
    a = np.where(np.isfinite(a), a, 0).astype(np.float32)
    a = np.concatenate([a, np.zeros(nb * bs - x.size, np.float32)])
    return a.reshape(nb, bs).max(axis=1)


@keeps_torch_threads
def encode(x: np.ndarray, f: FloatFormat, exps: np.ndarray | None = None, bs: int | None = None,
           out: np.ndarray | None = None) -> np.ndarray:
    """Codes of ``x * 2**-exps[block]`` in format ``f`` (blocks of ``bs``; no scaling if None)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    n = x.size
    if exps is None:
        exps, bs = np.zeros(1, np.int64), max(n, 1)
    if out is None:
        out = np.empty(n, f.code_dtype)
    if n == 0:
        return out
    if HAVE_NUMBA:
        cval = np.float32(2.0 ** (1 - f.bias - f.mbits + 23))  # adding it rounds to subnormal units
        minnorm = (128 - f.bias) << 23                        # bits of the smallest normal
        invs = exps_to_scales(-np.asarray(exps, np.int64))
        _encode_kernel(x, int(bs), invs, 23 - f.mbits, (127 - f.bias) << f.mbits, minnorm,
                       int(cval.view(np.int32)), cval, f.maxcode, f.infcode, f.nancode,
                       f.nbits - 1, out)
    else:
        out[:] = _encode_numpy(x, int(bs), f.bias - np.asarray(exps, np.int64), f)
    return out


@keeps_torch_threads
def decode(codes: np.ndarray, f: FloatFormat, scales: np.ndarray | None = None,
           bs: int | None = None, out: np.ndarray | None = None,
           accumulate: bool = False) -> np.ndarray:
    """float32 of ``codes`` times ``scales[block]``; adds into ``out`` when ``accumulate``."""
    n = codes.size
    if out is None:
        out = np.zeros(n, np.float32)
    if n == 0:
        return out
    if scales is None:
        scales, bs = np.ones(1, np.float32), n
    scales = np.ascontiguousarray(scales, np.float32)
    if HAVE_NUMBA:
        _decode_kernel(codes, int(bs), scales, f.lut, bool(accumulate), out)
        return out
    s = np.repeat(scales, bs)[:n] if scales.size > 1 else scales[0]
    q = f.lut[codes]
    with np.errstate(over="ignore", invalid="ignore"):
        v = q * s
    big = np.float32(np.finfo(np.float32).max)
    v = np.where(np.isinf(v) & np.isfinite(q), np.copysign(big, q), v).astype(np.float32)
    if accumulate:
        out += v
    else:
        out[:] = v
    return out


def exps_to_scales(exps: np.ndarray) -> np.ndarray:
    """``2**exps`` as float32 (exact)."""
    return np.ldexp(np.ones(len(exps), np.float32), np.asarray(exps, np.int32)).astype(np.float32)


def bytes_per_element(f: FloatFormat) -> float:
    return f.nbits / 8


__all__ = ["BF16", "E4M3", "E5M2", "FORMATS", "FP16", "FloatFormat", "HAVE_NUMBA", "block_amax",
           "bytes_per_element", "decode", "encode", "exps_to_scales", "scale_exponents"]
