"""``allreduce(op=Adasum)`` against the formula computed here in NumPy (run under mpirun -np N).

The reference is the recursive definition (Horovod's docs, the Adasum paper): the ranks' tensors
split in two halves of consecutive ranks, each half reduced recursively, the two results combined
by ``(1 - a.b/2|a|^2) a + (1 - a.b/2|b|^2) b`` (a coefficient stays 1 below Horovod's
``sqrt(DBL_MIN)`` norm), per tensor, in float64 from the values each rank sent. Every rank builds
every rank's inputs from seeds, so it checks the whole result. Inputs share a common direction
(``g_r = c + 0.5 noise_r``) so Adasum differs clearly from a sum or an average (coefficients
~0.6). At a size that is not a power of two every call must fail on every rank, and the engine
must keep working.

argv[1]: "fused" (tensors submitted together and fused) or "unfused" (LCC_FUSION_THRESHOLD=0
is set by the test).
"""
from __future__ import annotations

import math
import sys

import numpy as np

import lightcc as lcc
from lightcc import InvalidArgumentError, UnsupportedDTypeError
from lightcc.common import dtypes

MODE = sys.argv[1]
lcc.init()
R, N = lcc.rank(), lcc.size()
TINY = math.sqrt(np.finfo(np.float64).tiny)
POW2 = N & (N - 1) == 0
# rtol on max|ref| (measured at 2 and 4 ranks: float64 6e-16, float32 6e-8, float16 3.8e-4,
# bfloat16 2.9e-3): float64/32 round once per level; 16-bit floats are reduced in float32 and
# rounded once at the end (the reference starts from the same 16-bit inputs)
TOL = {"float64": 1e-13, "float32": 5e-7, "float16": 1e-3, "bfloat16": 8e-3}
SIZES = [1, 2, 7, 1003, 70_001]


