"""The issue-42 regression check: an MLP trained by lightcc's DistributedOptimizer and by DDP on
gloo in the same processes, alternated round by round, with the page faults per step and the
peak RSS that exposed the flight recorder keeping every step's gradients alive.

    lccrun -np 2 python benchmarks/mlp_regression.py                        # 7.35 M MLP
    lccrun -np 2 python benchmarks/mlp_regression.py --dims 2048,4096,4096,10 --batch 8

Rank 0 prints one line per library: the median step of each round (ms), the median of the
rounds, rank 0's minor page faults per step in each round, then the ratio DDP step / lightcc
step (above 1: lightcc is faster) and the process's peak RSS (both models included). To compare
commits, run the same file with ``PYTHONPATH`` pointing at another checkout's ``lightcc``.
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import lightcc.torch as lcc


def mlp(dims: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in zip(dims[:-1], dims[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dims", default="3072,2048,512,10", help="layer widths (default 7.35 M)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per round")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    lcc.init()
    rank, size = lcc.rank(), lcc.size()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29600 + os.getppid() % 1000))
    dist.init_process_group("gloo", rank=rank, world_size=size)
    dims = [int(d) for d in args.dims.split(",")]
    torch.manual_seed(0)
    x, y = torch.randn(args.batch, dims[0]), torch.randint(0, dims[-1], (args.batch,))
    loss = nn.CrossEntropyLoss()
    m1 = mlp(dims)
    o1 = lcc.DistributedOptimizer(torch.optim.SGD(m1.parameters(), lr=0.01),
                                  named_parameters=m1.named_parameters())
    m2 = mlp(dims)
    ddp = nn.parallel.DistributedDataParallel(m2)
    o2 = torch.optim.SGD(m2.parameters(), lr=0.01)

    def step_lightcc() -> None:
        o1.zero_grad()
        loss(m1(x), y).backward()
        o1.step()

    def step_ddp() -> None:
        o2.zero_grad()
        loss(ddp(x), y).backward()
        o2.step()

    ms: dict[str, list[float]] = {"lightcc": [], "ddp": []}
    faults: dict[str, list[float]] = {"lightcc": [], "ddp": []}
    for _ in range(args.rounds):
        for name, step in (("lightcc", step_lightcc), ("ddp", step_ddp)):
            step()
            step()
            dist.barrier()
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step()
            ms[name].append((time.perf_counter() - t0) / args.steps * 1e3)
            faults[name].append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
                                / args.steps)
    if rank == 0:
        for name, v in ms.items():
            print(f"{name}: step ms per round {' '.join(f'{t:.0f}' for t in v)}, median "
                  f"{statistics.median(v):.0f}; page faults per step "
                  f"{' '.join(f'{f:.1f}' for f in faults[name])}", flush=True)
        ratio = statistics.median(ms["ddp"]) / statistics.median(ms["lightcc"])
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
        print(f"ddp step / lightcc step: {ratio:.2f}x; peak RSS {rss} MB", flush=True)
    dist.destroy_process_group()
    lcc.shutdown()


if __name__ == "__main__":
    main()
