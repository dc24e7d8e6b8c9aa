"""numba kernels of the float casts (see ``floatcast.py`` for the semantics).

Each format gets its own compiled encoder and decoder with the format's parameters as
compile-time constants (tuples captured in a closure), so the inner loops are straight-line
32-bit integer and float32 code that LLVM vectorises (8 lanes with AVX2). Every kernel is
compiled twice: serial, and with numba threads (``parallel=True``) for codec thread counts
above one; both release the GIL.

Work is cut into **segments**: pieces of at most :data:`TILE` elements that never cross a
scale block, so one segment has one scale. Blocks of up to ``TILE`` elements are one segment
each, and scaled encoding finds the block's largest magnitude, its scale and its codes in one
pass over the block while it is in cache; larger blocks (a per-chunk scale) take one pass for
the maximum, then one to encode.

Scales travel as little-endian float32 bytes (the wire format), read and written here byte by
byte, so a scale needs no alignment in the payload.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import numpy as np
from numba import njit, prange

from ._llvm import HW_F16, bits_f32, compile_kernel, f16_bits, f16_value, f32_bits

TILE = 1 << 16  # elements per parallel work item

U32 = np.uint32
ABS = U32(0x7FFFFFFF)
SIGN = U32(0x80000000)
INF_BITS = U32(0x7F800000)
QNAN_BITS = U32(0x7FC00000)
BYTE = U32(0xFF)
MANTISSA = U32(0x7FFFFF)
MIN_NORMAL = U32(0x00800000)
FLT_MAX = np.float32(3.4028234663852886e38)
F32_INF = np.float32(np.inf)
F32_NAN = np.float32(np.nan)   # the quiet NaN 0x7FC00000 (negated: 0xFFC00000)


# --------------------------------------------------------------------------------------------
# per-format constants
# --------------------------------------------------------------------------------------------
def encode_constants(nbits: int, mbits: int, bias: int, maxcode: int, infcode: int,
                     nancode: int, hw_f16: bool) -> tuple:
    """Constants of :func:`code_of` for a format (``hw_f16``: use the F16C instruction)."""
    s = 23 - mbits                                     # mantissa bits dropped
    cval = np.float32(2.0 ** (1 - bias - mbits + 23))  # adding it rounds to subnormal units
    fmax_bits = ((maxcode >> mbits) - bias + 127) << 23 | (maxcode & ((1 << mbits) - 1)) << s
    ovf = fmax_bits + (1 << (s - 1))   # |y| from the midpoint above the largest value: special
    # below the smallest normal the float add rounds; bf16 needs no such path (float32's
    # exponent range: rounding the bit pattern is exact for subnormal inputs too)
    minnorm = (128 - bias) << 23 if bias != 127 else 0
    return (bool(hw_f16), U32(s), U32((1 << (s - 1)) - 1), U32((127 - bias) << mbits),
            U32(minnorm), cval, U32(int(cval.view(np.int32))), U32(maxcode),
            U32(infcode), U32(nancode), U32(32 - nbits), U32(ovf))


def decode_constants(nbits: int, mbits: int, bias: int, infcode: int, nancode: int,
                     has_inf: bool, hw_shift: int | None) -> tuple:
    """Constants of :func:`value_of` for a format (``hw_shift``: the code shifted left by it is
    an IEEE half, converted by the F16C instruction; None: integer code)."""
    first_special = infcode if has_inf else nancode
    subnormal = bias != 127      # bf16 shares float32's exponent range: its bits are exact as is
    return (hw_shift is not None, U32(hw_shift or 0), U32(23 - mbits), U32((127 - bias) << 23),
            U32((128 - bias) << 23), np.float32(2.0 ** (1 - bias)),
            U32((1 << mbits) if subnormal else 0), U32((1 << (nbits - 1)) - 1),
            U32(first_special), bool(has_inf))


# --------------------------------------------------------------------------------------------
# element and range helpers (inlined into the kernels)
# --------------------------------------------------------------------------------------------
@njit(inline="always")
def rounded(y, a, K):  # pragma: no cover - compiled
    """Code of the finite, in-range float32 ``y`` (``a``: its magnitude bits), sign included:
    round to nearest even on the bit pattern, or by a float add below the smallest normal."""
    hw, s, half, rebias, minnorm, cval, cbits, maxc, infc, nanc, sb, ovf = K
    if hw:
        return f16_bits(y)
    odd = U32(U32(a >> s) & U32(1))
    v = U32(U32(U32(U32(a + half) + odd) >> s) - rebias)
    if minnorm > 0:
        v = v if a >= minnorm else U32(f32_bits(abs(y) + cval) - cbits)
    return U32(v | U32(U32(f32_bits(y) & SIGN) >> sb))


@njit(inline="always")
def code_of(y, K):  # pragma: no cover - compiled
    """Code of the float32 ``y``: round to nearest even, saturate finite values at the largest
    code, Inf -> ``infcode``, NaN -> ``nancode``; the sign bit on top."""
    hw, s, half, rebias, minnorm, cval, cbits, maxc, infc, nanc, sb, ovf = K
    a = U32(f32_bits(y) & ABS)
    if a < ovf:
        return rounded(y, a, K)
    sign = U32(U32(f32_bits(y) & SIGN) >> sb)
    return U32((maxc if a < INF_BITS else (infc if a == INF_BITS else nanc)) | sign)


@njit(inline="always")
def encode_range(xs, inv, K, cs):  # pragma: no cover - compiled
    """``cs[j] = code_of(xs[j] * inv)``: a lean vectorised loop that only rounds, then the
    careful one again over the range if any |value| reached the overflow threshold (finite
    values to saturate, Inf, NaN: rare), so the common case pays for no special values."""
    ovf = K[11]
    m = U32(0)
    for j in range(xs.size):
        y = xs[j] * inv
        a = U32(f32_bits(y) & ABS)
        cs[j] = rounded(y, a, K)
        m = max(m, a)
    if m >= ovf:
        for j in range(xs.size):
            cs[j] = code_of(xs[j] * inv, K)


@njit(inline="always")
def value_of(c, K):  # pragma: no cover - compiled
    """float32 of the code ``c``, exactly, with integer operations: the code's bits moved into
    float32 position with the exponent re-biased; a subnormal code as (1 + m) minus 1 in the
    smallest normal binade, so no float32 subnormal is ever an operand (a thread that flushes
    denormals gets the same value); fp16 and E5M2 (the top byte of an fp16) with the F16C
    conversion where the CPU has it. Every NaN code gives the quiet NaN of its sign."""
    hw, hw_shift, sh, rebias, rebias1, one, minnorm, magmask, first_special, has_inf = K
    c = U32(c)
    if hw:                        # sign and Inf come out of the conversion, NaN payloads go
        q = f16_value(U32(c << hw_shift))
        return q if q == q else bits_f32(U32(U32(f32_bits(q) & SIGN) | QNAN_BITS))
    mag = U32(c & magmask)
    m = U32(mag << sh)
    q = bits_f32(U32(m + rebias))
    if minnorm > 0:
        q = q if mag >= minnorm else bits_f32(U32(m + rebias1)) - one
    if has_inf:
        q = q if mag < first_special else (F32_INF if mag == first_special else F32_NAN)
    else:
        q = q if mag < first_special else F32_NAN
    return -q if c > magmask else q


@njit(inline="always")
def scaled(q, sc):  # pragma: no cover - compiled
    """``q * sc``, saturated at ±FLT_MAX where a finite ``q`` is scaled past the float32 range."""
    v = q * sc
    return v if abs(v) < F32_INF or not abs(q) < F32_INF else (FLT_MAX if q > 0 else -FLT_MAX)


@njit(inline="always")
def amax_bits(x, lo, hi):  # pragma: no cover - compiled
    """Bits of the largest finite |x[lo:hi]| (0 if none); integer max keeps the loop vectorised."""
    m = U32(0)
    xs = x[lo:hi]        # a loop from 0 has no negative-index checks, so it vectorises
    for j in range(xs.size):
        a = U32(f32_bits(xs[j]) & ABS)
        m = max(m, a if a < INF_BITS else U32(0))
    return m


@njit(inline="always")
def exponent_of(abits, fbits):  # pragma: no cover - compiled
    """Smallest ``e`` with ``amax * 2**-e <= fmax`` (0 for amax 0), clipped to [-126, 126],
    from the float32 bits of both (``fmax >= 1``): the difference of their exponents, plus one
    where amax's mantissa is the larger. Exact, and equal to ``floatcast.scale_exponents``."""
    if abits == 0:
        return 0
    if abits < MIN_NORMAL:        # a subnormal amax: 2**-126 is already more than enough
        return -126
    e = np.int64(abits >> U32(23)) - np.int64(fbits >> U32(23))
    if U32(abits & MANTISSA) > U32(fbits & MANTISSA):
        e += 1
    return min(max(e, -126), 126)


