"""Compression kernels and compressors in one process (no MPI)."""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from lightcc.common import compression
from lightcc.common.compression.api import Compression, CompressionSpec, spec_of
from lightcc.common.compression.base import BucketContext
from lightcc.common.compression.memory import ResidualMemory
from lightcc.common.compression.powersgd import matrix_shape
from lightcc.common.exceptions import ConfigError
from lightcc.common.kernels import ef_topk as eft
from lightcc.common.kernels import floatcast as fc
from lightcc.common.kernels import sparse

REF = {"fp16": np.float16, "bf16": ml_dtypes.bfloat16, "e4m3": ml_dtypes.float8_e4m3fn,
       "e5m2": ml_dtypes.float8_e5m2}
RNG = np.random.default_rng(7)
WIDE = (RNG.standard_normal(50_000) * 10.0 ** RNG.integers(-45, 38, 50_000)).astype(np.float32)
SPECIAL = np.array([0.0, -0.0, 1e-45, -1e-40, 1e-38, 3.4e38, -3.4e38, 65504, 65519, 65520,
                    448, 464, 57344, 61440, 1.0, -1.0], np.float32)
EXTREMES = {"huge": np.float32([3.3e38, -3.4e38, 1e38, -2e37]),
            "tiny": np.float32([1e-30, -1e-33, 2e-38, -1.5e-38]),
            "denormal": np.float32([1e-45, -1e-42, 5e-40, -1.1e-38]),
            "zero": np.float32([0.0, -0.0, 0.0, 0.0]),
            "mixed": np.float32([3e38, -1e-40, 1.0, -65536.0])}


class LoopbackComm:
    """A stand-in for ``size`` ranks that all hold this rank's data (sum = size * x)."""

    def __init__(self, size: int = 2) -> None:
        self.rank, self.size, self.name, self.is_device = 0, size, "loop", False

    def allreduce(self, buf, op="sum"):
        buf *= self.size

    def allgatherv(self, sendbuf, recvbuf, counts):
        recvbuf[:] = np.tile(sendbuf, self.size)

    def alltoallv(self, sendbuf, sendcounts, recvbuf, recvcounts):
        recvbuf[:] = np.tile(sendbuf[:recvcounts[0]], self.size)


def _reference_codes(x, f):
    y = np.where(np.isfinite(x), np.clip(x, -f.max, f.max), x)
    return y.astype(REF[f.name]).view(f.code_dtype)


@pytest.mark.parametrize("name", list(fc.FORMATS))
def test_encode_matches_reference_cast_bitwise(name):
    f = fc.FORMATS[name]
    x = np.concatenate([WIDE, SPECIAL, -SPECIAL])
    got, want = fc.encode(x, f), _reference_codes(x, f)
    same = (f.lut[got] == f.lut[want]) | (np.isnan(f.lut[got]) & np.isnan(f.lut[want]))
    assert same.all(), (x[~same][:5], got[~same][:5], want[~same][:5])


@pytest.mark.parametrize("name", list(fc.FORMATS))
def test_lut_matches_ml_dtypes(name):
    f = fc.FORMATS[name]
    codes = np.arange(1 << f.nbits).astype(f.code_dtype)
    want = codes.view(REF[name]).astype(np.float32)
    assert ((f.lut == want) | (np.isnan(f.lut) & np.isnan(want))).all()


@pytest.mark.parametrize("name", list(fc.FORMATS))
def test_numpy_fallback_gives_same_bits(name, monkeypatch):
    f = fc.FORMATS[name]
    ex = fc.scale_exponents(fc.block_amax(WIDE, 100), f.max) if f.nbits == 8 else None
    bs = 100 if ex is not None else None
    fast = fc.encode(WIDE, f, ex, bs)
    scales = fc.exps_to_scales(ex) if ex is not None else None
    dec = fc.decode(fast, f, scales, bs)
    monkeypatch.setattr(fc, "HAVE_NUMBA", False)
    assert np.array_equal(fc.encode(WIDE, f, ex, bs), fast)
    assert np.array_equal(fc.decode(fast, f, scales, bs).view(np.int32), dec.view(np.int32))


