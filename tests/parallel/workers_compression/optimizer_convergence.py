"""An MLP on scikit-learn's digits through lightcc.torch's DistributedOptimizer (mpirun -np 2).

A 64-128-10 ReLU MLP (He initialization). Each compressor of the command line
(``SPEC=BAR``) trains ``CONV_SEEDS`` seeds (default 12) of the same model, data order and
initialization as the uncompressed run, for ``STEPS``
steps of SGD with momentum, batch 64 split over the ranks; the engine applies the compressor
as in any training script (tensors under LCC_MIN_COMPRESS_BYTES uncompressed). The accuracy
drop is the mean over seeds of (uncompressed - compressed) test accuracy with the same seed
(360 test images: one image is 0.28 point) and must stay within the bar. Rank 0 prints one
line per compressor: mean accuracy, mean drop, standard deviation of the per-seed drops.
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np
import torch
import torch.nn as nn
from sklearn.datasets import load_digits

import lightcc.torch as lcc

STEPS, BATCH, LR, MOMENTUM = 300, 64, 0.1, 0.9
HIDDEN = int(os.environ.get("CONV_HIDDEN", "128"))
SEEDS = tuple(range(int(os.environ.get("CONV_SEEDS", "12"))))

digits = load_digits()
X = torch.tensor(digits.data / 16.0, dtype=torch.float32)
Y = torch.tensor(digits.target)
perm = np.random.default_rng(123).permutation(len(X))
TRAIN, TEST = perm[:1437], perm[1437:]


def train(spec: str, seed: int) -> float:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 10))
    for layer in (model[0], model[2]):          # He initialization (ReLU), zero biases
        nn.init.kaiming_normal_(layer.weight)
        nn.init.zeros_(layer.bias)
    opt = lcc.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM),
        named_parameters=[(f"s{seed}.{n}", p) for n, p in model.named_parameters()],
        compression=spec)
    lcc.broadcast_parameters(model.state_dict(), root_rank=0)
    rng = np.random.default_rng(seed)
    for _ in range(STEPS):
        batch = TRAIN[rng.integers(0, len(TRAIN), BATCH)]
        mine = np.array_split(batch, lcc.size())[lcc.rank()]
        opt.zero_grad()
        nn.functional.cross_entropy(model(X[mine]), Y[mine]).backward()
        opt.step()
    with torch.no_grad():
        return (model(X[TEST]).argmax(1) == Y[TEST]).float().mean().item() * 100


def main() -> int:
    lcc.init()
    bars = {"none": 0.0}
    for arg in sys.argv[1:]:
        spec, _, bar = arg.partition("=")
        bars[spec] = float(bar) if bar else None
    acc, secs = {}, {}
    for spec in bars:
        t0 = time.perf_counter()
        acc[spec] = np.array([train(spec, s) for s in SEEDS])
        secs[spec] = time.perf_counter() - t0
    failed = []
    if lcc.rank() == 0:
        print(f"{len(SEEDS)} seeds, hidden {HIDDEN}; {'compressor':20s} {'acc %':>7s} "
              f"{'drop':>6s} {'sd':>5s} {'s':>5s}")
    for spec, a in acc.items():
        drops = acc["none"] - a
        ok = bars[spec] is None or drops.mean() <= bars[spec]
        if lcc.rank() == 0:
            print(f"{spec:20s} {a.mean():7.2f} {drops.mean():6.2f} "
                  f"{drops.std(ddof=1) if len(drops) > 1 else 0.0:5.2f} {secs[spec]:5.1f}"
                  f"{'' if ok else '  FAIL (bar ' + str(bars[spec]) + ')'} "
                  f"per seed {np.round(drops, 2).tolist()}", flush=True)
        if not ok:
            failed.append(spec)
    lcc.shutdown()
    if failed:
        print(f"FAIL accuracy bars missed by {failed}", flush=True)
        return 1
    print("OK optimizer convergence", flush=True)
    return 0


sys.exit(main())