@njit(inline="always")
def put_scale(scales, b, e):  # pragma: no cover - compiled
    """Write ``2**e`` as little-endian float32 bytes for block ``b``."""
    bits = U32(U32(e + 127) << U32(23))
    for i in range(4):
        scales[4 * b + i] = U32(U32(bits >> U32(8 * i)) & BYTE)


@njit(inline="always")
def scale_bits(scales, b):  # pragma: no cover - compiled
    """Bits of block ``b``'s float32 scale, read from little-endian bytes."""
    bits = U32(0)
    for i in range(4):
        bits = U32(bits | U32(U32(scales[4 * b + i]) << U32(8 * i)))
    return bits


@njit(inline="always")
def inverse_scale(scales, b):  # pragma: no cover - compiled
    """``2**-e`` for block ``b``'s scale ``2**e`` (exact for e in [-126, 126])."""
    field = U32(U32(scale_bits(scales, b) >> U32(23)) & BYTE)
    return bits_f32(U32(U32(U32(254) - field) << U32(23)))


@njit(inline="always")
def segment(s, n, bs, per):  # pragma: no cover - compiled
    """Block, first and end element of segment ``s`` (``per`` segments per block)."""
    b = s // per
    lo = b * bs + (s % per) * TILE
    return b, lo, min(n, b * bs + bs, lo + TILE)


