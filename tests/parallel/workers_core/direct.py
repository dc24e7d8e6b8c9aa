"""The direct path of blocking unnamed allreduces (lightcc/common/direct.py), against NumPy
references: dtypes, ops, scale factors, ``out``, 0-d and empty arrays, a process set, the size
limit, ranks inside join(), and mismatches failing on every rank (also across the size limit).
Each check also asserts which path ran (the direct path's counters), so a fallback to the
engine cannot pass for it. Prints ``direct ok`` per rank."""
from __future__ import annotations

import numpy as np

import lightcc as lcc
from lightcc.common import api
from lightcc.common.exceptions import MismatchError

lcc.init()
R, N = lcc.rank(), lcc.size()
eng = api.engine()
path = eng.groups[0].direct
assert path is not None, "no direct path (MPI_THREAD_MULTIPLE missing?)"
LIMIT = eng.config.direct_bytes


def data(dtype: str, shape: tuple, rank: int) -> np.ndarray:
    """Rank-dependent values, the same on every rank for a given ``rank``."""
    rng = np.random.default_rng(1000 + rank)
    if dtype == "bool":
        return rng.integers(0, 2, shape).astype(bool)
    if dtype in ("float16", "float32", "float64"):
        return rng.uniform(-4, 4, shape).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(max(info.min, -50), min(info.max, 50), shape).astype(dtype)


