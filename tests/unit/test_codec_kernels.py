"""The fast cast kernels, bit for bit against an independent reference (ml_dtypes / NumPy).

Every compiled variant (serial and threaded, fp16 through the CPU's conversion instruction and
through integer code) is checked on edge cases that catch a wrong rounding, saturation or
special-value rule: ±0, float32 subnormals, every format's subnormals, values exactly halfway
between two codes and one float32 ulp either side, the largest finite value and the overflow
threshold, ±Inf and NaNs with payloads, and random bit patterns; with no scale, one scale per
chunk and one per block. The reference never calls lightcc: it casts with ml_dtypes / NumPy,
saturates by clipping and computes scales with ``ceil(log2(amax / max))``.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from lightcc.common.kernels import _castkernels as ck
from lightcc.common.kernels import floatcast as fc

DTYPES = {"fp16": np.float16, "bf16": ml_dtypes.bfloat16, "e4m3": ml_dtypes.float8_e4m3fn,
          "e5m2": ml_dtypes.float8_e5m2}
# (nbits, largest finite, canonical NaN code, Inf code or None): the formats' definitions
SPEC = {"fp16": (16, 65504.0, 0x7E00, 0x7C00), "bf16": (16, 3.3895313892515355e38, 0x7FC0, 0x7F80),
        "e4m3": (8, 448.0, 0x7F, None), "e5m2": (8, 57344.0, 0x7E, 0x7C)}
FLT_MAX = np.float32(np.finfo(np.float32).max)
RNG = np.random.default_rng(2024)


def _bits(u) -> np.ndarray:
    return np.asarray(u, np.uint32).view(np.float32)


def edge_inputs(name: str) -> np.ndarray:
    """Values where a cast can go wrong, both signs, plus random bit patterns."""
    ref = DTYPES[name]
    nbits, fmax, _, _ = SPEC[name]
    codes = np.arange(1 << (nbits - 1), dtype=np.uint16 if nbits == 16 else np.uint8)
    with np.errstate(invalid="ignore"):
        vals = codes.view(ref).astype(np.float64)
    vals = vals[np.isfinite(vals)]                         # 0, subnormals, normals up to max
    top = float(np.nextafter(np.float32(fmax), np.float32(np.inf)))
    ulp_max = fmax - vals[-2]
    grid = np.concatenate([vals, [fmax + ulp_max]])        # one step past max: overflow midpoint
    mids = (grid[:-1] + grid[1:]) / 2                      # ties: round to even
    pts = np.concatenate([vals, mids]).astype(np.float32)
    near = np.concatenate([pts, np.nextafter(pts, np.float32(np.inf)),
                           np.nextafter(pts, np.float32(0))])
    special = np.concatenate([
        _bits([0, 1, 2, 0x007FFFFF, 0x00800000, 0x00800001, 0x7F7FFFFF, 0x7F800000,
               0x7F800001, 0x7FC00000, 0x7FC00001, 0x7FFFFFFF, 0x7FA00000]),
        np.float32([top, min(fmax * 2, 3.4e38), 1e30, 3.3e38, 1.0, 0.5, 2.0 ** -30,
                    2.0 ** -130])])
    rand = RNG.integers(0, 2 ** 32, 20_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    wide = (RNG.standard_normal(20_000) * 10.0 ** RNG.integers(-40, 38, 20_000)).astype(np.float32)
    pos = np.concatenate([near, special, np.abs(rand), np.abs(wide)])
    x = np.concatenate([pos, -pos])
    return x[RNG.permutation(x.size)]


def ref_exponents(x: np.ndarray, bs: int, fmax: float) -> np.ndarray:
    """Per block: smallest e with amax * 2**-e <= max (0 for amax 0), in [-126, 126]."""
    nb = -(-x.size // bs)
    mag = np.where(np.isfinite(x), np.abs(x), 0).astype(np.float64)
    amax = np.array([mag[b * bs:(b + 1) * bs].max() for b in range(nb)])
    with np.errstate(divide="ignore"):
        e = np.where(amax > 0, np.ceil(np.log2(amax / fmax)), 0)
    return np.clip(e, -126, 126).astype(np.int64)


def ref_encode(x: np.ndarray, name: str, exps: np.ndarray | None = None, bs: int = 1) -> np.ndarray:
    """Codes of ``x * 2**-e`` (the product rounded to float32, as the kernels compute it)."""
    nbits, fmax, nan, inf = SPEC[name]
    y = x.copy()
    if exps is not None:
        inv = np.repeat(np.exp2(-exps.astype(np.float64)).astype(np.float32), bs)[:x.size]
        with np.errstate(over="ignore", invalid="ignore"):
            y = (x * inv).astype(np.float32)
    with np.errstate(invalid="ignore"):
        clipped = np.where(np.isfinite(y), np.clip(y, -fmax, fmax), 0).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        codes = clipped.astype(DTYPES[name]).view(np.uint16 if nbits == 16 else np.uint8)
    codes = codes.astype(np.uint32)
    sign = np.signbit(y).astype(np.uint32) << (nbits - 1)
    codes = np.where(np.isnan(y), nan | sign, codes)
    codes = np.where(np.isinf(y), (nan if inf is None else inf) | sign, codes)
    return codes.astype(np.uint16 if nbits == 16 else np.uint8)


def ref_decode(codes: np.ndarray, name: str, scales: np.ndarray | None = None, bs: int = 1,
               acc: np.ndarray | None = None) -> np.ndarray:
    """float32 of the codes (every NaN the quiet NaN of its sign), times the block scale,
    saturated at ±FLT_MAX, added to ``acc`` if given."""
    nbits = SPEC[name][0]
    q = codes.view(DTYPES[name]).astype(np.float32)
    sign = (codes.astype(np.uint32) >> (nbits - 1)) << 31
    q = np.where(np.isnan(q), (sign | 0x7FC00000).view(np.float32), q)
    v = q
    if scales is not None:
        with np.errstate(over="ignore", invalid="ignore"):
            v = (q * np.repeat(scales, bs)[:q.size]).astype(np.float32)
        v = np.where(np.isinf(v) & np.isfinite(q), np.copysign(FLT_MAX, q), v)
    if acc is not None:
        with np.errstate(over="ignore", invalid="ignore"):
            v = (acc + v).astype(np.float32)
    return v.astype(np.float32)


def assert_bits_equal(got: np.ndarray, want: np.ndarray, what: str) -> None:
    g = got.view(np.uint32) if got.dtype == np.float32 else got
    w = want.view(np.uint32) if want.dtype == np.float32 else want
    bad = np.flatnonzero(g != w)
    assert bad.size == 0, f"{what}: {bad.size} differ, e.g. at {bad[:4]}: {g[bad[:4]]} != {w[bad[:4]]}"


VARIANTS = [(name, par, hw) for name in fc.FORMATS for par in (False, True)
            for hw in ((True, False) if name == "fp16" and ck.HW_F16 else (False,))]


def _variant_id(v) -> str:
    name, par, hw = v
    return f"{name}-{'threads' if par else 'serial'}{'-f16c' if hw else ''}"


@pytest.mark.parametrize("variant", VARIANTS, ids=_variant_id)
def test_encoder_unscaled_matches_reference(variant):
    name, par, hw = variant
    f, x = fc.FORMATS[name], edge_inputs(name)
    out = np.empty(x.size, f.code_dtype)
    ck.encoder(f, par, hw)(x, x.size, fc._ONE, False, out)
    assert_bits_equal(out, ref_encode(x, name), _variant_id(variant))


@pytest.mark.parametrize("variant", VARIANTS, ids=_variant_id)
@pytest.mark.parametrize("bs", [7, 256, 3 * ck.TILE + 5, None], ids=lambda b: f"bs{b}")
def test_encoder_scaled_matches_reference(variant, bs):
    """Scales computed by the kernel (``auto``): one per block, or one per chunk (None)."""
    name, par, hw = variant
    f, x = fc.FORMATS[name], edge_inputs(name)
    if bs is not None and bs > x.size:
        x = np.tile(x, -(-bs * 2 // x.size))[:2 * bs + 11]
    bs = x.size if bs is None else bs
    exps = ref_exponents(x, bs, SPEC[name][1])
    scales, out = np.empty(4 * exps.size, np.uint8), np.empty(x.size, f.code_dtype)
    ck.encoder(f, par, hw)(x, bs, scales, True, out)
    assert_bits_equal(scales.view(np.float32), np.exp2(exps).astype(np.float32), "scales")
    assert_bits_equal(out, ref_encode(x, name, exps, bs), _variant_id(variant))


@pytest.mark.parametrize("variant", VARIANTS, ids=_variant_id)
def test_encoder_given_scales_saturates(variant):
    """Scales that are too small for the data (given, not computed): finite values saturate."""
    name, par, hw = variant
    f, x = fc.FORMATS[name], edge_inputs(name)
    bs = 5
    exps = RNG.integers(-126, 127, -(-x.size // bs))
    exps[::3] = 0
    out = np.empty(x.size, f.code_dtype)
    scales = fc.exps_to_scales(exps).view(np.uint8)
    ck.encoder(f, par, hw)(x, bs, scales, False, out)
    assert_bits_equal(out, ref_encode(x, name, exps, bs), _variant_id(variant))


DECODERS = [(name, par, hw) for name in fc.FORMATS for par in (False, True)
            for hw in ((True, False) if name in ("fp16", "e5m2") and ck.HW_F16 else (False,))]


@pytest.mark.parametrize("variant", DECODERS, ids=_variant_id)
@pytest.mark.parametrize("accumulate", [False, True], ids=["write", "accumulate"])
def test_decoder_matches_reference(variant, accumulate):
    """Every code (NaN payloads too), unscaled and with scales up to 2**±126 (saturating);
    accumulating onto ±Inf, NaN, ±3e38 (overflow to ±Inf) and -0.0 as well as finite values."""
    name, par, hw = variant
    f = fc.FORMATS[name]
    every = np.arange(1 << f.nbits).astype(f.code_dtype)
    codes = np.concatenate([every, RNG.integers(0, 1 << f.nbits, 50_000).astype(f.code_dtype)])
    base = RNG.standard_normal(codes.size).astype(np.float32)
    specials = np.float32([np.inf, -np.inf, np.nan, 3e38, -3e38, -0.0])
    base[::97] = np.resize(specials, base[::97].size)    # each one lands on many codes
    kernel = ck.decoder(f, par, hw)
    for bs, scales in [(codes.size, None), (3, fc.exps_to_scales(RNG.integers(-126, 127, -(-codes.size // 3))))]:
        out = base.copy()
        sb = fc._ONE if scales is None else scales.view(np.uint8)
        kernel(codes, bs, sb, accumulate, out)
        want = ref_decode(codes, name, scales, bs, base if accumulate else None)
        if accumulate:
            # NaN + NaN: IEEE 754 returns one of the two NaNs, without saying which (the
            # compiler may swap the operands): either input's bits are right, nothing else
            alone = ref_decode(codes, name, scales, bs)
            both = np.isnan(base) & np.isnan(alone)
            take = both & (out.view(np.uint32) == alone.view(np.uint32))
            want[take] = alone[take]
        assert_bits_equal(out, want, f"{name} bs={bs}")


@pytest.mark.parametrize("name", list(fc.FORMATS))
def test_public_api_all_paths_agree(name, monkeypatch):
    """encode / encode_scaled / decode through the public functions, with numba threads and
    without, and the NumPy fallback: all the same bits as the reference."""
    from lightcc.common.kernels import _threads

    f = fc.FORMATS[name]
    x = np.tile(edge_inputs(name), 3)
    x = x[:max(x.size, 2 * fc.TILE + 3)]
    bs = 256
    exps = ref_exponents(x, bs, SPEC[name][1])
    want = ref_encode(x, name, exps, bs)
    for threads, numba in [(1, True), (2, True), (1, False)]:
        monkeypatch.setattr(_threads, "CODEC_THREADS", threads)
        monkeypatch.setattr(fc, "HAVE_NUMBA", numba)
        what = f"{name} threads={threads} numba={numba}"
        scales, codes = np.empty(4 * exps.size + 1, np.uint8), np.empty(x.size, f.code_dtype)
        fc.encode_scaled(x, f, bs, scales[1:], codes)            # odd offset: unaligned scales
        assert_bits_equal(codes, want, what)
        assert_bits_equal(fc.encode(x, f, exps, bs), want, what)
        got = fc.decode(codes, f, scales[1:], bs)
        assert_bits_equal(got, ref_decode(codes, name, np.exp2(exps).astype(np.float32), bs), what)


def test_scale_exponents_in_kernel_match_numpy():
    """The kernels' per-block exponent (integer, from the bits) equals scale_exponents."""
    amax = np.concatenate([
        _bits([1, 2, 0x007FFFFF, 0x00800000, 0x7F7FFFFF]),
        RNG.integers(1, 0x7F800000, 20_000, dtype=np.uint32).view(np.float32),
        (448.0 * np.exp2(RNG.integers(-140, 120, 2000))).astype(np.float32)])
    amax = amax[np.isfinite(amax) & (amax > 0)]
    for f in fc.FORMATS.values():
        scales, out = np.empty(4 * amax.size, np.uint8), np.empty(amax.size, f.code_dtype)
        ck.encoder(f, False)(amax, 1, scales, True, out)
        want = fc.exps_to_scales(fc.scale_exponents(amax, f.max))
        assert_bits_equal(scales.view(np.float32), want, f.name)