# --------------------------------------------------------------------------------------------
# kernel factories
# --------------------------------------------------------------------------------------------
def _encoder(K: tuple, fmax: float) -> Callable[..., Any]:
    fbits = U32(int(np.float32(fmax).view(np.uint32)))

    def encode(x, bs, scales, auto, out):  # pragma: no cover - compiled
        """Codes of ``x`` per block of ``bs`` into ``out``; ``auto``: compute each block's scale
        from its largest magnitude and write it to ``scales``, else read it from there."""
        n = x.size
        nb = (n + bs - 1) // bs
        per = (bs + TILE - 1) // TILE
        if auto and per > 1:          # big blocks: maxima first (in parallel), then scales
            part = np.zeros(nb * per, np.uint32)
            for s in prange(nb * per):
                b, lo, hi = segment(s, n, bs, per)
                part[s] = amax_bits(x, lo, hi)
            for b in range(nb):
                put_scale(scales, b, exponent_of(part[b * per:(b + 1) * per].max(), fbits))
        for s in prange(nb * per):
            b, lo, hi = segment(s, n, bs, per)
            if auto and per == 1:     # small blocks: scale and codes in one pass
                put_scale(scales, b, exponent_of(amax_bits(x, lo, hi), fbits))
            encode_range(x[lo:hi], inverse_scale(scales, b), K, out[lo:hi])

    return encode


