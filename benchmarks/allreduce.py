"""Allreduce latency and bus bandwidth: lightcc (named: through the engine; unnamed: the
direct path up to LCC_DIRECT_BYTES, through the NumPy and the torch API) vs raw mpi4py vs
torch.distributed (gloo), side by side, in one run.

    lccrun -np 2 python benchmarks/allreduce.py            # or: mpirun -np 2 python ...
    lccrun -np 2 python benchmarks/allreduce.py --max-size 64MB --quick

Bus bandwidth = 2(n-1)/n * bytes / time (the usual NCCL-tests definition). p50 over the
timed iterations; the number of iterations per size adapts to a time budget. Rank 0 prints
one table; ratios are lightcc / peer (higher is better for bandwidth).
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import time

import numpy as np
from mpi4py import MPI

SIZES = [4, 64, 1 << 10, 16 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20]


def parse_size(text: str) -> int:
    text = text.strip().upper()
    for suffix, mult in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10), ("B", 1)):
        if text.endswith(suffix):
            return int(float(text[:-len(suffix)]) * mult)
    return int(text)


def timed(fn, nbytes: int, budget: float, comm) -> float:
    """p50 seconds of ``fn()`` with iterations chosen so a size takes about ``budget`` s."""
    fn()
    fn()
    t0 = time.perf_counter()
    fn()
    one = time.perf_counter() - t0
    iters = int(comm.allreduce(max(5, min(2000, int(budget / max(one, 1e-6)))), op=MPI.MIN))
    samples = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return float(np.median(samples))


def gloo_group(rank: int, size: int):
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return None, None
    port = MPI.COMM_WORLD.bcast(_free_port() if rank == 0 else None, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)
    return torch, dist


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-size", default="256MB", help="largest message (default 256MB)")
    ap.add_argument("--budget", type=float, default=0.4, help="seconds per size and library")
    ap.add_argument("--quick", action="store_true", help="short run (budget 0.1 s)")
    ap.add_argument("--no-gloo", action="store_true", help="skip torch.distributed")
    args = ap.parse_args()
    budget = 0.1 if args.quick else args.budget
    import lightcc as lcc

    lcc.init()
    comm = MPI.COMM_WORLD
    rank, n = comm.rank, comm.size
    torch, dist = (None, None) if args.no_gloo else gloo_group(rank, n)
    sizes = [s for s in SIZES if s <= parse_size(args.max_size)]
    rows = []
    for nbytes in sizes:
        x = np.random.default_rng(rank).random(max(1, nbytes // 4), dtype=np.float32)
        out = np.empty_like(x)
        res = {}
        res["lightcc"] = timed(lambda: lcc.allreduce(x, op=lcc.Sum, name="bench", out=out),
                               nbytes, budget, comm)
        # unnamed, as most Horovod scripts call it for metrics (matched by call order)
        res["lightcc-unnamed"] = timed(lambda: lcc.allreduce(x, op=lcc.Sum, out=out),
                                       nbytes, budget, comm)
        res["mpi4py"] = timed(lambda: comm.Allreduce(x, out, op=MPI.SUM), nbytes, budget, comm)
        if dist is not None:
            t = torch.from_numpy(x.copy())
            import lightcc.torch as lcc_torch

            # the Horovod-style torch API, unnamed (hvd.allreduce(tensor) in a script)
            res["lightcc.torch-unnamed"] = timed(lambda: lcc_torch.allreduce(t, op=lcc.Sum),
                                                 nbytes, budget, comm)
            res["gloo"] = timed(lambda: dist.all_reduce(t), nbytes, budget, comm)
        rows.append((nbytes, res))
        if rank == 0:
            print(f"  measured {nbytes} B", file=sys.stderr, flush=True)
    if rank == 0:
        print_table(rows, n)
    if dist is not None:
        dist.destroy_process_group()
    lcc.shutdown()


def fmt_size(n: int) -> str:
    for unit, div in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= div:
            return f"{n / div:g} {unit}"
    return f"{n} B"


def print_table(rows, n: int) -> None:
    libs = [k for k in ("lightcc", "lightcc-unnamed", "lightcc.torch-unnamed", "mpi4py", "gloo")
            if k in rows[0][1]]
    peers = [lib for lib in libs if not lib.startswith("lightcc")]
    factor = 2 * (n - 1) / n
    head = ["size"] + [f"{lib} p50 us" for lib in libs] + [f"{lib} busbw GB/s" for lib in libs]
    head += [f"lightcc/{lib} bw" for lib in peers]
    if "gloo" in peers:
        head += ["unnamed p50 / gloo p50", "torch unnamed p50 / gloo p50"]
    print(f"allreduce float32 sum, {n} ranks, host {socket.gethostname()}, "
          f"pid-local time, p50")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for nbytes, res in rows:
        lat = [f"{res[lib] * 1e6:.1f}" for lib in libs]
        bw = [factor * nbytes / res[lib] / 1e9 for lib in libs]
        ratio = [f"{bw[0] / bw[libs.index(lib)]:.2f}x" for lib in peers]
        if "gloo" in peers:
            ratio.append(f"{res['lightcc-unnamed'] / res['gloo']:.2f}x")
            ratio.append(f"{res['lightcc.torch-unnamed'] / res['gloo']:.2f}x")
        print("| " + " | ".join([fmt_size(nbytes), *lat, *(f"{b:.2f}" for b in bw), *ratio])
              + " |")


if __name__ == "__main__":
    main()