@pytest.mark.parametrize("name", list(fc.FORMATS))
def test_decode_ignores_flush_to_zero(name):
    """Subnormal codes decode with integer operations: a thread that flushes denormals (torch's
    set_flush_denormal) gets the same values, so ranks cannot disagree because of it."""
    torch = pytest.importorskip("torch")
    f = fc.FORMATS[name]
    codes = np.arange(1 << f.nbits).astype(f.code_dtype)
    want = fc.decode(codes, f)
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        got = fc.decode(codes, f)
    finally:
        torch.set_flush_denormal(False)
    if name == "bf16":     # bf16 subnormals are float32 subnormals: only the normal codes count
        normal = np.abs(want) >= np.finfo(np.float32).tiny
        got, want = got[normal | ~np.isfinite(want)], want[normal | ~np.isfinite(want)]
    assert_bits_equal(got, want, name)


def test_every_kernel_releases_the_gil():
    """The codecs and TopK kernels run beside the training thread: all compiled nogil."""
    from lightcc.common.kernels import sparse

    kernels = [ck.block_amax_kernel(par) for par in (False, True)]
    kernels += [make(f, par) for f in fc.FORMATS.values() for par in (False, True)
                for make in (ck.encoder, ck.decoder)]
    kernels += [*sparse._COUNT.values(), sparse._GATHER, sparse._gather_upto,
                sparse._above_then_ties, sparse._scatter_add]
    assert all(k.targetoptions.get("nogil") for k in kernels)
