"""Train a small MLP on scikit-learn's digits with each compressor (run under mpirun).

Data-parallel SGD with momentum: every rank computes the gradient of its share of each global
batch; as in the engine, the tensors of ``MIN_COMPRESS`` bytes or more (lightcc's default
``LCC_MIN_COMPRESS_BYTES``) form one bucket that the compressor sums over the ranks
(``compressor.allreduce`` over an ``MPICommunicator``, with the tensors' names, offsets and
shapes: what the engine calls), the smaller ones (biases) are summed exactly; the sum is
divided by the number of ranks. Each compressor runs every seed of ``SEEDS``; its accuracy
drop is the mean over seeds of (uncompressed accuracy - compressed accuracy) with the same
seed, and must stay within the bar. Rank 0 prints one table line per compressor: mean
accuracy, mean drop, standard deviation of the per-seed drops, bytes sent per run.

Usage: ``convergence_worker.py [SPEC=BAR ...]`` (default: ``BARS``); environment
``CONV_SEEDS`` (number of seeds), ``CONV_HIDDEN`` (hidden width) for exploring.
"""
from __future__ import annotations

import os
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
STEPS, BATCH, LR, MOMENTUM = 300, 64, 0.1, 0.9
HIDDEN = int(os.environ.get("CONV_HIDDEN", "128"))
SEEDS = tuple(range(int(os.environ.get("CONV_SEEDS", "12"))))
MIN_COMPRESS = 4096
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
BIG = [i for i, s in enumerate(SIZES) if 4 * s >= MIN_COMPRESS]     # compressed tensors
SMALL = [i for i in range(len(SIZES)) if i not in BIG]


def make_ctx(step: int) -> BucketContext:
    """The compressed bucket's layout, with the tensors' shapes (PowerSGD's matrices)."""
    names = tuple(list(SHAPES)[i] for i in BIG)
    sizes = tuple(SIZES[i] for i in BIG)
    offsets = tuple(int(o) for o in np.cumsum((0,) + sizes[:-1]))
    return BucketContext(names, offsets, sizes, 0, step, tuple(SHAPES[n] for n in names))


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


def parts(flat: np.ndarray, which: list[int]) -> np.ndarray:
    return np.concatenate([flat[OFFSETS[i]:OFFSETS[i] + SIZES[i]] for i in which])


def put(flat: np.ndarray, which: list[int], values: np.ndarray) -> None:
    pos = 0
    for i in which:
        flat[OFFSETS[i]:OFFSETS[i] + SIZES[i]] = values[pos:pos + SIZES[i]]
        pos += SIZES[i]


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
        big, small = parts(g, BIG), parts(g, SMALL)
        if comp is None:
            comm.allreduce(big, "sum")
        else:
            comp.allreduce(comm, big, make_ctx(step))
        comm.allreduce(small, "sum")
        put(g, BIG, big)
        put(g, SMALL, small)
        mom = MOMENTUM * mom + g           # g is already the batch mean (sum over ranks)
        flat -= LR * mom
    return accuracy(flat), comm.stats.bytes_sent - sent0


def main() -> int:
    bars = dict(BARS)
    if sys.argv[1:]:
        bars = {"none": 0.0}
        for arg in sys.argv[1:]:
            spec, _, bar = arg.partition("=")
            bars[spec] = float(bar) if bar else None
    results = {}
    for spec in bars:
        t0 = time.perf_counter()
        runs = [train_once(spec, s) for s in SEEDS]
        results[spec] = (np.array([a for a, _ in runs]), runs[0][1], time.perf_counter() - t0)
    failed = []
    base = results["none"][0]
    if ME == 0:
        print(f"{len(SEEDS)} seeds, hidden {HIDDEN}, compressed {[list(SHAPES)[i] for i in BIG]}")
        print(f"{'compressor':20s} {'acc %':>7s} {'drop':>6s} {'sd':>5s} {'max':>5s} "
              f"{'bytes/run':>10s} {'s':>5s}")
    for spec, (acc, nbytes, secs) in results.items():
        drops = base - acc
        bar = bars[spec]
        ok = bar is None or drops.mean() <= bar
        if ME == 0:
            print(f"{spec:20s} {acc.mean():7.2f} {drops.mean():6.2f} {drops.std(ddof=1):5.2f} "
                  f"{drops.max():5.2f} {nbytes:10d} {secs:5.1f}"
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