# relative round-trip error bound (half an ulp) and spec per format
BOUNDS = {"fp16": ("fp16", 2.0 ** -11), "bf16": ("bf16", 2.0 ** -8),
          "fp8": ("e4m3", 2.0 ** -4), "fp8:e4m3:block:32": ("e4m3", 2.0 ** -4),
          "fp8_e5m2": ("e5m2", 2.0 ** -3), "fp8:e5m2:block:32": ("e5m2", 2.0 ** -3)}


def _roundtrip(spec, x):
    codec = compression.make(spec).codec
    payload = np.empty(codec.nbytes(x.size), np.uint8)
    codec.encode_into(x, payload)
    out = np.zeros(x.size, np.float32)
    codec.decode_into(payload, x.size, out, False)
    return out


@pytest.mark.parametrize("spec", list(BOUNDS))
def test_roundtrip_error_bound(spec):
    fmt, rel = BOUNDS[spec]
    x = (RNG.standard_normal(4096) * np.exp(RNG.uniform(-3, 3, 4096))).astype(np.float32)
    y = _roundtrip(spec, x)
    f = fc.FORMATS[fmt]
    if f.nbits == 8:   # values under the scaled subnormal range lose absolute, not relative, precision
        bs = 32 if "block" in spec else x.size
        amax = np.repeat(fc.block_amax(x, bs), bs)[:x.size].astype(np.float64)
        floor = amax / f.max * 2.0 ** (1 - f.bias - f.mbits)   # one subnormal step, scaled
    else:
        floor = 2.0 ** (1 - f.bias - f.mbits)
    err = np.abs(y.astype(np.float64) - x)
    assert (err <= rel * np.abs(x) + floor).all(), err.max()
    assert np.abs(y - x).max() > 0          # it is lossy (the test can see an error)


@pytest.mark.parametrize("spec", list(BOUNDS))
@pytest.mark.parametrize("kind", list(EXTREMES))
def test_no_nan_or_inf_from_finite_input(spec, kind):
    x = np.tile(EXTREMES[kind], 64)
    y = _roundtrip(spec, x)
    assert np.isfinite(y).all(), (kind, y[~np.isfinite(y)])
    assert (np.sign(y) * np.sign(x) >= 0).all()          # never flips a sign
    with np.errstate(over="ignore"):
        assert (np.abs(y) <= np.abs(x) * 1.3 + 1e-30).all()  # saturates, never blows up


@pytest.mark.parametrize("spec", list(BOUNDS))
def test_nan_and_inf_propagate(spec):
    x = np.float32([1.0, np.nan, 2.0, np.inf, -np.inf, 3.0] * 50)
    y = _roundtrip(spec, x)
    assert np.isnan(y[1::6]).all()
    assert (~np.isfinite(y[3::6])).all() and (~np.isfinite(y[4::6])).all()
    assert np.isfinite(y[0::6]).all() and np.isfinite(y[5::6]).all()
    if spec in ("fp16", "bf16", "fp8_e5m2"):
        assert (y[3::6] == np.inf).all() and (y[4::6] == -np.inf).all()


def test_scale_exponents_are_tight():
    amax = np.float32([448.0, 448.1, 1.0, 0.0, 3.3e38, 1e-45])
    e = fc.scale_exponents(amax, 448.0)
    assert list(e[:4]) == [0, 1, -8, 0]
    assert (amax * 2.0 ** -e.astype(float) <= 448).all()
    assert (amax[:3] * 2.0 ** -(e[:3] - 1.0) > 448).all()


# ---- topk ------------------------------------------------------------------------------------
@pytest.mark.parametrize("n,k", [(10, 3), (1000, 1), (200_000, 2000), (200_000, 60_000)])
def test_topk_indices_exact(n, k):
    x = RNG.standard_normal(n).astype(np.float32)
    idx = sparse.topk_indices(x, k)
    assert idx.size == k and np.all(np.diff(idx) > 0)
    kth = np.sort(np.abs(x))[-k]
    assert (np.abs(x[idx]) >= kth).all()


def _topk_reference(x: np.ndarray, k: int) -> np.ndarray:
    key = np.abs(x).astype(np.float64)
    key[np.isnan(key)] = np.inf
    return np.sort(np.argsort(-key, kind="stable")[:k])


