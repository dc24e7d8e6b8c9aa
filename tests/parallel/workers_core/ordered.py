"""Ordered streams through the engine: Horovod's unnamed collectives (one stream per type) and
``ordered=True`` (one shared stream), results against NumPy, mismatches failing that position
on every rank while later calls still work. Prints ``ordered ok`` per rank."""
from __future__ import annotations

import numpy as np

import lightcc as lcc
from lightcc.common.exceptions import MismatchError

lcc.init()
R, N = lcc.rank(), lcc.size()
rng = np.random.default_rng(7)                       # same sequence on every rank

# unnamed, interleaved types (matched per type, by call order); async and blocking mixed
handles = []
for step in range(30):
    n = int(rng.integers(1, 300))
    kind = int(rng.integers(3))
    if kind == 0:
        x = np.arange(n, dtype=np.float64) * (R + 1)
        handles.append(("ar", n, lcc.allreduce_async(x, op=lcc.Sum)))
    elif kind == 1:
        handles.append(("ag", n, lcc.allgather_async(np.full((R + 1, 2), R, np.int32))))
    else:
        handles.append(("bc", n, lcc.broadcast_async(np.full(n, R, np.int64),
                                                     root_rank=step % N)))
    if step % 7 == 0:
        assert np.all(lcc.allreduce(np.ones(3), op=lcc.Max) == 1.0)
for step, (kind, n, h) in enumerate(handles):
    got = lcc.synchronize(h)
    if kind == "ar":
        assert np.allclose(got, np.arange(n) * sum(r + 1 for r in range(N))), (step, got[:3])
    elif kind == "ag":
        want = np.concatenate([np.full((r + 1, 2), r, np.int32) for r in range(N)])
        assert np.array_equal(got, want), (step, got)
    else:
        assert np.all(got == step % N), (step, got[:3])

# the shared ordered stream: every type in one order, labels may differ between ranks
a = lcc.allreduce(np.full(4, R, np.float32), op=lcc.Sum, name=f"lbl{R}", ordered=True)
b = lcc.broadcast(np.full(2, R), root_rank=N - 1, ordered=True)
c = lcc.allgather(np.full((1,), R), ordered=True)
assert np.all(a == sum(range(N))) and np.all(b == N - 1) and list(c) == list(range(N))

# a shape mismatch on one rank fails that position on every rank; the stream goes on
shape = (5,) if R == N - 1 else (4,)
try:
    lcc.allreduce(np.ones(shape), ordered=True, name="bad")
    raise SystemExit("no MismatchError for a shape mismatch")
except MismatchError as exc:
    assert "shape" in str(exc), exc
# a collective type mismatch on the shared stream, too
try:
    if R == 0:
        lcc.allreduce(np.ones(2), ordered=True)
    else:
        lcc.broadcast(np.ones(2), root_rank=0, ordered=True)
    raise SystemExit("no MismatchError for a type mismatch")
except MismatchError as exc:
    assert "collective" in str(exc), exc
assert np.all(lcc.allreduce(np.ones(3), op=lcc.Sum, ordered=True) == N)
assert np.all(lcc.allreduce(np.ones(3), op=lcc.Sum) == N)
print(f"ordered ok {R}", flush=True)
lcc.shutdown()
