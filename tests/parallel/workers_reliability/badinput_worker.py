"""Bad input on every public function: the right result or a clear error on every rank, and
no hang (mpirun -np 3). Also runs the large-message code paths of the MPI backend with tiny
limits. Prints ``badinput ok <checks>`` per rank, and ``KNOWN:`` lines for open issues that
tests/parallel/test_reliability.py tracks as expected failures.
"""
from __future__ import annotations

import zlib

import ml_dtypes
import numpy as np

import lightcc as lcc
from lightcc import InvalidArgumentError, LightCCError, UnsupportedDTypeError
from lightcc.common.backends import mpi as mpi_backend
from lightcc.common.compression import available_compressors

lcc.init()
R, N = lcc.rank(), lcc.size()
checks = 0


def ok(cond: bool, what: str) -> None:
    global checks
    assert cond, what
    checks += 1


def raises(types, fn, *needles) -> None:
    global checks
    try:
        fn()
    except types as exc:
        for n in needles:
            assert n in str(exc), f"{n!r} not in {exc!r}"
        checks += 1
        return
    raise AssertionError(f"no {types} from {fn}")


def same_everywhere(arr: np.ndarray, what: str) -> None:
    """Every rank got bit-identical bytes (NaN-safe)."""
    mine = np.frombuffer(np.ascontiguousarray(arr).tobytes(), np.uint8)
    digest = np.array([zlib.crc32(mine.tobytes())], np.int64)
    seen = lcc.allgather(digest, name=f"digest.{what}")
    ok(len(set(seen.tolist())) == 1, f"{what}: ranks disagree")


# ---- wrong types -----------------------------------------------------------------------
for bad in (None, {}, "text", object(), ["a", "b"], np.zeros(2, np.complex64),
            np.zeros(2, "datetime64[s]"), np.zeros(2, [("a", "i4")]), np.array([object()])):
    for fn in (lcc.allreduce, lcc.allgather, lambda a: lcc.broadcast(a, 0),
               lcc.alltoall, lcc.reducescatter, lambda a: lcc.grouped_allreduce([a])):
        raises((UnsupportedDTypeError, InvalidArgumentError), lambda: fn(bad))
x = np.arange(6.0)
raises(InvalidArgumentError, lambda: lcc.allreduce(x, op=5), "op")
raises(InvalidArgumentError, lambda: lcc.allreduce(x, op="median"), "op")
raises(InvalidArgumentError, lambda: lcc.allreduce(x, name=b"bytes"), "name")
raises(InvalidArgumentError, lambda: lcc.allreduce(x, process_set="world"), "process_set")
raises(InvalidArgumentError, lambda: lcc.allreduce(x, process_set=99), "does not exist")
raises(InvalidArgumentError, lambda: lcc.allreduce(x, compression="zip"), "zip")
raises(InvalidArgumentError, lambda: lcc.allreduce(x, compression=5), "compression")
raises((ValueError, TypeError), lambda: lcc.allreduce(x, prescale_factor="abc"))
raises(InvalidArgumentError, lambda: lcc.allreduce(np.ones(3, bool), op=lcc.Max,
                                                    prescale_factor=2.0), "numeric")
raises(InvalidArgumentError, lambda: lcc.allreduce_async(x, out=np.zeros(5)), "out")
raises(InvalidArgumentError, lambda: lcc.allreduce_async(x, out=np.zeros(6, np.float32)), "out")
raises(InvalidArgumentError, lambda: lcc.barrier(process_set=42), "does not exist")
raises(InvalidArgumentError, lambda: lcc.add_process_set([0, 0]), "distinct")
raises(InvalidArgumentError, lambda: lcc.add_process_set([N]), "distinct")
raises(InvalidArgumentError, lambda: lcc.remove_process_set(lcc.global_process_set), "global")

# ---- roots and splits ----------------------------------------------------------------------
for root in (-1, N, N + 100, -N, 1.5, "0", None):
    raises(InvalidArgumentError, lambda: lcc.broadcast(x, root_rank=root), "root_rank")
for splits in ([-1] + [0] * (N - 2) + [7], [6] * N, [1] * (N + 1), [], [6] + [0] * N):
    raises(InvalidArgumentError, lambda: lcc.alltoall(x, splits=splits), "splits")
raises(InvalidArgumentError, lambda: lcc.alltoall(np.arange(N * 2 + 1.0)), "divisible")
for zero_d in (lcc.allgather, lcc.alltoall, lcc.reducescatter):
    raises(InvalidArgumentError, lambda: zero_d(np.float32(1.0)), "dimension")

