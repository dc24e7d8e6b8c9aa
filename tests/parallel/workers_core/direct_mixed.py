"""Direct and engine paths interleaved at random (the same sequence on every rank): named
asynchronous allreduces of up to 200 KB and unnamed asynchronous ones in flight while blocking
unnamed allreduces run on the direct path (<= LCC_DIRECT_BYTES) or are checked there and then
reduced by the engine (larger), unnamed allgathers between them, and finally join() with direct
calls on the others. Every result against its closed form; a deadlock between the two paths
would hang (the harness's timeout). Prints ``mixed ok`` per rank."""
from __future__ import annotations

import numpy as np

import lightcc as lcc
from lightcc.common import api

lcc.init()
R, N = lcc.rank(), lcc.size()
total = float(sum(range(N)))
path = api.engine().groups[0].direct
rng = np.random.default_rng(5)     # the same choices on every rank
for it in range(300):
    pending = []
    for j in range(int(rng.integers(0, 4))):
        n = int(rng.integers(1, 50_000))
        pending.append((n, lcc.allreduce_async(np.full(n, float(R), np.float32), op=lcc.Sum,
                                               name=f"a.{j}")))
    if rng.random() < 0.3:
        pending.append((7, lcc.allreduce_async(np.full(7, float(R), np.float32), op=lcc.Sum)))
    k = int(rng.choice([1, 100, 20_000, 30_000]))            # 4 B .. 120 KB
    reduced = path.reduced
    got = lcc.allreduce(np.full(k, float(R), np.float32), op=lcc.Sum)
    assert np.all(got == total), (it, k, got[:3])
    assert path.reduced - reduced == (1 if 4 * k <= lcc.config().direct_bytes else 0), (it, k)
    if rng.random() < 0.2:
        gathered = lcc.allgather(np.full((2,), R))
        assert list(gathered) == sum(([r, r] for r in range(N)), []), gathered
    for n, h in pending:
        out = lcc.synchronize(h)
        assert out.shape == (n,) and np.all(out == total), (it, n)
if R != N - 1:
    for step in range(20):
        got = lcc.allreduce(np.full(3, float(R)), op=lcc.Sum)
        assert np.all(got == total - (N - 1)), got
lcc.join()
print(f"mixed ok {R}", flush=True)
lcc.shutdown()