def _decoder(K: tuple, fmax: float) -> Callable[..., Any]:
    fmax32 = np.float32(fmax)

    def decode(codes, bs, scales, accumulate, out):  # pragma: no cover - compiled
        """``out = value * scale`` per block of ``bs`` (``out +=`` when ``accumulate``)."""
        n = codes.size
        nb = (n + bs - 1) // bs
        per = (bs + TILE - 1) // TILE
        for s in prange(nb * per):
            b, lo, hi = segment(s, n, bs, per)
            sc = bits_f32(scale_bits(scales, b))
            cs, ys = codes[lo:hi], out[lo:hi]
            if fmax32 * sc < F32_INF:         # no finite value can overflow: a plain multiply
                if accumulate:
                    for j in range(cs.size):
                        ys[j] = ys[j] + value_of(cs[j], K) * sc
                else:
                    for j in range(cs.size):
                        ys[j] = value_of(cs[j], K) * sc
            elif accumulate:
                for j in range(cs.size):
                    ys[j] = ys[j] + scaled(value_of(cs[j], K), sc)
            else:
                for j in range(cs.size):
                    ys[j] = scaled(value_of(cs[j], K), sc)

    return decode


def _block_amax(x, bs, out):  # pragma: no cover - compiled
    """Bits of the largest finite |x| per block of ``bs`` into ``out`` (uint32)."""
    n = x.size
    nb = out.size
    per = (bs + TILE - 1) // TILE
    part = np.zeros(nb * per, np.uint32)
    for s in prange(nb * per):
        b, lo, hi = segment(s, n, bs, per)
        part[s] = amax_bits(x, lo, hi)
    for b in range(nb):
        out[b] = part[b * per:(b + 1) * per].max()


# --------------------------------------------------------------------------------------------
# compiled kernels, made on first use
# --------------------------------------------------------------------------------------------
_KERNELS: dict[tuple, Callable[..., Any]] = {}


def encoder(fmt: Any, parallel: bool, hw_f16: bool | None = None) -> Callable[..., Any]:
    """Compiled encoder for ``fmt`` (a ``FloatFormat``); ``hw_f16`` None = fp16 in hardware
    where the CPU can (:data:`HW_F16`)."""
    key = ("encode", fmt.name, parallel, hw_f16)
    kernel = _KERNELS.get(key)
    if kernel is None:
        hw = (HW_F16 if hw_f16 is None else hw_f16) and fmt.name == "fp16"
        K = encode_constants(fmt.nbits, fmt.mbits, fmt.bias, fmt.maxcode, fmt.infcode,
                             fmt.nancode, hw)
        tag = f"encode_{fmt.name}{'_hw' if hw else ''}{'_par' if parallel else ''}"
        kernel = _KERNELS[key] = compile_kernel(_encoder(K, fmt.max), tag, parallel)
    return kernel


def decoder(fmt: Any, parallel: bool, hw_f16: bool | None = None) -> Callable[..., Any]:
    """Compiled decoder for ``fmt``; ``hw_f16`` None = fp16 and E5M2 through the F16C
    conversion where the CPU can (:data:`HW_F16`)."""
    key = ("decode", fmt.name, parallel, hw_f16)
    kernel = _KERNELS.get(key)
    if kernel is None:
        hw = (HW_F16 if hw_f16 is None else hw_f16) and fmt.name in ("fp16", "e5m2")
        K = decode_constants(fmt.nbits, fmt.mbits, fmt.bias, fmt.infcode, fmt.nancode,
                             fmt.infcode != fmt.nancode, (16 - fmt.nbits) if hw else None)
        tag = f"decode_{fmt.name}{'_hw' if hw else ''}{'_par' if parallel else ''}"
        kernel = _KERNELS[key] = compile_kernel(_decoder(K, fmt.max), tag, parallel)
    return kernel


@functools.cache
def block_amax_kernel(parallel: bool) -> Callable[..., Any]:
    """Compiled per-block maximum of finite magnitudes (as float32 bits)."""
    return compile_kernel(_block_amax, f"block_amax{'_par' if parallel else ''}", parallel)


__all__ = ["TILE", "block_amax_kernel", "decoder", "encoder"]
