"""Compressed allreduce through the engine (fused buckets): every compressor x algorithm gives
the result of an independent NumPy simulation (workers_compression/sim.py: bitwise for
fp16/bf16/fp8/TopK, 1e-4 relative for PowerSGD's float64 algebra), bitwise identical on every
rank, and sends fewer bytes. The simulation is fed what the algorithm hands the compressor:
every rank's tensor (flat, ring), each simulated node's sum (hierarchical and 2d across nodes,
per shard when the nodes are even), or nothing (hierarchical and 2d on one node: no link to
compress, the exact sum)."""
from __future__ import annotations

import math
import os
import sys
import zlib
from pathlib import Path

import numpy as np

import lightcc as lcc
from lightcc.common import algorithms, api
from lightcc.common.arrays import even_counts
from lightcc.common.compression import available_compressors
from lightcc.common.compression.powersgd import PowerSGDCompressor

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workers_compression"))
import sim  # noqa: E402

from tests.mpi_harness import tcp_links_line

lcc.init(fusion_threshold=1 << 20, min_compress_bytes=1024)
R, N = lcc.rank(), lcc.size()
LOCAL = int(os.environ.get("LCC_LOCAL_SIZE", "0") or 0)
NODES = [list(range(i, min(i + LOCAL, N))) for i in range(0, N, LOCAL)] if LOCAL > 0 \
    else [list(range(N))]
FP = {"fp16": ("fp16", None), "bf16": ("bf16", None), "fp8": ("e4m3", "bucket"),
      "fp8_e5m2": ("e5m2", "bucket")}
MIN_COMPRESS = 1024


def resolved(algo: str, nbytes: int) -> str:
    group = api.engine().group(0)
    return algorithms.choose(algo, nbytes, group.topo, group.settings.auto)


def pieces(algo: str, total: int) -> tuple[str, list[int]] | None:
    """What the compressor of a bucket of ``total`` elements sees: ``("ranks" | "nodes",
    piece sizes)``, or None when the algorithm sums the bucket exactly."""
    if algo in ("flat", "ring", "tree"):
        return "ranks", [total]
    if len(NODES) == 1:
        return None                                   # one node: no cross-node phase
    if len({len(n) for n in NODES}) > 1:
        return "nodes", [total]                       # uneven nodes: the leaders carry all
    return "nodes", even_counts(total, len(NODES[0]))   # a shard per local rank


def fp32_sum(xs: list[np.ndarray]) -> np.ndarray:
    out = xs[0].astype(np.float32).copy()
    for x in xs[1:]:
        out = (out + x).astype(np.float32)
    return out


