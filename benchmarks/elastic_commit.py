"""Cost of ``TorchState.commit()`` per MB of state (issue 26): a model of ``--mb`` MB of float32
parameters with an SGD-momentum optimizer (as much state again), committed ``--rounds`` times.
One process, no MPI: a commit copies into host memory (on a multi-rank job it adds one
8-byte allreduce for the host check), so this is its cost on every rank.

    python benchmarks/elastic_commit.py [--mb 1 16 64] [--rounds 7]

Prints, per size, the median and range of one commit, and the median in ms per MB of
parameters + optimizer state.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from lightcc.torch.elastic import TorchState  # noqa: E402


def one_size(mb: float, rounds: int) -> list[float]:
    n = int(mb * (1 << 20) / 4)
    width = 1024
    model = torch.nn.Sequential(torch.nn.Linear(width, max(1, n // width), bias=False))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, width)).sum().backward()
    opt.step()                                     # momentum buffers exist: 2x mb of state
    state = TorchState(model, opt, epoch=0)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        state.commit()
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, nargs="+", default=[1, 16, 64])
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()
    torch.set_num_threads(1)
    for mb in a.mb:
        t = one_size(mb, a.rounds)
        med = statistics.median(t)
        print(f"{mb:g} MB params (+{mb:g} MB momentum): commit {med * 1e3:.2f} ms median "
              f"({min(t) * 1e3:.2f}-{max(t) * 1e3:.2f}), {med * 1e3 / (2 * mb):.2f} ms per MB")


if __name__ == "__main__":
    main()
