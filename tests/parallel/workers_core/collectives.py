"""Every collective x dtype x op x shape against NumPy references (run under mpirun -np N).

Each rank's input is a deterministic function of (rank, case), so every rank can rebuild all
ranks' inputs and compute the expected result independently with NumPy.
"""
from __future__ import annotations

import sys

import ml_dtypes
import numpy as np

import lightcc as lcc
from lightcc.common.exceptions import NotInitializedError

# use before init() must fail clearly
for fn in (lcc.rank, lambda: lcc.allreduce(np.ones(2))):
    try:
        fn()
    except NotInitializedError as exc:
        assert "init()" in str(exc)
    else:
        raise AssertionError("call before init() did not raise")

lcc.init()
R, N = lcc.rank(), lcc.size()
BF16 = np.dtype(ml_dtypes.bfloat16)
checks = 0


def data(rank: int, case: int, shape, dtype) -> np.ndarray:
    rng = np.random.default_rng(case * 1009 + rank)
    dt = np.dtype(dtype)
    if dt == np.bool_:
        return rng.integers(0, 2, size=shape).astype(bool)
    if dt.kind in "iu":
        lo = 0 if dt.kind == "u" else -20
        return rng.integers(lo, 20, size=shape).astype(dt)
    return rng.uniform(-2, 2, size=shape).astype(dt)


def reference(op: str, arrays: list[np.ndarray], dtype) -> np.ndarray:
    dt = np.dtype(dtype)
    if dt == np.bool_:
        stack = np.stack(arrays)
        return stack.any(0) if op in ("sum", "max") else stack.all(0)
    acc = np.float64 if dt.kind == "f" or dt == BF16 else np.int64
    stack = np.stack([a.astype(acc) for a in arrays])
    if op == "sum":
        out = stack.sum(0)
    elif op == "average":
        s = stack.sum(0)
        out = s / len(arrays) if acc == np.float64 else np.trunc(s / len(arrays))
    elif op == "min":
        out = stack.min(0)
    elif op == "max":
        out = stack.max(0)
    else:
        out = stack.prod(0)
    return out.astype(dt)


def close(got: np.ndarray, want: np.ndarray, dtype, what: str) -> None:
    global checks
    checks += 1
    dt = np.dtype(dtype)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert got.dtype == dt, f"{what}: dtype {got.dtype} != {dt}"
    if dt.kind in "iub":
        assert np.array_equal(got, want), f"{what}: {got} != {want}"
    else:
        tol = {np.dtype(np.float16): 2e-2, BF16: 5e-2}.get(dt, 1e-5)
        assert np.allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol,
                           atol=tol * 4), f"{what}: max err " \
            f"{np.abs(got.astype(np.float64) - want.astype(np.float64)).max()}"


DTYPES = ["uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64", "bool",
          BF16]
OPS = ["sum", "average", "min", "max", "prod"]
SHAPES = [(), (0,), (7,), (3, 5), (2, 3, 4)]

case = 0
# ---- allreduce: every dtype x op x shape, async in a different order per rank ----------------
pending = []
for dt in DTYPES:
    for op in OPS:
        if np.dtype(dt) == np.bool_ and op == "average":
            continue
        for shape in SHAPES:
            case += 1
            if op == "prod" and np.dtype(dt).kind in "iu":
                mine = data(R, case, shape, dt) % 3
                allx = [data(r, case, shape, dt) % 3 for r in range(N)]
            else:
                mine = data(R, case, shape, dt)
                allx = [data(r, case, shape, dt) for r in range(N)]
            name = f"ar.{np.dtype(dt).name}.{op}.{shape}"
            pending.append((name, mine, reference(op, allx, dt), dt))
order = list(range(len(pending)))
np.random.default_rng(R + 77).shuffle(order)       # each rank submits in its own order
handles = {}
for i in order:
    name, mine, want, dt = pending[i]
    handles[i] = lcc.allreduce_async(mine, op=name.split(".")[2], name=name)
for i in range(len(pending)):
    name, mine, want, dt = pending[i]
    close(lcc.synchronize(handles[i]), want, dt, name)

# ---- in-place, non-contiguous, prescale/postscale ----------------------------------------
case += 1
x = data(R, case, (6, 4), "float32")
want = reference("sum", [data(r, case, (6, 4), "float32") for r in range(N)], "float32")
h = lcc.allreduce_async(x, op=lcc.Sum, name="inplace", out=x)
assert lcc.synchronize(h) is x
close(x, want, "float32", "in-place allreduce")
case += 1
base = data(R, case, (8, 6), "float64")
view = base[::2, 1::2]
want = reference("sum", [data(r, case, (8, 6), "float64")[::2, 1::2] for r in range(N)],
                 "float64")
close(lcc.allreduce(view, op=lcc.Sum, name="strided"), want, "float64", "strided view")
case += 1
x = data(R, case, (5,), "float32")
want = reference("sum", [data(r, case, (5,), "float32") * 2.0 for r in range(N)], "float32") * 0.25
close(lcc.allreduce(x, op=lcc.Sum, name="scaled", prescale_factor=2.0, postscale_factor=0.25),
      want, "float32", "prescale/postscale")
x.setflags(write=False)
close(lcc.allreduce(x, op=lcc.Sum, name="readonly", prescale_factor=2.0, postscale_factor=0.25),
      want, "float32", "read-only input")

