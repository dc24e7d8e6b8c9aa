"""Every allreduce algorithm, and the compressors' exchanges, on the MPI-free transport: one
``init()``/``shutdown()`` per setting (the rendezvous runs again each time), results against
the NumPy sum of every rank's seeded input. Run with LCC_LOCAL_SIZE=2 on 3 ranks: two
simulated nodes of 2 and 1 ranks, so hierarchical and 2d have a cross-node phase."""
import numpy as np

import lightcc as lcc


def data(rank, n, seed):
    return np.random.default_rng(1000 * seed + rank).standard_normal(n).astype(np.float32)


settings = [dict(algorithm=a) for a in ("flat", "ring", "tree", "hierarchical", "2d", "native")]
settings += [dict(compression=c, min_compress_bytes=0) for c in ("fp16", "bf16", "topk")]
for seed, kw in enumerate(settings):
    lcc.init(**kw)
    R, N = lcc.rank(), lcc.size()
    for n in (5, 3000, 300_000):
        want = np.sum([data(r, n, seed).astype(np.float64) for r in range(N)], axis=0)
        got = lcc.allreduce(data(R, n, seed), op=lcc.Sum, name=f"x{n}")
        every = lcc.allgather(got[None, :], name=f"g{n}")       # the same bits on every rank
        assert all(np.array_equal(every[0], every[r]) for r in range(N)), (kw, n)
        if kw.get("compression") == "topk":       # top-k: what was sent is exact, the rest 0
            assert np.abs(got).max() <= np.abs(want).max() + 1e-3 and got.shape == want.shape
            continue
        tol = 2e-2 if kw.get("compression") == "bf16" else 3e-3 if "compression" in kw else 1e-5
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * N * 4, err_msg=str((kw, n)))
    nodes = lcc.cross_size()
    lcc.shutdown()
print(f"rank {R}: algorithms ok (nodes {nodes})", flush=True)
