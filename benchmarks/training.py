"""Training throughput: lightcc's DistributedOptimizer vs torch DDP (gloo), same model and data.

Run on N ranks (both frameworks in the same processes, one after the other, alternating for
``--rounds`` rounds)::

    mpirun -np 2 python benchmarks/training.py            # or: lccrun -np 2 python ...

Model: an MLP 784 -> 2560 -> 2048 -> 10 (7.3 M parameters) on synthetic MNIST-shaped data,
``--batch-size`` samples per rank (default 32), SGD with momentum. Prints img/s (all ranks
together; best and median round, each round timed by its median step on the slowest rank)
for each framework and the ratio lightcc / DDP. ``--json PATH`` also writes them.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


def build_model(hidden: tuple[int, ...] = (2560, 2048)) -> nn.Module:
    layers: list[nn.Module] = []
    width = 784
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    layers.append(nn.Linear(width, 10))
    return nn.Sequential(nn.Flatten(), *layers)


def synthetic_batches(rank: int, batch: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 + rank)
    return [(torch.rand(batch, 1, 28, 28, generator=g), torch.randint(0, 10, (batch,), generator=g))
            for _ in range(count)]


def timed_steps(model: nn.Module, opt: torch.optim.Optimizer, data: list, warmup: int,
                iters: int, barrier) -> list[float]:
    """Seconds per step for ``iters`` steps after ``warmup`` (each step: fwd, bwd, step)."""
    times = []
    for i in range(warmup + iters):
        x, y = data[i % len(data)]
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    barrier()
    return times


def run_lightcc(args, data) -> float:
    import lightcc.torch as lcc

    lcc.init()
    torch.manual_seed(0)
    model = build_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    lcc.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = lcc.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=_compression(lcc, args.compression))
    times = timed_steps(model, opt, data, args.warmup, args.iters, lcc.barrier)
    rate = _rate(times, args.batch_size, lcc.size(), lambda v: lcc.allreduce(
        torch.tensor([v]), op=lcc.Max, name="bench.max").item())
    lcc.shutdown()
    return rate


def _compression(lcc, name: str):
    if name == "none":
        return lcc.Compression.none
    value = getattr(lcc.Compression, name)
    return value() if callable(value) else value


_KEEP_ALIVE: list = []   # DDP objects: freeing a Reducer can deadlock with gloo's threads


def run_ddp(args, data, rank: int, world: int) -> float:
    import torch.distributed as dist

    if not dist.is_initialized():    # one process group for every round (see _KEEP_ALIVE)
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(args.port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(build_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    _KEEP_ALIVE.append((model, opt))
    times = timed_steps(model, opt, data, args.warmup, args.iters, dist.barrier)

    def global_max(v: float) -> float:
        t = torch.tensor([v])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    return _rate(times, args.batch_size, world, global_max)


def _rate(times: list[float], batch: int, world: int, global_max) -> float:
    """img/s over all ranks, from the slowest rank's median step time."""
    return batch * world / global_max(statistics.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32, help="samples per rank")
    parser.add_argument("--iters", type=int, default=60, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0,
                        help="torch intra-op threads (0: cores / ranks)")
    parser.add_argument("--compression", default="none", help="lightcc Compression name")
    parser.add_argument("--only", choices=["lightcc", "ddp"], default=None)
    parser.add_argument("--port", type=int, default=29533)
    parser.add_argument("--json", default=None, help="write the results here (rank 0)")
    args = parser.parse_args()

    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0")))
    world = int(os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("PMI_SIZE", "1")))
    threads = args.threads or max(1, (os.cpu_count() or 1) // world)
    torch.set_num_threads(threads)
    data = synthetic_batches(rank, args.batch_size, 8)
    params = sum(p.numel() for p in build_model().parameters())
    results: dict[str, list[float]] = {"lightcc": [], "ddp": []}
    for _ in range(args.rounds):
        if args.only in (None, "lightcc"):
            results["lightcc"].append(run_lightcc(args, data))
        if args.only in (None, "ddp"):
            results["ddp"].append(run_ddp(args, data, rank, world))
    if rank == 0:
        best = {k: max(v) for k, v in results.items() if v}
        median = {k: statistics.median(v) for k, v in results.items() if v}
        print(f"MLP {params / 1e6:.1f} M parameters, batch {args.batch_size}/rank, {world} ranks, "
              f"{threads} torch thread(s)/rank, {args.iters} timed steps x {args.rounds} rounds")
        for name, value in best.items():
            rounds = ", ".join(f"{v:.0f}" for v in results[name])
            print(f"  {name:8s} best {value:6.0f} img/s  median {median[name]:6.0f} img/s"
                  f"   (rounds: {rounds})")
        if len(best) == 2:
            ratios = [a / b for a, b in zip(results["lightcc"], results["ddp"])]
            print(f"  ratio lightcc / DDP-gloo: best {best['lightcc'] / best['ddp']:.2f}x, "
                  f"median of per-round ratios {statistics.median(ratios):.2f}x")
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"params": params, "world": world, "batch": args.batch_size,
                           "results": results, "best": best, "median": median}, fh, indent=1)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    from mpi4py import MPI

    MPI.COMM_WORLD.Barrier()
    MPI.Finalize()
    os._exit(0)     # skip DDP/gloo teardown, which can deadlock at interpreter exit
