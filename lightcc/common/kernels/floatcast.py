"""fp32 <-> fp16 / bf16 / fp8 (E4M3, E5M2) casts with power-of-two block scales.

Semantics (the wire contract; every path below gives the same bits): round to nearest even;
**saturate** finite values at the format's largest finite value (never Inf/NaN from finite
input); NaN stays NaN (the format's canonical NaN code with the input's sign; decoded, the
quiet float32 NaN of that sign) and ±Inf stays ±Inf (E4M3 has no infinity: ±Inf becomes
NaN). A scale ``2**e`` per block multiplies exactly; decoded values scaled past the float32
range saturate at ±FLT_MAX.

The numba kernels (``_castkernels.py``) work on the float32 bit pattern in 32-bit SIMD lanes;
fp16 encodes with the CPU's conversion instruction where it has one (x86 F16C). They release
the GIL and run serially unless more than one codec thread is configured
(``LCC_CODEC_THREADS``). Single-threaded they run at about torch's own cast speed (``python
benchmarks/compression.py --codecs``; docs/compression.md, "Codec speed"). The NumPy fallback
gives the same bits, slower. The kernels assume the default floating-point environment on the
encoding side (as the earlier kernels and torch's cast do); decoding uses integer operations
only up to the scale, so a thread that flushes denormals decodes the same values.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ._threads import threaded_launch

try:  # numba is a dependency; the NumPy fallback below produces identical bits without it
    from ._castkernels import TILE, block_amax_kernel, decoder, encoder

    HAVE_NUMBA = True
except ImportError:  # pragma: no cover - exercised only without numba
    HAVE_NUMBA = False
    TILE = 1 << 16


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
# NumPy fallback (same bits)
# --------------------------------------------------------------------------------------------
def _encode_numpy(x: np.ndarray, bs: int, biases: np.ndarray, f: FloatFormat) -> np.ndarray:
    n = x.size
    blk_bias = np.repeat(biases, bs)[:n] if biases.size > 1 else np.full(n, biases[0])
    e = f.bias - blk_bias                                   # scale exponent per element
    with np.errstate(over="ignore", invalid="ignore"):
        # the product rounded to float32 as in the kernels (it matters for bf16's subnormals)
        y = (x * np.exp2(-e.astype(np.float64)).astype(np.float32)).astype(np.float64)
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
_ONE = np.ones(1, np.float32).view(np.uint8)   # the scale 1.0 as wire bytes


def _run(kernel_for: Callable[[bool], Callable[..., Any]], n: int, *args: Any) -> None:
    """Run ``kernel_for(parallel)(*args)`` on ``n`` elements: the threaded build when there is
    more than one codec thread and work for two, else the serial one (no thread pool at all)."""
    if n < 2 * TILE:
        kernel_for(False)(*args)
        return
    with threaded_launch() as threads:
        kernel_for(threads > 1)(*args)


def _scale_bytes(scales: np.ndarray) -> np.ndarray:
    """Scales as the kernels read them: little-endian float32 bytes (uint8 passes through)."""
    if scales.dtype == np.uint8:
        return np.ascontiguousarray(scales)
    return np.ascontiguousarray(scales, np.float32).view(np.uint8)


def block_amax(x: np.ndarray, bs: int) -> np.ndarray:
    """Largest finite |x| per block of ``bs`` elements (float32; 0 for an all-non-finite block)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    nb = max(1, -(-x.size // bs))
    if x.size == 0:
        return np.zeros(nb, np.float32)
    if HAVE_NUMBA:
        bits = np.empty(nb, np.uint32)
        _run(block_amax_kernel, x.size, x, int(bs), bits)
        return bits.view(np.float32)
    a = np.abs(x)
    a = np.where(np.isfinite(a), a, 0).astype(np.float32)
    a = np.concatenate([a, np.zeros(nb * bs - x.size, np.float32)])
    return a.reshape(nb, bs).max(axis=1)


def encode(x: np.ndarray, f: FloatFormat, exps: np.ndarray | None = None, bs: int | None = None,
           out: np.ndarray | None = None) -> np.ndarray:
    """Codes of ``x * 2**-exps[block]`` in format ``f`` (blocks of ``bs``; no scaling if None).

    ``exps`` must lie in [-126, 126] (as :func:`scale_exponents` gives them). A few µs of
    Python per call; about torch's own cast speed (see docs/compression.md, "Codec speed").
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    n = x.size
    if out is None:
        out = np.empty(n, f.code_dtype)
    if n == 0:
        return out
    if exps is None:
        scales, bs = _ONE, n
    else:
        exps = np.asarray(exps, np.int64)
        if exps.min() < -126 or exps.max() > 126:
            raise ValueError(f"scale exponents must lie in [-126, 126], got "
                             f"{exps.min()}..{exps.max()}")
        scales = _scale_bytes(exps_to_scales(exps))
    if HAVE_NUMBA:
        _run(lambda par: encoder(f, par), n, x, int(bs), scales, False, out)
    else:
        exps = np.zeros(1, np.int64) if exps is None else exps
        out[:] = _encode_numpy(x, int(bs), f.bias - exps, f)
    return out


def encode_scaled(x: np.ndarray, f: FloatFormat, bs: int, scales_out: np.ndarray,
                  out: np.ndarray) -> None:
    """Codes of ``x`` with a power-of-two scale per block of ``bs`` elements, both computed here.

    Each block's scale is :func:`scale_exponents` of its :func:`block_amax`; the scales are
    written to ``scales_out`` as little-endian float32 bytes (uint8, 4 per block: the wire
    format), the codes to ``out``. With numba one pass per block of up to 64 K elements (the
    maximum, the scale and the codes while the block is in cache).
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.size == 0:
        return
    if HAVE_NUMBA:
        _run(lambda par: encoder(f, par), x.size, x, int(bs), scales_out, True, out)
        return
    exps = scale_exponents(block_amax(x, bs), f.max)
    scales_out[:] = exps_to_scales(exps).view(np.uint8)
    out[:] = _encode_numpy(x, int(bs), f.bias - exps, f)


def decode(codes: np.ndarray, f: FloatFormat, scales: np.ndarray | None = None,
           bs: int | None = None, out: np.ndarray | None = None,
           accumulate: bool = False) -> np.ndarray:
    """float32 of ``codes`` times ``scales[block]``; adds into ``out`` when ``accumulate``.

    ``scales``: float32 per block of ``bs`` codes, or their bytes (uint8, little-endian float32,
    as they travel on the wire and need no alignment); None = unscaled. Values scaled past the
    float32 range saturate at ±FLT_MAX (their sum may still overflow to ±Inf). ``out += v``
    is one pass (the two-phase owner's decode and fp32 accumulate).
    """
    n = codes.size
    if out is None:
        out = np.zeros(n, np.float32)
    if n == 0:
        return out
    if scales is None:
        scales, bs = _ONE, n
    if HAVE_NUMBA:
        _run(lambda par: decoder(f, par), n, np.ascontiguousarray(codes), int(bs),
             _scale_bytes(scales), bool(accumulate), out)
        return out
    if scales.dtype == np.uint8:
        scales = np.frombuffer(scales.tobytes(), np.float32)
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
           "bytes_per_element", "decode", "encode", "encode_scaled", "exps_to_scales",
           "scale_exponents"]