@pytest.mark.parametrize("nonzero", [0.002, 0.0099, 0.0101, 0.03, 0.2])
@pytest.mark.parametrize("numba", [True, False])
def test_topk_sparse_input_with_ties(nonzero, numba, monkeypatch):
    """Mostly-zero input (ties at the sampled threshold): exact k, same as the reference."""
    if not numba:
        monkeypatch.setattr(sparse, "HAVE_NUMBA", False)
    n, k = 400_000, 4000
    x = np.zeros(n, np.float32)
    where = RNG.choice(n, int(nonzero * n), replace=False)
    x[where] = RNG.choice([2.0, -2.0, 1.0], where.size)
    x[where[:3]] = [np.nan, np.inf, 3.0] if where.size > 3 else x[where[:3]]
    idx = sparse.topk_indices(x, k)
    np.testing.assert_array_equal(idx, _topk_reference(x, k))


def test_topk_prefers_nonfinite_and_breaks_ties_by_index():
    x = np.ones(300_000, np.float32)
    x[[5, 7, 9]] = [np.nan, np.inf, -np.inf]
    idx = sparse.topk_indices(x, 10)
    assert list(idx) == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert {5, 7, 9} <= set(sparse.topk_indices(x, 3).tolist())


def _ctx(sizes, base=0, names=None):
    names = names or tuple(f"t{i}" for i in range(len(sizes)))
    offsets = tuple(int(o) for o in np.cumsum((0,) + tuple(sizes[:-1])))
    return BucketContext(names, offsets, tuple(sizes), base, 0)


def test_error_feedback_identity_over_steps():
    comp = compression.make("topk:0.05")
    ctx = _ctx((300, 700))
    residual = np.zeros(1000, np.float32)
    for step in range(4):
        g = RNG.standard_normal(1000).astype(np.float32)
        acc = g + residual
        buf = g.copy()
        idx, vals = comp.compress(buf, ctx)
        assert idx.size == math.ceil(0.05 * 1000)
        sent = np.zeros(1000, np.float32)
        sent[idx] = vals
        residual = np.concatenate([comp.memory.residuals["t0"], comp.memory.residuals["t1"]])
        assert np.array_equal(sent + residual, acc)           # sent + residual == accumulated
        assert np.count_nonzero(residual[idx]) == 0


def test_residuals_follow_tensor_names_across_slices():
    """A bucket split in two slices (ctx.base) stores and finds the same per-tensor residual."""
    mem = ResidualMemory()
    full = _ctx((5, 10, 5))
    mem.store(np.arange(20, dtype=np.float32), full)
    left, right = np.zeros(8, np.float32), np.zeros(12, np.float32)
    mem.add_to(left, full.sub(0))
    mem.add_to(right, full.sub(8))
    assert np.array_equal(np.concatenate([left, right]), np.arange(20, dtype=np.float32))
    other = _ctx((10,), names=("t1",))          # t1 alone in another bucket layout
    buf = np.zeros(10, np.float32)
    mem.add_to(buf, other)
    assert np.array_equal(buf, np.arange(5, 15, dtype=np.float32))


@pytest.mark.parametrize("spec", ["topk:0.02", "powersgd:2"])
def test_state_dict_round_trip(spec):
    comm = LoopbackComm(2)
    a = compression.make(spec)
    ctx = _ctx((1500, 2600))
    for _ in range(2):
        a.allreduce(comm, RNG.standard_normal(4100).astype(np.float32), ctx)
    b = compression.make(spec)
    b.load_state_dict(a.state_dict())
    g = RNG.standard_normal(4100).astype(np.float32)
    ga, gb = g.copy(), g.copy()
    a.allreduce(comm, ga, ctx)
    b.allreduce(comm, gb, ctx)
    assert np.array_equal(ga, gb)
    fresh = compression.make(spec)
    gc = g.copy()
    fresh.allreduce(comm, gc, ctx)
    assert not np.array_equal(ga, gc)       # the state mattered


# ---- wire bytes ------------------------------------------------------------------------------
@pytest.mark.parametrize("spec,bpe,unit", [("fp16", 2, 0), ("bf16", 2, 0), ("fp8", 1, 1 << 16),
                                           ("fp8:e4m3:block:256", 1, 256)])