def ref_pair(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    dot, aa, bb = float(a @ b), float(a @ a), float(b @ b)
    ca = 1.0 - dot / (2 * aa) if aa >= TINY else 1.0
    cb = 1.0 - dot / (2 * bb) if bb >= TINY else 1.0
    return ca * a + cb * b


def ref_adasum(vectors: list[np.ndarray]) -> np.ndarray:
    if len(vectors) == 1:
        return vectors[0]
    half = len(vectors) // 2
    return ref_pair(ref_adasum(vectors[:half]), ref_adasum(vectors[half:]))


def inputs(rank: int, case: int, size: int, dtype: str) -> np.ndarray:
    common = np.random.default_rng(1000 + case).standard_normal(size)
    noise = np.random.default_rng(10_000 * case + rank).standard_normal(size)
    return (common + 0.5 * noise).astype(dtypes.SUPPORTED[dtype])


def check(got: np.ndarray, want: np.ndarray, dtype: str, what: str) -> None:
    got64 = np.asarray(got, dtype=np.float64).reshape(-1)
    scale = max(float(np.abs(want).max(initial=0.0)), 1e-30)
    err = float(np.abs(got64 - want).max(initial=0.0)) / scale
    assert err <= TOL[dtype], f"rank {R} {what}: relative error {err:.3g} > {TOL[dtype]}"
    # one rank's result is everyone's, bit for bit
    everyone = lcc.allgather(np.ascontiguousarray(got).reshape(1, -1), name=f"same.{what}")
    assert (everyone.view(np.uint8) == everyone[:1].view(np.uint8)).all(), f"{what} differs"


def run_cases() -> None:
    case = 0
    for dtype in ("float32", "float64", "float16", "bfloat16"):
        # several tensors of one dtype in flight together: fused unless the threshold is 0
        tensors = [(case + i, size) for i, size in enumerate(SIZES)]
        case += len(SIZES)
        mine = [inputs(R, c, s, dtype) for c, s in tensors]
        handles = [lcc.allreduce_async(x, op=lcc.Adasum, name=f"{dtype}.{c}")
                   for x, (c, _) in zip(mine, tensors)]
        for h, (c, s) in zip(handles, tensors):
            want = ref_adasum([inputs(r, c, s, dtype).astype(np.float64) for r in range(N)])
            check(lcc.synchronize(h), want, dtype, f"{dtype}.{c}")
    # pre/postscale multiply before and after (Adasum is homogeneous: the product counts)
    x = inputs(R, 99, 513, "float64")
    got = lcc.allreduce(x, op=lcc.Adasum, name="scaled", prescale_factor=0.5,
                        postscale_factor=3.0)
    check(got, 1.5 * ref_adasum([inputs(r, 99, 513, "float64") for r in range(N)]),
          "float64", "scaled")
    # limiting cases: identical vectors average, orthogonal ones add, a zero one is neutral
    same = np.arange(1.0, 6.0)
    check(lcc.allreduce(same, op=lcc.Adasum, name="parallel"), same, "float64", "parallel")
    e = np.zeros(N)
    e[R] = R + 1.0
    check(lcc.allreduce(e, op=lcc.Adasum, name="orth"), np.arange(1.0, N + 1), "float64",
          "orth")
    z = np.zeros(4) if R == 0 else np.full(4, 2.0)
    zero_want = ref_adasum([np.zeros(4)] + [np.full(4, 2.0)] * (N - 1))
    check(lcc.allreduce(z, op=lcc.Adasum, name="zero"), zero_want, "float64", "zero")
    # a squared norm under sqrt(DBL_MIN) keeps its coefficient at 1 (Horovod's guard)
    tiny = np.full(4, 1e-160) if R == 0 else np.ones(4)
    tiny_want = ref_adasum([np.full(4, 1e-160)] + [np.ones(4)] * (N - 1))
    check(lcc.allreduce(tiny, op=lcc.Adasum, name="tiny"), tiny_want, "float64", "tiny")
    # unnamed blocking calls (the engine, not the direct path) and in-place output
    y = inputs(R, 77, 33, "float32")
    out = y.copy()
    res = lcc.allreduce(out, op=lcc.Adasum, out=out)
    assert res is out
    check(out, ref_adasum([inputs(r, 77, 33, "float32").astype(np.float64) for r in range(N)]),
          "float32", "unnamed")


def expect(exc_type, fn, *needles) -> None:
    try:
        fn()
    except exc_type as exc:
        for needle in needles:
            assert needle in str(exc), f"{needle!r} not in {exc}"
        return
    raise AssertionError(f"rank {R}: expected {exc_type.__name__}")


def works(tag: str) -> None:
    got = lcc.allreduce(np.full(3, float(R)), op=lcc.Sum, name=f"after.{tag}")
    assert np.allclose(got, sum(range(N))), got


def run_errors() -> None:
    expect(UnsupportedDTypeError, lambda: lcc.allreduce(np.ones(3, np.int32), op=lcc.Adasum,
                                                        name="int"), "floating-point", "int32")
    expect(InvalidArgumentError, lambda: lcc.allreduce(np.ones(3, np.float32), op=lcc.Adasum,
                                                       compression="fp16", name="comp"),
           "compression")
    expect(InvalidArgumentError, lambda: lcc.reducescatter(np.ones(4), op=lcc.Adasum),
           "allreduce only")
    works("errors")


def run_process_sets() -> None:
    """A set of 2 ranks reduces over its members only; a set of 3 refuses."""
    pair = lcc.add_process_set([0, N - 1])
    if R in (0, N - 1):
        x = inputs(R, 55, 301, "float32")
        got = lcc.allreduce(x, op=lcc.Adasum, name="pset", process_set=pair)
        want = ref_adasum([inputs(r, 55, 301, "float32").astype(np.float64) for r in (0, N - 1)])
        err = np.abs(got.astype(np.float64) - want).max() / np.abs(want).max()
        assert err <= TOL["float32"], err
    if N >= 4:
        three = lcc.add_process_set([0, 1, 2])
        if R < 3:
            expect(InvalidArgumentError, lambda: lcc.allreduce(np.ones(2), op=lcc.Adasum,
                                                               process_set=three), "power-of-2")
    works("psets")


if POW2:
    run_cases()
else:   # Horovod refuses these sizes; so does lightcc, on every rank, for every call form
    expect(InvalidArgumentError, lambda: lcc.allreduce(np.ones(3), op=lcc.Adasum, name="n"),
           "power-of-2", f"has {N}")
    expect(InvalidArgumentError, lambda: lcc.allreduce(np.ones(3), op=lcc.Adasum), "power-of-2")
    expect(InvalidArgumentError, lambda: lcc.grouped_allreduce([np.ones(3)], op=lcc.Adasum),
           "power-of-2")
    works("npow2")
run_errors()
run_process_sets()
lcc.shutdown()
print(f"OK p={N} {MODE}", flush=True)