# ---- fusion: many small tensors in one go are fused into few backend calls ---------------
calls_before = lcc.stats()["world"]["calls"].get("allreduce", 0)
hs = [lcc.allreduce_async(np.full(3, float(R + i), np.float32), op=lcc.Sum, name=f"fuse.{i}")
      for i in range(64)]
for i, h in enumerate(hs):
    close(lcc.synchronize(h), np.full(3, sum(r + i for r in range(N)), np.float32), "float32",
          f"fused {i}")
calls = lcc.stats()["world"]["calls"].get("allreduce", 0) - calls_before
assert calls < 64, f"64 small allreduces took {calls} backend calls: nothing was fused"

# ---- grouped allreduce ------------------------------------------------------------------
res = lcc.grouped_allreduce([np.full(2, R, np.int32), np.full((2, 2), 2.0 * R)], op=lcc.Sum,
                            name="grp")
close(res[0], np.full(2, sum(range(N)), np.int32), "int32", "grouped 0")
close(res[1], np.full((2, 2), 2.0 * sum(range(N))), "float64", "grouped 1")

# ---- allgather: first dimension differs per rank ----------------------------------------
for dt in DTYPES:
    case += 1
    parts = [data(r, case, (r + 1, 3), dt) for r in range(N)]
    got = lcc.allgather(parts[R], name=f"ag.{np.dtype(dt).name}")
    close(got, np.concatenate(parts), dt, f"allgather {dt}")
case += 1
parts = [data(r, case, (0 if r == 0 else 2,), "int64") for r in range(N)]
close(lcc.allgather(parts[R], name="ag.empty0"), np.concatenate(parts), "int64", "allgather 0 rows")

# ---- broadcast from every root -----------------------------------------------------------
for root in range(N):
    for dt in ("float32", "int16", BF16, "bool"):
        case += 1
        src = [data(r, case, (4, 2), dt) for r in range(N)]
        close(lcc.broadcast(src[R], root_rank=root, name=f"bc.{root}.{np.dtype(dt).name}"),
              src[root], dt, f"broadcast root {root}")
case += 1
x = data(R, case, (3,), "float64")
root_val = data(0, case, (3,), "float64")
assert lcc.synchronize(lcc.broadcast_async(x, 0, name="bc.inplace", out=x)) is x
close(x, root_val, "float64", "in-place broadcast")

# ---- alltoall with and without splits ----------------------------------------------------
case += 1
splits_of = [[(r + d) % 3 for d in range(N)] for r in range(N)]
rows = [data(r, case, (sum(splits_of[r]), 2), "float32") for r in range(N)]
out, recv = lcc.alltoall(rows[R], splits=splits_of[R], name="a2a")
pieces = []
for src in range(N):
    start = sum(splits_of[src][:R])
    pieces.append(rows[src][start:start + splits_of[src][R]])
close(out, np.concatenate(pieces), "float32", "alltoall splits")
assert list(recv) == [splits_of[s][R] for s in range(N)], recv
case += 1
even = [data(r, case, (2 * N,), "int32") for r in range(N)]
got = lcc.alltoall(even[R], name="a2a.even")
close(got, np.concatenate([even[s][2 * R:2 * R + 2] for s in range(N)]), "int32", "alltoall even")

# ---- reducescatter: uneven first dimension, earlier ranks get the extra row --------------
for op in ("sum", "average", "max"):
    for dt in ("float32", "int32", "float16"):
        case += 1
        rows_total = 2 * N + 1
        allx = [data(r, case, (rows_total, 3), dt) for r in range(N)]
        full = reference(op, allx, dt)
        counts = [rows_total // N + (1 if i < rows_total % N else 0) for i in range(N)]
        start = sum(counts[:R])
        got = lcc.reducescatter(allx[R], op=op, name=f"rs.{op}.{dt}")
        close(got, full[start:start + counts[R]], dt, f"reducescatter {op} {dt}")

# ---- barrier, process sets -----------------------------------------------------------------
lcc.barrier()
if N >= 3:
    evens = lcc.add_process_set([r for r in range(N) if r % 2 == 0])
    odds = lcc.add_process_set(lcc.ProcessSet([r for r in range(N) if r % 2 == 1]))
    mine = evens if R % 2 == 0 else odds
    assert mine.included() and mine.rank() == R // 2
    members = mine.ranks
    got = lcc.allreduce(np.array([R], np.int64), op=lcc.Sum, name="ps", process_set=mine)
    close(got, np.array([sum(members)], np.int64), "int64", "process set allreduce")
    got = lcc.allgather(np.array([R], np.int64), name="ps.ag", process_set=mine)
    close(got, np.array(members, np.int64), "int64", "process set allgather")
    lcc.barrier(process_set=mine)
    lcc.remove_process_set(odds)
    lcc.remove_process_set(evens)

# ---- join: rank N-1 joins early; its share is zeros; join returns the last rank ----------
if R == N - 1:
    last = lcc.join()
else:
    got = lcc.allreduce(np.full(4, 1.0 + R), op=lcc.Sum, name="joined.sum")
    close(got, np.full(4, sum(1.0 + r for r in range(N - 1))), "float64", "allreduce with join")
    last = lcc.join()
assert 0 <= last < N, last
# all ranks agree on the last rank to join
agreed = lcc.allgather(np.array([last]), name="join.check")
assert len(set(agreed.tolist())) == 1, agreed

print(f"rank {R}: {checks} checks passed", flush=True)
lcc.shutdown()
sys.exit(0)