@pytest.mark.parametrize("sizes", [(4096,), (70_000, 300, 1000, 131_072)])
def test_two_phase_wire_formula(spec, bpe, unit, sizes):
    """``2 (p-1)/p (N bpe + 4 u)``: u scales, one per ``unit`` elements of each tensor (the
    chunks and pieces never cut a scaling block, so they add none)."""
    comp = compression.make(spec)
    n, p = sum(sizes), 4
    ctx = _ctx(sizes)
    units = sum(-(-s // unit) for s in sizes) if unit else 0
    want = 2 * (p - 1) * (n * bpe + 4 * units) // p
    assert comp.wire_bytes(n, p, ctx) == want
    assert comp.wire_bytes(n, 1, ctx) == 0
    assert sum(comp.rank_wire_bytes(n, p, r, ctx) for r in range(p)) // p == \
        comp.wire_bytes(n, p, ctx)


def test_topk_and_powersgd_wire_formula():
    assert compression.make("topk:0.01").wire_bytes(100_000, 4) == 8 * 1000 * 3
    comp = compression.make("powersgd:2")
    rows, cols = matrix_shape(10_000)
    assert (rows, cols) == (100, 100)
    assert comp.wire_bytes(10_000, 2) == 4 * 2 * rows + 4 * 2 * cols + 1  # + finiteness flag
    assert comp.wire_bytes(10, 2) == 40          # not worth it: plain allreduce


# ---- specs and the public namespace ----------------------------------------------------------
def test_make_names_and_options():
    assert compression.make("none") is None
    names = {s: compression.make(s).name for s in
             ["fp16", "bf16", "fp8", "fp8_e5m2", "fp8:e5m2:block:128", "fp8:64", "topk",
              "topk:0.1:noef", "powersgd", "powersgd:4:nowarm"]}
    assert names == {"fp16": "fp16", "bf16": "bf16", "fp8": "fp8:e4m3:bucket",
                     "fp8_e5m2": "fp8:e5m2:bucket", "fp8:e5m2:block:128": "fp8:e5m2:block:128",
                     "fp8:64": "fp8:e4m3:block:64", "topk": "topk:0.01:ef",
                     "topk:0.1:noef": "topk:0.1:noef", "powersgd": "powersgd:2",
                     "powersgd:4:nowarm": "powersgd:4:nowarm"}
    for name in names.values():               # a compressor's name is a spec for the same thing
        assert compression.make(name).name == name
    for bad in ["fp16:x", "fp8:e3m4", "topk:abc", "topk:0", "powersgd:x", "zip"]:
        with pytest.raises(ValueError):
            compression.make(bad)


def test_compression_namespace():
    assert Compression.none.spec == "none" and str(Compression.fp16) == "fp16"
    assert Compression.bf16.spec == "bf16"
    assert Compression.fp8().spec == "fp8:e4m3:bucket"
    assert Compression.fp8("e5m2", "block", 128).spec == "fp8:e5m2:block:128"
    assert Compression.topk().spec == "topk:0.01:ef"
    assert Compression.topk(0.05, error_feedback=False).spec == "topk:0.05:noef"
    assert Compression.powersgd(rank=4).spec == "powersgd:4"
    assert Compression.fp8() == CompressionSpec("fp8:e4m3:bucket")   # frozen, comparable
    with pytest.raises(AttributeError):
        Compression.fp16.spec = "bf16"
    for value in (Compression.none, Compression.fp16, Compression.bf16, Compression.fp8(),
                  Compression.topk(), Compression.powersgd()):
        comp = compression.make(value.spec)
        assert comp is None if value.spec == "none" else comp.name == value.spec
    assert spec_of(None) == "none" and spec_of("FP16") == "fp16"
    with pytest.raises(ConfigError):
        Compression.fp8("e4m4")
    with pytest.raises(ConfigError):
        spec_of(42)


def test_powersgd_warm_start_key_does_not_depend_on_the_bucket_layout():
    from lightcc.common.compression.base import BucketContext
    from lightcc.common.compression.powersgd import PowerSGDCompressor

    c = PowerSGDCompressor(rank=2)
    one = BucketContext(("a", "b"), (0, 64), (64, 100), 0, 0, ((8, 8), (10, 10)))
    two = BucketContext(("b", "a"), (0, 100), (100, 64), 0, 0, ((10, 10), (8, 8)))
    keys = [{p.name: c._key(p, ctx) for p in c.plan(164, ctx) if p.name}
            for ctx in (one, two)]
    assert keys[0] == keys[1] == {"a": "a@0:64", "b": "b@0:100"}


# ---- error feedback and top-k in one pass ----------------------------------------------------
@pytest.mark.parametrize("n,k,kind", [(1000, 7, "normal"), (400_000, 4000, "normal"),
                                      (400_000, 4000, "ties"), (400_000, 4000, "nonfinite"),
                                      (400_000, 4000, "zeros"), (400_000, 400_000, "normal"),
                                      (400_000, 0, "normal"), (200_000, 3, "heavy")])
@pytest.mark.parametrize("numba", [True, False])
def test_ef_topk_matches_the_separate_steps(n, k, kind, numba, monkeypatch):
    """One pass per tensor: each part's exact top k of (gradient + residual), whatever the
    other parts hold; the residual keeps the rest, the gradient buffer is zeroed."""
    if not numba:
        monkeypatch.setattr(sparse, "HAVE_NUMBA", False)
    g = RNG.standard_normal(n).astype(np.float32)
    r = (0.5 * RNG.standard_normal(n)).astype(np.float32)
    if kind in ("ties", "zeros"):            # mostly zeros: ties at the sampled threshold
        g[:] = 0.0
        r[:] = 0.0
        if kind == "ties":
            where = RNG.choice(n, 3000, replace=False)
            g[where] = RNG.choice([2.0, -2.0, 1.0], where.size)
    elif kind == "nonfinite":
        g[[3, 50_000, 399_999]] = [np.nan, np.inf, -np.inf]
    elif kind == "heavy":                    # heavy tails: the sample sees few of the top k
        g = (RNG.standard_t(1.5, n) * 10.0 ** RNG.integers(-3, 3, n)).astype(np.float32)
    acc = g + r                                # float32, as the separate steps compute it
    for cuts in ([], [1, 1000 if n > 1000 else 2, n // 2]):   # one tensor, or several
        bounds = [0, *cuts, n]
        ks = [k] if not cuts else [max(1, -(-k * (b - a) // n)) for a, b in zip(bounds,
                                                                                 bounds[1:])]
        want = np.concatenate([_topk_reference(acc[a:b], kk) + a
                               for (a, b), kk in zip(zip(bounds, bounds[1:]), ks)])
        left = acc.copy()
        left[want] = 0.0
        buf, res = g.copy(), r.copy()
        parts = res if not cuts else [(a, res[a:b]) for a, b in zip(bounds, bounds[1:])]
        idx, vals = eft.ef_topk(buf, parts, ks[0] if not cuts else ks)
        np.testing.assert_array_equal(idx, want)
        np.testing.assert_array_equal(vals, acc[want])
        np.testing.assert_array_equal(res, left)
        assert not buf.any()


@pytest.mark.parametrize("sizes", [(300_000,), (100_000, 7, 150_000, 60_000), (500,)])
@pytest.mark.parametrize("ef", [True, False])
def test_topk_allreduce_matches_numpy_error_feedback(sizes, ef):
    """TopK per tensor (one pass with error feedback through kernels/ef_topk.py; without,
    topk_indices per tensor): the sum and the residuals follow TopK computed tensor by
    tensor, step by step in NumPy."""
    from tests.doubles.fake_nccl import run_ranks, thread_worlds

    p, n, steps = 2, sum(sizes), 3
    comps = [compression.make("topk:0.01" + ("" if ef else ":noef")) for _ in range(p)]
    ctx = _ctx(sizes)
    worlds = thread_worlds(p)
    residual = [np.zeros(n, np.float32) for _ in range(p)]
    for step in range(steps):
        grads = [RNG.standard_normal(n).astype(np.float32) for _ in range(p)]
        want = np.zeros(n, np.float32)
        for r in range(p):
            acc = grads[r] + residual[r] if ef else grads[r].copy()
            for lo, size in zip(ctx.offsets, sizes):
                idx = lo + _topk_reference(acc[lo:lo + size], math.ceil(0.01 * size))
                np.add.at(want, idx, acc[idx])
                acc[idx] = 0.0
            residual[r] = acc
        bufs = [g.copy() for g in grads]
        run_ranks(p, lambda r: comps[r].allreduce(worlds[r], bufs[r], ctx))
        for r in range(p):
            np.testing.assert_array_equal(bufs[r], want)
            if ef:
                kept = np.concatenate([comps[r].memory.residuals[name] for name in ctx.names])
                np.testing.assert_array_equal(kept, residual[r])
        assert comps[0].wire_bytes(n, p, ctx) == \
            8 * (p - 1) * sum(math.ceil(0.01 * s) for s in sizes)


@pytest.mark.parametrize("spec", ["topk:0.01", "topk:0.02:noef", "fp8", "fp8:e4m3:block:64",
                                  "fp8_e5m2", "bf16", "powersgd:2", "powersgd:1:noef"])
@pytest.mark.parametrize("piece_bytes", [None, 20_000])
def test_tensor_result_does_not_depend_on_its_bucket(spec, piece_bytes, monkeypatch):
    """A tensor's sum (and error-feedback residual) is the same, bit for bit, whether it is
    reduced alone or fused with other tensors before or after it, on 3 ranks; with
    ``piece_bytes`` the two-phase scheme is also pipelined (pieces of that many fp32 bytes).
    PowerSGD: one step has a non-finite gradient in tensor 'c' (it goes dense alone)."""
    from lightcc.common.compression import twophase
    from tests.doubles.fake_nccl import run_ranks, thread_worlds

    if piece_bytes is not None:
        if not spec.startswith(("fp", "bf")):
            pytest.skip("pieces are the two-phase scheme's")
        monkeypatch.setattr(twophase, "PIECE_BYTES", piece_bytes)
    p = 3
    shapes = {"a": (200, 200), "b": (1_500,), "c": (300, 300), "d": (70_000,)}
    scale = {"a": 1.0, "b": 1e-4, "c": 30.0, "d": 1e-3}     # magnitudes differ by tensor
    layouts = [("a",), ("b",), ("c",), ("d",), ("a", "b", "c", "d"), ("c", "a"), ("b", "d", "c")]
    got: dict = {}
    for layout in layouts:
        comps = [compression.make(spec) for _ in range(p)]
        worlds = thread_worlds(p)
        sizes = tuple(math.prod(shapes[t]) for t in layout)
        offsets = tuple(int(o) for o in np.cumsum((0,) + sizes[:-1]))
        ctx = BucketContext(layout, offsets, sizes, 0, 0, tuple(shapes[t] for t in layout))
        for step in range(3):
            grads = [np.concatenate([(scale[t] * np.random.default_rng([step, r, ord(t)])
                                      .standard_normal(math.prod(shapes[t]))).astype(np.float32)
                                     for t in layout]) for r in range(p)]
            if step == 1 and "c" in layout and spec.startswith("powersgd"):
                grads[1][offsets[layout.index("c")] + 5] = np.inf
            run_ranks(p, lambda r: comps[r].allreduce(worlds[r], grads[r], ctx))
        for t, lo, size in zip(layout, offsets, sizes):
            res = getattr(comps[0], "memory", None)
            res = None if res is None else res.residuals.get(t)
            got.setdefault(t, []).append((grads[0][lo:lo + size].tobytes(),
                                          None if res is None else res.tobytes()))
    for t, runs in got.items():
        assert all(run == runs[0] for run in runs), f"{spec}: tensor {t} depends on its bucket"


def _parts_against_packed(spec: str, p: int, sizes: tuple, steps: int, check=None) -> None:
    """Run ``spec`` on ``p`` thread ranks for ``steps`` steps, once on packed buckets and once
    on the same tensors unpacked (allreduce_parts); assert the results are equal bit for bit
    and call ``check(r, packed, parted, ctx)`` per rank and ``check(None, grads, bufs, ctx)``
    per step."""
    from tests.doubles.fake_nccl import run_ranks, thread_worlds

    ctx = _ctx(sizes)
    starts = list(ctx.offsets)
    packed = [compression.make(spec) for _ in range(p)]
    parted = [compression.make(spec) for _ in range(p)]
    assert all(c.takes_parts for c in parted)
    w1, w2 = thread_worlds(p), thread_worlds(p)
    for _ in range(steps):
        grads = [RNG.standard_normal(sum(sizes)).astype(np.float32) for _ in range(p)]
        bufs = [g.copy() for g in grads]
        run_ranks(p, lambda r: packed[r].allreduce(w1[r], bufs[r], ctx))
        tensors = [[g[a:a + s].copy() for a, s in zip(starts, sizes)] for g in grads]
        run_ranks(p, lambda r: parted[r].allreduce_parts(
            w2[r], list(zip(starts, tensors[r])), ctx))
        for r in range(p):
            np.testing.assert_array_equal(np.concatenate(tensors[r]), bufs[r])
            if check is not None:
                check(r, packed[r], parted[r], ctx)
        if check is not None:
            check(None, grads, bufs, ctx)


def test_topk_parts_equal_the_packed_bucket_bitwise():
    """allreduce_parts on a bucket's tensors (never packed) gives the packed allreduce's
    sums and residuals, bit for bit, step after step."""
    assert not compression.make("topk:0.01:noef").takes_parts

    def same_residuals(r, packed, parted, ctx):
        for name in ctx.names if r is not None else ():
            np.testing.assert_array_equal(parted.memory.residuals[name],
                                          packed.memory.residuals[name])

    _parts_against_packed("topk:0.01", 3, (50_000, 3, 120_000, 9_000), 3, same_residuals)


@pytest.mark.parametrize("spec", ["fp16", "bf16", "fp8"])
@pytest.mark.parametrize("piece_bytes", [None, 4096])      # collective / pipelined scheme
def test_twophase_parts_equal_the_packed_bucket_bitwise(spec, piece_bytes, monkeypatch):
    """The two-phase formats on a bucket's tensors in their own memory (allreduce_parts, never
    packed) give the packed bucket's results bit for bit, in both schemes, with chunks and
    pieces that cut tensors; fp16 also against a NumPy reference of the format's sum."""
    from lightcc.common.compression import twophase

    if piece_bytes:
        monkeypatch.setattr(twophase, "PIECE_BYTES", piece_bytes)

    def fp16_sum(r, grads, bufs, ctx):
        if r is None and spec == "fp16":
            total = np.zeros(bufs[0].size, np.float32)
            for g in grads:                       # rank order, fp32 sums of fp16 values
                total += g.astype(np.float16).astype(np.float32)
            np.testing.assert_array_equal(bufs[0], total.astype(np.float16).astype(np.float32))

    _parts_against_packed(spec, 3, (5_000, 3, 12_001, 900, 7), 2, fp16_sum)


def test_ordered_sum_is_rank_order_and_independent_of_offset():
    """LCC_DETERMINISTIC's exact two-phase sum: every element is 0 + x0 + x1 + x2 in float32
    (NumPy, in rank order), whatever its offset in the bucket and in both schemes."""
    from lightcc.common.compression import twophase
    from lightcc.common.compression.fp import ordered_sum
    from tests.doubles.fake_nccl import run_ranks, thread_worlds

    p, n = 3, 300_001
    rng = np.random.default_rng(7)
    xs = [(rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4, n)).astype(np.float32)
          for _ in range(p)]
    want = np.zeros(n, np.float32)
    for x in xs:
        want += x
    for shift, piece in ((0, twophase.PIECE_BYTES), (12_345, twophase.PIECE_BYTES), (7, 4096)):
        comps, worlds = [ordered_sum() for _ in range(p)], thread_worlds(p)
        bufs = [np.concatenate([np.ones(shift, np.float32), x]) for x in xs]
        saved, twophase.PIECE_BYTES = twophase.PIECE_BYTES, piece
        try:
            run_ranks(p, lambda r: comps[r].allreduce(worlds[r], bufs[r], _ctx((bufs[r].size,))))
        finally:
            twophase.PIECE_BYTES = saved
        for b in bufs:
            np.testing.assert_array_equal(b[shift:], want)
