"""The steady state of negotiation (the control tree's bit vectors, negotiation.py) at any
number of ranks: named, unnamed and ordered calls repeated until they are cached, submitted in
a different order on every rank; a process set; a changed shape (MismatchError on every rank)
and changed allgather sizes in the steady state, named and ordered; join() with named allreduces, and the steady
state again after it. Results against NumPy; on rank 0 the coordinator's counters show that
the repeated calls were agreed in the tree (``fast_keys``) and never went to rank 0 rank by
rank (``slow_pairs``). Run under mpirun -np N, with LCC_CONTROL_FANOUT small for a deep tree.
Prints ``steady ok`` per rank."""
from __future__ import annotations

import numpy as np

import lightcc as lcc
from lightcc.common import api
from lightcc.common.exceptions import MismatchError

lcc.init()
R, N = lcc.rank(), lcc.size()
coord = api.engine().coordinator            # rank 0 only
order = np.random.default_rng(100 + R)      # a different submission order on every rank
NAMES = [f"layer{i}.weight" for i in range(10)]
STEPS = 5


def checkpoint() -> tuple[int, int]:
    """Rank 0's counters, read before it submits the named broadcast that every rank waits
    in: no rank has submitted anything after this point yet (cached, "sync" itself only
    reaches the coordinator once rank 0 submitted it, as one key agreed in the tree)."""
    got = (coord.fast_keys, coord.slow_pairs) if coord is not None else (0, 0)
    lcc.broadcast(np.zeros(1), root_rank=0, name="sync")
    return got


checkpoint()
checkpoint()                                # "sync" is cached from here on


def named_step(step: int, names=NAMES, process_set=None, members=None) -> None:
    members = list(range(N)) if members is None else members
    handles = []
    for i in order.permutation(len(names)):
        x = np.arange(i + 3, dtype=np.float32) * (R + 1) + step
        handles.append((i, lcc.allreduce_async(x, op=lcc.Sum, name=names[i],
                                               process_set=process_set)))
    for i, h in handles:
        want = sum(np.arange(i + 3, dtype=np.float32) * (r + 1) + step for r in members)
        assert np.allclose(lcc.synchronize(h), want), (R, names[i], step)


def unnamed_step(step: int) -> None:
    a = lcc.allreduce_async(np.full(7, R + step, np.float64), op=lcc.Sum)
    g = lcc.allgather_async(np.full((2, 3), R, np.int32))
    root = step % min(2, N)                   # two roots: two signatures, both cached
    b = lcc.broadcast_async(np.full(5, R * 10 + step, np.int64), root_rank=root)
    o = lcc.allreduce(np.full(3, float(R), np.float32), op=lcc.Max, ordered=True,
                      name=f"label.{R}")
    assert np.allclose(lcc.synchronize(a), sum(r + step for r in range(N)))
    assert np.array_equal(lcc.synchronize(g), np.repeat(np.arange(N, dtype=np.int32), 2)
                          [:, None].repeat(3, axis=1))
    assert np.all(lcc.synchronize(b) == root * 10 + step)
    assert np.all(o == N - 1)


# -- 1. named, unnamed and ordered calls become steady: no rank-by-rank work on rank 0 --------
for step in range(STEPS):
    if step == 2:
        fast0, slow0 = checkpoint()
    named_step(step)
    unnamed_step(step)
fast1, slow1 = checkpoint()
if coord is not None:
    # steps 2..4: 10 named + 3 unnamed + 1 ordered, and one sync, all agreed in the tree
    assert slow1 == slow0, f"the steady state went to rank 0 rank by rank ({slow1 - slow0})"
    assert fast1 - fast0 == (STEPS - 2) * (len(NAMES) + 4) + 1, (fast0, fast1)

# -- 2. a process set (the first and the last rank, plus rank 1 from 4 ranks on) --------------
members = sorted({0, N - 1} | ({1} if N >= 4 else set()))
ps = lcc.add_process_set(members)
fast2, slow2 = checkpoint()
for step in range(4):
    if R in members:
        named_step(step, NAMES[:4], process_set=ps, members=members)
    lcc.allreduce(np.ones(2), op=lcc.Sum, name="world.sync")       # everyone, every step
fast3, slow3 = checkpoint()
if coord is not None:   # first step and world.sync's first time rank by rank, then the tree
    assert slow3 - slow2 == len(members) * 4 + N, (slow2, slow3)
    assert fast3 - fast2 == 3 * 5 + 1, (fast2, fast3)

# -- 3. a changed shape in the steady state: MismatchError everywhere, then it works again --
named_step(0)
shape = 9 if R == N - 1 else 3
try:
    lcc.allreduce(np.ones(shape, np.float32), name=NAMES[0])
    raise SystemExit(f"rank {R}: no MismatchError for a changed shape")
except MismatchError as exc:
    assert "shape" in str(exc) and NAMES[0] in str(exc), exc
named_step(1)
named_step(2)
# ... and on the shared ordered stream, whose signature is cached since phase 1
try:
    lcc.allreduce(np.full(3 if R else 4, float(R), np.float32), op=lcc.Max, ordered=True)
    raise SystemExit(f"rank {R}: no MismatchError on the ordered stream")
except MismatchError as exc:
    assert "shape" in str(exc), exc
unnamed_step(2)

# -- 4. allgather sizes that change in the steady state (legitimately) ----------------------
for step in range(4):
    first = R + 1 + (step >= 2) * (R % 2)
    got = lcc.allgather(np.full((first, 2), R, np.int64), name="gather.sizes")
    want = np.concatenate([np.full((r + 1 + (step >= 2) * (r % 2), 2), r, np.int64)
                           for r in range(N)])
    assert np.array_equal(got, want), (R, step, got)

# -- 5. join: the last rank stops early, the others keep reducing (it adds zeros) -------------
if R == N - 1:
    last = lcc.join()
else:
    for step in range(3):
        x = np.full(4, R + 1.0, np.float32)
        got = lcc.allreduce(x, op=lcc.Sum, name=NAMES[1])
        assert np.allclose(got, sum(r + 1.0 for r in range(N - 1))), (R, got)
    last = lcc.join()
assert 0 <= last < N, last

# -- 6. and the steady state again after join --------------------------------------------------
named_step(3)
fast4, slow4 = checkpoint()
named_step(4)
unnamed_step(5)
unnamed_step(6)
fast5, slow5 = checkpoint()
if coord is not None:
    assert slow5 == slow4, f"after join the steady state went rank by rank ({slow5 - slow4})"
    assert fast5 - fast4 == len(NAMES) + 2 * 4 + 1, (fast4, fast5)
print(f"steady ok {R}", flush=True)
lcc.shutdown()
