"""Train a small MLP on scikit-learn's digits with each compressor (run under mpirun).

Data-parallel SGD with momentum: every rank computes the gradient of its share of each global
batch, the compressor sums the flat gradient bucket over the ranks (``compressor.allreduce``
over an ``MPICommunicator``, exactly what the engine will call), the sum is divided by the
number of ranks. Test accuracy (mean over seeds) of each compressor must stay within the
issue's bars of the uncompressed run. Rank 0 prints one table line per compressor.
"""
from __future__ import annotations

import sys
import time

import numpy as np
from mpi4py import MPI
from sklearn.datasets import load_digits

from lightcc.common import compression
from lightcc.common.backends.mpi import MPICommunicator
from lightcc.common.compression.base import BucketContext

comm = MPICommunicator(MPI.COMM_WORLD.Dup(), "world")
P, ME = comm.size, comm.rank
STEPS, BATCH, LR, MOMENTUM, HIDDEN = 300, 64, 0.1, 0.9, 32
SEEDS = (0, 1)
# spec -> allowed accuracy drop (points) vs "none"; None: reported only
BARS = {"none": 0.0, "fp16": 0.5, "bf16": 0.5, "fp8": 0.5, "fp8:e4m3:block:64": 0.5,
        "fp8_e5m2": 0.5, "topk:0.01:ef": 1.5, "topk:0.01:noef": None, "powersgd:2": 1.0}

digits = load_digits()
X = (digits.data / 16.0).astype(np.float32)
Y = digits.target
perm = np.random.default_rng(123).permutation(len(X))
train, test = perm[:1437], perm[1437:]
SHAPES = {"fc1.w": (64, HIDDEN), "fc1.b": (HIDDEN,), "fc2.w": (HIDDEN, 10), "fc2.b": (10,)}
SIZES = [int(np.prod(s)) for s in SHAPES.values()]
OFFSETS = [int(o) for o in np.cumsum([0] + SIZES[:-1])]


def make_ctx(step: int) -> BucketContext:
    """The bucket layout, with tensor shapes (PowerSGD needs them to find the matrices)."""
    args = (tuple(SHAPES), tuple(OFFSETS), tuple(SIZES), 0, step)
    try:
        return BucketContext(*args, shapes=tuple(SHAPES.values()))
    except TypeError:   # BucketContext without a shapes field yet
        import dataclasses

        @dataclasses.dataclass(frozen=True)
        class Shaped(BucketContext):
            shapes: tuple = ()

        return Shaped(*args, tuple(SHAPES.values()))


def unflatten(flat: np.ndarray) -> dict[str, np.ndarray]:
    return {k: flat[o:o + s].reshape(SHAPES[k]) for k, o, s in zip(SHAPES, OFFSETS, SIZES)}


def grad(w: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray, n_global: int) -> np.ndarray:
    """Gradient of the summed cross-entropy / n_global (so the rank sum is the batch mean)."""
    h = np.maximum(x @ w["fc1.w"] + w["fc1.b"], 0)
    z = h @ w["fc2.w"] + w["fc2.b"]
    z -= z.max(axis=1, keepdims=True)
    pr = np.exp(z)
    pr /= pr.sum(axis=1, keepdims=True)
    pr[np.arange(len(y)), y] -= 1
    dz = pr / n_global
    dh = (dz @ w["fc2.w"].T) * (h > 0)
    return np.concatenate([(x.T @ dh).ravel(), dh.sum(0), (h.T @ dz).ravel(), dz.sum(0)]
                          ).astype(np.float32)


def accuracy(flat: np.ndarray) -> float:
    w = unflatten(flat)
    h = np.maximum(X[test] @ w["fc1.w"] + w["fc1.b"], 0)
    return float(((h @ w["fc2.w"] + w["fc2.b"]).argmax(1) == Y[test]).mean() * 100)


def train_once(spec: str, seed: int) -> tuple[float, int]:
    comp = compression.make(spec)
    rng = np.random.default_rng(seed)
    flat = np.concatenate([rng.standard_normal(s).astype(np.float32) *
                           (np.sqrt(2.0 / SHAPES[k][0]) if len(SHAPES[k]) == 2 else 0)
                           for k, s in zip(SHAPES, SIZES)]).astype(np.float32)
    mom = np.zeros_like(flat)
    sent0 = comm.stats.bytes_sent
    for step in range(STEPS):
        batch = train[rng.integers(0, len(train), BATCH)]
        mine = np.array_split(batch, P)[ME]
        g = grad(unflatten(flat), X[mine], Y[mine], BATCH)
        ctx = make_ctx(step)
        if comp is None:
            comm.allreduce(g, "sum")
        else:
            comp.allreduce(comm, g, ctx)
        mom = MOMENTUM * mom + g           # g is already the batch mean (sum over ranks)
        flat -= LR * mom
    return accuracy(flat), comm.stats.bytes_sent - sent0


def main() -> int:
    results = {}
    for spec in BARS:
        t0 = time.perf_counter()
        runs = [train_once(spec, s) for s in SEEDS]
        acc = float(np.mean([a for a, _ in runs]))
        results[spec] = (acc, runs[0][1], time.perf_counter() - t0)
    failed = []
    base = results["none"][0]
    if ME == 0:
        print(f"{'compressor':20s} {'acc %':>7s} {'drop':>6s} {'bytes/run':>10s} {'s':>5s}")
    for spec, (acc, nbytes, secs) in results.items():
        bar = BARS[spec]
        ok = bar is None or base - acc <= bar
        if ME == 0:
            print(f"{spec:20s} {acc:7.2f} {base - acc:6.2f} {nbytes:10d} {secs:5.1f}"
                  f"{'' if ok else '  FAIL (bar ' + str(bar) + ')'}", flush=True)
        if not ok:
            failed.append(spec)
    if failed:
        print(f"rank {ME}: FAIL accuracy bars missed by {failed}", flush=True)
        return 1
    if ME == 0:
        print("OK convergence", flush=True)
    return 0


sys.exit(main())