def reference(dtype: str, shape: tuple, op: str, members: list[int], pre: float = 1.0,
              post: float = 1.0) -> np.ndarray:
    """What every rank expects, computed from all members' inputs in float64 / int64."""
    xs = [data(dtype, shape, r) for r in members]
    if dtype == "bool":
        stack = np.stack(xs)
        return {"sum": stack.any(0), "max": stack.any(0), "min": stack.all(0),
                "prod": stack.all(0)}[op]
    wide = np.float64 if dtype.startswith("float") else np.int64
    stack = np.stack([x.astype(wide) * pre if pre != 1.0 else x.astype(wide) for x in xs])
    if dtype.startswith("float"):
        red = {"sum": stack.sum(0), "average": stack.sum(0) / len(members),
               "min": stack.min(0), "max": stack.max(0), "prod": stack.prod(0)}[op]
        return (red * post).astype(dtype)
    if op == "average":
        total = stack.sum(0)
        return (np.sign(total) * (np.abs(total) // len(members))).astype(dtype)
    red = {"sum": stack.sum(0), "min": stack.min(0), "max": stack.max(0),
           "prod": stack.prod(0), "band": np.bitwise_and.reduce(stack, 0),
           "bor": np.bitwise_or.reduce(stack, 0), "bxor": np.bitwise_xor.reduce(stack, 0)}[op]
    return red.astype(dtype)


def check(got: np.ndarray, want: np.ndarray, dtype: str, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, got.shape)
    if dtype == "float16":
        ok = np.allclose(got.astype(np.float64), want.astype(np.float64), rtol=2e-3, atol=2e-2)
    elif dtype.startswith("float"):
        ok = np.allclose(got, want, rtol=1e-5, atol=1e-5)
    else:
        ok = np.array_equal(got, want)
    assert ok, (what, got.ravel()[:4], want.ravel()[:4])


def direct_call(fn, *, expect_direct: bool = True, checked: bool = True):
    """``fn()``, asserting it was checked against the other ranks on the calling thread
    (``checked``: blocking unnamed calls) and reduced there (``expect_direct``)."""
    calls, reduced = path.calls, path.reduced
    out = fn()
    took = (path.calls - calls, path.reduced - reduced)
    assert took == (int(checked), int(expect_direct)), \
        f"(checked, reduced here) {took}, expected {(checked, expect_direct)}"
    return out


world = list(range(N))
OPS = {"float32": ["sum", "average", "min", "max", "prod"], "float64": ["sum", "average"],
       "float16": ["sum", "average", "max"], "int32": ["sum", "average", "band", "bor", "bxor"],
       "int64": ["sum", "min", "prod"], "uint8": ["max", "bor"], "int8": ["sum"],
       "bool": ["sum", "min"]}
for dtype, ops in OPS.items():
    for op in ops:
        for shape in [(), (5,), (3, 4)]:
            x = data(dtype, shape, R)
            got = direct_call(lambda: lcc.allreduce(x, op=op))
            check(np.asarray(got), reference(dtype, shape, op, world), dtype, (dtype, op, shape))
            assert np.array_equal(x, data(dtype, shape, R)), "input changed"

# scale factors (floating and Horovod's integer scaling), out=, in place
x = data("float32", (7,), R)
got = direct_call(lambda: lcc.allreduce(x, op=lcc.Average, prescale_factor=0.5,
                                        postscale_factor=3.0))
check(got, reference("float32", (7,), "average", world, 0.5, 3.0), "float32", "scaled")
xi = data("int32", (6,), R)
got = direct_call(lambda: lcc.allreduce(xi, op=lcc.Sum, postscale_factor=0.5))
want = np.trunc(reference("int32", (6,), "sum", world).astype(np.float64) * 0.5).astype(np.int32)
check(got, want, "int32", "integer postscale")
out = np.empty(7, np.float32)
res = direct_call(lambda: lcc.allreduce(x, op=lcc.Sum, out=out))
assert res is out
check(out, reference("float32", (7,), "sum", world), "float32", "out=")
y = x.copy()
direct_call(lambda: lcc.allreduce(y, op=lcc.Sum, out=y))
check(y, reference("float32", (7,), "sum", world), "float32", "in place")
# empty array, python scalar, NaN under min
empty = direct_call(lambda: lcc.allreduce(np.zeros(0, np.float32), op=lcc.Sum))
assert empty.shape == (0,)
assert direct_call(lambda: lcc.allreduce(float(R), op=lcc.Sum)) == sum(world)
nanin = np.array([np.nan if R == 0 else 1.0, float(R)])
got = direct_call(lambda: lcc.allreduce(nanin, op=lcc.Min))
assert np.isnan(got[0]) and got[1] == 0.0, got

# the size limit: at the limit direct, above it the engine; same answer
at = np.full(LIMIT // 4, float(R), np.float32)
check(direct_call(lambda: lcc.allreduce(at, op=lcc.Sum)), np.full(LIMIT // 4, sum(world),
      np.float32), "float32", "at limit")
above = np.full(LIMIT // 4 + 1, float(R), np.float32)
check(direct_call(lambda: lcc.allreduce(above, op=lcc.Sum), expect_direct=False),
      np.full(LIMIT // 4 + 1, sum(world), np.float32), "float32", "above limit")
# named, async and ordered calls never take it
direct_call(lambda: lcc.allreduce(x, name="named.small"), expect_direct=False, checked=False)
direct_call(lambda: lcc.synchronize(lcc.allreduce_async(x)), expect_direct=False,
            checked=False)
direct_call(lambda: lcc.allreduce(x, ordered=True), expect_direct=False, checked=False)
# a shape mismatch across the size limit (one rank's call is reduced by the engine) is still
# caught by the check: MismatchError on every rank, not a stall
straddle = np.ones(LIMIT // 4 + (1 if R == 0 else 0), np.float32)
try:
    lcc.allreduce(straddle)
    raise SystemExit("no MismatchError across the size limit")
except MismatchError as exc:
    assert f"({LIMIT // 4 + 1},)" in str(exc) and f"({LIMIT // 4},)" in str(exc), exc
# compression: below LCC_MIN_COMPRESS_BYTES the compressor never applies, so direct
small = data("float32", (8,), R)
check(direct_call(lambda: lcc.allreduce(small, op=lcc.Sum, compression="fp16")),
      reference("float32", (8,), "sum", world), "float32", "small fp16")
big = np.ones(4096, np.float32)
direct_call(lambda: lcc.allreduce(big, op=lcc.Sum, compression="fp16"), expect_direct=False)

# a process set of the last N-1 ranks (its own communicator and counter)
members = list(range(1, N))
ps = lcc.add_process_set(members)
if R in members:
    sub = eng.groups[ps.process_set_id].direct
    before = sub.reduced
    got = lcc.allreduce(data("float64", (3,), R), op=lcc.Sum, process_set=ps)
    assert sub.reduced == before + 1
    check(got, reference("float64", (3,), "sum", members), "float64", "process set")
lcc.remove_process_set(ps)

# mismatches: every rank raises, naming what each rank called; the path goes on afterwards
for bad in ("shape", "dtype", "op"):
    arr = np.ones(3 if bad != "shape" or R != N - 1 else 4,
                  np.float32 if bad != "dtype" or R != 0 else np.float64)
    op = lcc.Sum if bad != "op" or R != 1 else lcc.Max
    try:
        lcc.allreduce(arr, op=op)
        raise SystemExit(f"no MismatchError for a {bad} mismatch")
    except MismatchError as exc:
        text = str(exc)
        assert "rank 0:" in text and f"rank {N - 1}:" in text and "call order" in text, text
assert np.all(direct_call(lambda: lcc.allreduce(np.ones(3), op=lcc.Sum)) == N)

# join: the last rank joins at once; the others' direct calls count it as zeros, Average
# still divides by the set's size (as the engine does), and engine calls mix in
if R == N - 1:
    last = lcc.join()
else:
    active = list(range(N - 1))
    for step in range(5):
        v = np.full(3, float(R + step), np.float32)
        got = direct_call(lambda: lcc.allreduce(v, op=lcc.Sum))
        assert np.all(got == sum(r + step for r in active)), (step, got)
        got = direct_call(lambda: lcc.allreduce(v))
        assert np.allclose(got, sum(r + step for r in active) / N), (step, got)
        named = lcc.allreduce(v, op=lcc.Sum, name=f"joined.{step}")
        assert np.all(named == sum(r + step for r in active)), named
        big = np.full(LIMIT // 4 + 10, float(R + step), np.float32)   # checked, then engine
        got = direct_call(lambda: lcc.allreduce(big, op=lcc.Sum), expect_direct=False)
        assert np.all(got == sum(r + step for r in active)), (step, got[:2])
    last = lcc.join()
assert last in world, last
assert np.all(direct_call(lambda: lcc.allreduce(np.ones(2), op=lcc.Sum)) == N)
print(f"direct ok {R}", flush=True)
lcc.shutdown()
