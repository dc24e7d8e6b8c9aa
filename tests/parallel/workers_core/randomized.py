"""200 random sequences of collectives: random names, sizes, dtypes, ops and a different async
submission order on every rank; results checked against NumPy, and no hang
(run under mpirun -np N; LCC_TEST_SEQUENCES overrides the count)."""
from __future__ import annotations

import os

import numpy as np

import lightcc as lcc

lcc.init(fusion_threshold=int(os.environ.get("LCC_TEST_FUSION", 4096)))
R, N = lcc.rank(), lcc.size()
SEQUENCES = int(os.environ.get("LCC_TEST_SEQUENCES", "200"))
DTYPES = ["int32", "int64", "float32", "float64", "float16"]
total = 0
for seq in range(SEQUENCES):
    plan_rng = np.random.default_rng(seq)          # same plan on every rank
    ops = []
    for k in range(int(plan_rng.integers(1, 8))):
        kind = plan_rng.choice(["allreduce", "allgather", "broadcast", "alltoall"])
        dt = plan_rng.choice(DTYPES)
        n = int(plan_rng.integers(0, 300))
        name = f"s{seq}.{k}.{plan_rng.integers(1 << 30)}"
        ops.append((kind, dt, n, name, int(plan_rng.integers(0, N)),
                    plan_rng.choice(["sum", "min", "max"])))

    def local(rank, k, n, dt):
        return (np.arange(n) * (rank + 1) + k * 7).astype(dt) % 50

    handles = []
    order = np.random.default_rng(seq * 31 + R).permutation(len(ops))   # per-rank order
    for i in order:
        kind, dt, n, name, root, op = ops[i]
        if kind == "allreduce":
            h = lcc.allreduce_async(local(R, i, n, dt), op=op, name=name)
        elif kind == "allgather":
            h = lcc.allgather_async(local(R, i, n + R, dt), name=name)
        elif kind == "broadcast":
            h = lcc.broadcast_async(local(R, i, n, dt), root, name=name)
        else:
            h = lcc.alltoall_async(local(R, i, n * N, dt), name=name)
        handles.append((i, h))
    for i, h in sorted(handles, key=lambda t: t[0]):
        kind, dt, n, name, root, op = ops[i]
        got = lcc.synchronize(h)
        if kind == "allreduce":
            stack = np.stack([local(r, i, n, dt).astype(np.float64) for r in range(N)])
            want = {"sum": stack.sum(0), "min": stack.min(0), "max": stack.max(0)}[op]
        elif kind == "allgather":
            want = np.concatenate([local(r, i, n + r, dt) for r in range(N)])
        elif kind == "broadcast":
            want = local(root, i, n, dt)
        else:
            want = np.concatenate([local(s, i, n * N, dt)[R * n:(R + 1) * n] for s in range(N)])
        tol = 0.5 if dt == "float16" else 1e-6
        assert got.shape == want.shape and np.allclose(got.astype(np.float64), want, atol=tol), \
            f"seq {seq} op {i} {kind} {dt} {name}: {got} vs {want}"
        total += 1
print(f"rank {R}: {total} random collectives in {SEQUENCES} sequences ok", flush=True)
lcc.shutdown()