# ---- shapes, views, read-only ---------------------------------------------------------------
base = np.arange(4 * N * 6, dtype=np.float64).reshape(4 * N, 6) + R
views = {"strided": base[::2, ::3], "fortran": np.asfortranarray(base), "reversed": base[::-1],
         "transposed": base.T[:, :N * 2]}
for vname, v in views.items():
    allv = [np.asarray(v) - R + r for r in range(N)]
    ok(np.array_equal(lcc.allreduce(v, op=lcc.Sum, name=f"v.ar.{vname}"), sum(allv)), vname)
    ok(np.array_equal(lcc.allgather(v, name=f"v.ag.{vname}"), np.concatenate(allv)), vname)
    ok(np.array_equal(lcc.broadcast(v, 1, name=f"v.bc.{vname}"), allv[1]), vname)
    rows = v.shape[0] // N
    ok(np.array_equal(lcc.alltoall(v[:rows * N], name=f"v.a2a.{vname}"),
                      np.concatenate([a[R * rows:(R + 1) * rows] for a in allv])), vname)
    full = sum(allv)
    counts = [full.shape[0] // N + (1 if i < full.shape[0] % N else 0) for i in range(N)]
    lo = sum(counts[:R])
    ok(np.array_equal(lcc.reducescatter(v, op=lcc.Sum, name=f"v.rs.{vname}"),
                      full[lo:lo + counts[R]]), vname)
ro = np.arange(6.0) + R
ro.setflags(write=False)
ok(np.array_equal(lcc.allreduce(ro, op=lcc.Sum, name="ro.ar"), np.arange(6.0) * N + sum(range(N))),
   "read-only allreduce")
ok(np.array_equal(lcc.broadcast(ro, 0, name="ro.bc"), np.arange(6.0)), "read-only broadcast")
ok(lcc.allgather(ro, name="ro.ag").shape == (6 * N,), "read-only allgather")
ok(lcc.alltoall(ro[:N], name="ro.a2a").shape == (N,), "read-only alltoall")
ok(lcc.reducescatter(ro, name="ro.rs").shape[0] >= 1, "read-only reducescatter")
ok(not ro.flags.writeable and np.array_equal(ro, np.arange(6.0) + R), "input untouched")
for shape in ((0,), (0, 3), (3, 0)):
    e = np.zeros(shape, np.float32)
    ok(lcc.allreduce(e, name=f"e.ar.{shape}").shape == shape, "empty allreduce")
    ok(lcc.allgather(e, name=f"e.ag.{shape}").shape == (shape[0] * N, *shape[1:]), "empty ag")
    ok(lcc.broadcast(e, 0, name=f"e.bc.{shape}").shape == shape, "empty broadcast")
    if shape[0] % N == 0:
        ok(lcc.alltoall(e, name=f"e.a2a.{shape}").shape == shape, "empty alltoall")
    ok(lcc.reducescatter(e, name=f"e.rs.{shape}").shape[1:] == shape[1:], "empty rs")
    for comp in available_compressors():
        ok(lcc.allreduce(e, name=f"e.c.{comp}.{shape}", compression=comp).shape == shape, comp)
ok(lcc.allreduce(np.float64(R), op=lcc.Sum, name="0d.ar") == sum(range(N)), "0-d allreduce")
ok(lcc.broadcast(np.int32(R), 2 % N, name="0d.bc") == 2 % N, "0-d broadcast")
ok(lcc.grouped_allreduce([], name="g.empty") == [], "empty group")

# ---- names -----------------------------------------------------------------------------------
for nm in ("n" * 100_000, "градиент.权重.🚀", "tab\tnew\nline\x00nul", "", " "):
    ok(lcc.allreduce(np.ones(2), op=lcc.Sum, name=nm)[0] == N, f"name {nm[:10]!r}")
    ok(lcc.allgather(np.ones(1), name=nm).shape == (N,), f"ag name {nm[:10]!r}")

# ---- NaN / Inf: sums are faithful, with and without compressors; nothing crashes ------------
specials = np.array([np.nan, 1, np.inf, -np.inf, 2, np.inf], np.float32)
mine = np.roll(specials, R)
np.seterr(invalid="ignore")
allx = np.stack([np.roll(specials, r) for r in range(N)]).astype(np.float64)
want = allx.sum(0)
for dt in (np.float16, np.float32, np.float64, ml_dtypes.bfloat16):
    got = lcc.allreduce(mine.astype(dt), op=lcc.Sum, name=f"nan.{np.dtype(dt).name}")
    ok(np.array_equal(np.isnan(got.astype(np.float64)), np.isnan(want)), f"NaN sum {dt}")
    fin = ~np.isnan(want)
    ok(np.array_equal(got.astype(np.float64)[fin], want[fin]), f"Inf sum {dt}")
for op, ref in (("min", np.min), ("max", np.max)):
    got = lcc.allreduce(mine, op=op, name=f"nan.{op}")
    same_everywhere(got, f"nan.{op}")
    if not np.array_equal(np.isnan(got), np.isnan(ref(allx, 0))):
        print(f"rank {R}: KNOWN: NAN-MINMAX {op} gives {got.tolist()}, NumPy "
              f"{ref(allx, 0).tolist()}", flush=True)
for comp in available_compressors():
    for step in range(2):           # 2-D: PowerSGD compresses matrices, sends vectors dense
        buf = np.full((64, 64), 1.0 + R, np.float32)
        if step == 0:
            buf[0, :6] = mine
        got = lcc.allreduce(buf, op=lcc.Sum, name=f"nan.c.{comp}", compression=comp)
        same_everywhere(got, f"nan.c.{comp}.{step}")
        if step == 0:
            ok(bool(np.isnan(got).any()), f"{comp} dropped a NaN")
        elif not np.isfinite(got).all():
            print(f"rank {R}: KNOWN: NAN-STICKY {comp}: a NaN step leaves "
                  f"{int((~np.isfinite(got)).sum())} non-finite values in the next, "
                  f"finite step", flush=True)

# ---- per-name compressor state of tensors that stop appearing ---------------------------------
from lightcc.common import api  # noqa: E402

TTL = 10
lcc.shutdown()
lcc.init(ef_ttl_steps=TTL)           # residuals unseen for 10 engine steps are dropped
for i in range(40):                  # 40 names, each seen once (a model that changes layers)
    lcc.allreduce(np.full(2048, 1.0, np.float32), name=f"gone.{i}", compression="topk:0.05")
# Each blocking named allreduce is one engine step, so after the 40th (step 39) a residual
# survives only if its tensor was seen at step 29 or later: gone.29 .. gone.39, 11 = TTL + 1.
topk = api.engine().group(0).compressors.get("topk:0.05")
kept = set(topk.memory.residuals) if topk is not None else set()
ok("gone.39" in kept, f"topk keeps no residual of the tensor it just compressed: {kept}")
if len(kept) > TTL + 1 or not kept <= {f"gone.{i}" for i in range(39 - TTL, 40)}:
    print(f"rank {R}: KNOWN: EF-LEAK topk keeps {len(kept)} residuals of tensors seen once "
          f"with LCC_EF_TTL_STEPS={TTL} (at most {TTL + 1}, the last ones; "
          f"{len(kept) * 2048 * 4 / 2**20:.2f} MiB): {sorted(kept)[:8]}", flush=True)

# ---- large-message code paths of the MPI backend, with tiny limits ---------------------------
mpi_backend.INT_LIMIT, mpi_backend.MAX_CHUNK_BYTES, mpi_backend.MAX_CHUNK_ELEMS = 999, 100, 37
rng = np.random.default_rng(5)
parts = [rng.integers(0, 255, size=(400 + 13 * r,)).astype(np.uint8) for r in range(N)]
ok(np.array_equal(lcc.allgather(parts[R], name="lg.ag"), np.concatenate(parts)), "large ag")
ok(np.array_equal(lcc.broadcast(parts[R][:400], 1, name="lg.bc"), parts[1][:400]), "large bc")
mat = [[(s + d) * 61 % 170 for d in range(N)] for s in range(N)]
src = [np.arange(sum(mat[s]) * 2, dtype=np.int64).reshape(-1, 2) * (s + 1) for s in range(N)]
out, rs = lcc.alltoall(src[R], splits=mat[R], name="lg.a2a")
exp = np.concatenate([src[s][sum(mat[s][:R]):sum(mat[s][:R + 1])] for s in range(N)])
ok(np.array_equal(out, exp) and list(rs) == [mat[s][R] for s in range(N)], "large alltoall")
vals = [np.arange(3001, dtype=np.float64) * (r + 1) for r in range(N)]
full = sum(vals)
counts = [3001 // N + (1 if i < 3001 % N else 0) for i in range(N)]
ok(np.array_equal(lcc.reducescatter(vals[R], op=lcc.Sum, name="lg.rs"),
                  full[sum(counts[:R]):sum(counts[:R + 1])]), "large reducescatter")
ok(np.array_equal(lcc.allreduce(vals[R], op=lcc.Sum, name="lg.ar"), full), "large allreduce")
mpi_backend.INT_LIMIT, mpi_backend.MAX_CHUNK_BYTES = (1 << 31) - 1, 1 << 30
mpi_backend.MAX_CHUNK_ELEMS = 1 << 30

ok(np.allclose(lcc.allreduce(np.ones(3), op=lcc.Sum, name="still.works"), N), "final")
print(f"rank {R}: badinput ok {checks}", flush=True)
lcc.shutdown()