def expected(spec: str, algo: str, bucket: list[np.ndarray], names: list[str],
             shapes: list[tuple[int, ...]], state: dict | None = None) -> np.ndarray:
    """The simulated result of a bucket (every rank's flat bucket in ``bucket``) holding
    tensors ``names``/``shapes`` in order; ``state`` carries TopK residuals between steps."""
    total = bucket[0].size
    view = pieces(resolved(algo, 4 * total), total)
    if view is None:
        return fp32_sum(bucket)
    members, sizes = view
    ins = bucket if members == "ranks" else [fp32_sum([bucket[r] for r in n]) for n in NODES]
    bounds = np.cumsum([0] + [math.prod(s) for s in shapes])
    out, lo = [], 0
    for j, size in enumerate(sizes):                  # each piece on its own
        hi = lo + size
        parts = [(max(a, lo), min(b, hi), name, shape) for a, b, name, shape in
                 zip(bounds, bounds[1:], names, shapes) if max(a, lo) < min(b, hi)]
        piece = [x[lo:hi] for x in ins]
        psizes = tuple(b - a for a, b, _, _ in parts)
        if spec in FP:
            out.append(sim.twophase(piece, *FP[spec], 256, psizes))
        elif spec.startswith("topk"):
            res = None if state is None else state.get(j)
            got, res, _ = sim.topk_step(piece, res, 0.01, psizes)
            if state is not None:
                state[j] = res
            out.append(got)
        else:                                         # powersgd:2, one step from the seed
            comp, tensors, qs = PowerSGDCompressor(2), [], []
            for a, b, name, shape in parts:
                whole = b - a == math.prod(shape)
                tensors.append((a - lo, b - a, shape if whole else None))
                if whole and len(shape) >= 2:
                    rows, cols = shape[0], (b - a) // shape[0]
                elif not whole:
                    cols = math.isqrt(b - a - 1) + 1
                    rows = -(-(b - a) // cols)
                else:
                    continue
                r = min(2, rows, cols)
                if (rows + cols) * r < b - a:
                    key = f"{name}@{a - int(bounds[names.index(name)])}:{b - a}"
                    qs.append(comp._initial_q(key, cols, r).astype(np.float64))
            out.append(sim.powersgd_step(piece, None, qs, 2, tensors)[0].astype(np.float32))
        lo = hi
    return np.concatenate(out)


def check(got: np.ndarray, want: np.ndarray, exact: bool, what: str) -> None:
    if exact:
        same = (got.view(np.int32) == want.view(np.int32)) | (np.isnan(got) & np.isnan(want))
        assert same.all(), f"{what}: {int((~same).sum())} of {got.size} elements differ from " \
                           f"the simulation, first at {int(np.flatnonzero(~same)[0])}"
    else:
        err = np.abs(got - want).max() / (np.abs(want).max() + 1e-12)
        assert err < 1e-4, f"{what}: relative error {err:.2e} vs the simulation"


algorithms_ = ["flat", "ring", "hierarchical", "2d", "native"]
# auto picks a format by measuring this machine: its own tests (test_compression_auto.py) fix
# the measurement; here every fixed format against the simulation
for spec in [c for c in available_compressors() if c not in ("none", "auto")]:
    for algo in algorithms_:
        lcc.shutdown()
        lcc.init(fusion_threshold=1 << 20, min_compress_bytes=MIN_COMPRESS, algorithm=algo)
        rng = [np.random.default_rng(r * 100 + 7) for r in range(N)]
        shapes = [(64, 32), (100,), (3, 5, 7), (2048,)]
        data = [[g.standard_normal(s).astype(np.float32) for s in shapes] for g in rng]
        before = lcc.stats()["bytes_sent"]
        hs = [lcc.allreduce_async(x, op=lcc.Sum, name=f"{spec}.{algo}.{i}", compression=spec)
              for i, x in enumerate(data[R])]
        got = [lcc.synchronize(h) for h in hs]
        sent = lcc.stats()["bytes_sent"] - before
        # tensors of MIN_COMPRESS bytes or more share one compressed bucket (LCC_OVERLAP=0:
        # one batch), the others go uncompressed; the shards of even nodes cut the bucket
        # between its two tensors, so each tensor's simulation is that of the bucket
        big = [i for i, s in enumerate(shapes) if 4 * math.prod(s) >= MIN_COMPRESS]
        bucket = [np.concatenate([data[r][i].reshape(-1) for i in big]) for r in range(N)]
        want = expected(spec, algo, bucket, [f"{spec}.{algo}.{i}" for i in big],
                        [shapes[i] for i in big])
        check(np.concatenate([got[i].reshape(-1) for i in big]), want,
              not spec.startswith("powersgd"), f"{spec}/{algo}")
        for i, (g, s) in enumerate(zip(got, shapes)):
            assert g.shape == s and g.dtype == np.float32
            if i not in big:
                exact = sum(d[i].astype(np.float64) for d in data)
                assert np.allclose(g, exact, rtol=1e-6, atol=1e-6), f"{spec}/{algo} plain {i}"
        crc = zlib.crc32(b"".join(g.tobytes() for g in got))
        crcs = lcc.allgather(np.array([crc], np.int64), name=f"crc.{spec}.{algo}")
        assert len(set(crcs.tolist())) == 1, f"{spec}/{algo}: ranks differ"
        dense = sum(int(np.prod(s)) * 4 for s in shapes) * 2 * (N - 1) // N
        if N > 1 and algo == "flat":
            assert sent < dense, f"{spec}: sent {sent} bytes, dense would be {dense}"

# across hosts a tensor of fusion.MULTI_HOST_DIRECT_BYTES or more is reduced alone and in place,
# compressed too (with LCC_LOCAL_SIZE the ranks form several simulated nodes)
from lightcc.common.execution import fusion  # noqa: E402

lcc.shutdown()
lcc.init(min_compress_bytes=1024)
big = fusion.MULTI_HOST_DIRECT_BYTES // 4
for spec in ("fp16", "topk"):
    rng = [np.random.default_rng(r * 31 + 5) for r in range(N)]
    data = [[g.standard_normal(s).astype(np.float32) for s in (big, 3000, big + 7)] for g in rng]
    ins = [x.copy() for x in data[R]]
    hs = [lcc.allreduce_async(x, op=lcc.Sum, name=f"direct.{spec}.{i}", compression=spec)
          for i, x in enumerate(ins)]
    got = [lcc.synchronize(h) for h in hs]
    for i, g in enumerate(got):      # each tensor its own bucket, the algorithm auto's choice
        want = expected(spec, "auto", [d[i] for d in data], [f"direct.{spec}.{i}"],
                        [data[0][i].shape])
        check(g, want, True, f"direct {spec} tensor {i}")
    crc = zlib.crc32(b"".join(g.tobytes() for g in got))
    crcs = lcc.allgather(np.array([crc], np.int64), name=f"crc.direct.{spec}")
    assert len(set(crcs.tolist())) == 1, f"direct {spec}: ranks differ"
# a fused TopK bucket reduced in place (out=: the tensors themselves, never packed) gives the
# packed bucket's results bit for bit, step after step, and both follow the simulation of
# TopK with error feedback (the (7,) tensor is under MIN_COMPRESS: summed exactly, alone)
shapes = [(300, 200), (7,), (50_000,), (90, 90)]
packed_names = [f"tk.packed.{i}" for i in (0, 2, 3)]
state: dict = {}
for step in range(3):
    data = [[np.random.default_rng(77 + 10 * step + r).standard_normal(s).astype(np.float32)
             for s in shapes] for r in range(N)]
    packed = [lcc.allreduce_async(x.copy(), op=lcc.Sum, name=f"tk.packed.{i}",
                                  compression="topk") for i, x in enumerate(data[R])]
    packed = [lcc.synchronize(h) for h in packed]
    ins = [x.copy() for x in data[R]]
    hs = [lcc.allreduce_async(x, op=lcc.Sum, name=f"tk.parts.{i}", compression="topk", out=x)
          for i, x in enumerate(ins)]
    got = [lcc.synchronize(h) for h in hs]
    for g, x, want in zip(got, ins, packed):
        assert g is x or np.shares_memory(g, x), "in-place result is not the input's memory"
        assert np.array_equal(g, want), "parts and packed TopK differ"
    bucket = [np.concatenate([d[i].reshape(-1) for i in (0, 2, 3)]) for d in data]
    want = expected("topk", "auto", bucket, packed_names, [shapes[i] for i in (0, 2, 3)],
                    state)
    check(np.concatenate([packed[i].reshape(-1) for i in (0, 2, 3)]), want, True,
          f"fused TopK step {step}")
print(tcp_links_line(R), flush=True)
print(f"rank {R}: engine compression ok", flush=True)
lcc.shutdown()
