"""Bus bandwidth of lightcc's allreduce algorithms (and torch gloo) across simulated hosts.

One command (root, Linux) builds network namespaces joined by rate-limited links
(tests/netns/simhosts.py), runs this file under mpirun across them for every configuration
and prints one table::

    python benchmarks/topology.py                      # 1 MB - 64 MB, ~ a few minutes
    python benchmarks/topology.py --full               # 1 MB - 256 MB
    python benchmarks/topology.py --rates 1gbit --layouts 2x2 --algorithms flat,hierarchical

Bus bandwidth = ``bytes * 2 (p - 1) / p / time`` (NCCL-tests' definition): for a bandwidth-
optimal allreduce it equals the per-rank link rate, so "% line" compares it with the shaped
rate. Rows are printed as the runs finish; with ``--json`` every row is also written there.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

MB = 1 << 20
ALGORITHMS = ["flat", "ring", "hierarchical", "2d"]


# -- worker: runs on every rank under mpirun ----------------------------------------------------
def _time_it(fn, nbytes: int, barrier, min_reps: int = 2, budget_s: float = 2.0) -> float:
    """Median seconds of ``fn()`` after one warm-up; repetitions fit in ``budget_s``.

    The repetition count comes from the slowest rank's warm-up so that every rank makes the
    same number of collective calls.
    """
    from mpi4py import MPI

    barrier()
    t0 = time.perf_counter()
    fn()
    first = MPI.COMM_WORLD.allreduce(time.perf_counter() - t0, op=MPI.MAX)
    reps = max(min_reps, min(10, int(budget_s / max(first, 1e-4))))
    times = []
    for _ in range(reps):
        barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def worker(args: argparse.Namespace) -> None:
    import numpy as np
    from mpi4py import MPI

    from lightcc.common import algorithms, compression, topology
    from lightcc.common.backends.mpi import MPICommunicator
    from lightcc.common.compression.base import BucketContext

    world = MPICommunicator(MPI.COMM_WORLD.Dup(), "world")
    # Simulated hosts have their own host names (UTS namespaces): nodes come from them.
    topo = topology.build(world, MPI.COMM_WORLD.allgather(MPI.Get_processor_name()), 0)
    p = topo.size
    label = f"{topo.num_nodes}x{topo.local_size}"

    def emit(name: str, nbytes: int, seconds: float) -> None:
        if topo.rank == 0:
            bus = nbytes * 2 * (p - 1) / p / seconds if p > 1 else 0.0
            print("ROW " + json.dumps({"layout": label, "algorithm": name, "bytes": nbytes,
                                       "seconds": seconds, "busbw_bps": bus * 8}), flush=True)

    sizes = [int(s) * MB for s in args.sizes.split(",")]
    runs = [(a, "none") for a in args.algorithms.split(",") if a and a != "gloo"]
    for spec in filter(None, args.compression.split(",")):
        runs.append((args.compressed_algorithm, spec))
    for algo, spec in runs:
        try:
            comp = compression.make(spec)
        except ValueError as exc:
            if topo.rank == 0:
                print(f"SKIP {algo}+{spec}: {exc}", flush=True)
            continue
        name = algo if spec == "none" else f"{algo}+{spec}"
        for nbytes in sizes:
            buf = np.ones(nbytes // 4, np.float32)
            ctx = BucketContext(("bench",), (0,), (buf.size,))
            run = lambda: algorithms.allreduce(buf, "sum", topo, comp, ctx, algo)  # noqa: E731
            emit(name, nbytes, _time_it(run, nbytes, world.barrier))
    if "gloo" in args.algorithms.split(","):
        _gloo(args, sizes, topo.rank, p, emit, world.barrier)
    topo.free()


def _gloo(args, sizes, rank, p, emit, barrier) -> None:
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        if rank == 0:
            print("SKIP gloo: torch not importable", flush=True)
        return
    os.environ.setdefault("GLOO_SOCKET_IFNAME", args.iface)
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}:29533",
                            rank=rank, world_size=p)
    for nbytes in sizes:
        t = torch.ones(nbytes // 4, dtype=torch.float32)
        emit("gloo", nbytes, _time_it(lambda: dist.all_reduce(t), nbytes, barrier))
    dist.destroy_process_group()


# -- driver: sets up namespaces and launches the workers -------------------------------------------
def driver(args: argparse.Namespace) -> int:
    from tests.netns.simhosts import SimHosts, rate_bits, unavailable_reason

    reason = unavailable_reason()
    if reason:
        print(f"topology benchmark needs simulated hosts: {reason}", file=sys.stderr)
        return 2
    rows = []
    header = f"{'rate':>7} {'layout':>6} {'algorithm':>18} {'size':>7} {'ms':>9} " \
             f"{'busbw Gb/s':>10} {'% line':>7}"
    print(header, flush=True)
    print("-" * len(header), flush=True)
    for rate in args.rates.split(","):
        for layout in args.layouts.split(","):
            hosts, per_host = (int(x) for x in layout.split("x"))
            with SimHosts(hosts, rate, mtu=args.mtu) as sim:
                cmd = [__file__, "--worker", "--sizes", args.sizes, "--algorithms",
                       args.algorithms, "--compression", args.compression if rate == args.rates.split(",")[0] else "",
                       "--compressed-algorithm", args.compressed_algorithm,
                       "--master", sim.addrs[0]]
                res = sim.run(per_host, cmd, num_links=args.num_links, timeout=args.timeout,
                              btl=args.btl)
                for line in res.stdout.splitlines():
                    if line.startswith("ROW "):
                        row = json.loads(line[4:]) | {"rate": rate, "num_links": args.num_links}
                        row["line_fraction"] = row["busbw_bps"] / rate_bits(rate)
                        rows.append(row)
                        print(f"{rate:>7} {layout:>6} {row['algorithm']:>18} "
                              f"{row['bytes'] // MB:>5}MB {row['seconds'] * 1e3:>9.1f} "
                              f"{row['busbw_bps'] / 1e9:>10.3f} {100 * row['line_fraction']:>6.1f}%",
                              flush=True)
                    elif line.startswith("SKIP"):
                        print(f"{rate:>7} {layout:>6} {line}", flush=True)
                if res.returncode != 0:
                    print(f"{rate} {layout}: mpirun exited {res.returncode}\n{res.stdout[-3000:]}",
                          file=sys.stderr)
                    return 1
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--master", default="127.0.0.1", help=argparse.SUPPRESS)
    ap.add_argument("--iface", default="lcc0", help=argparse.SUPPRESS)
    ap.add_argument("--rates", default="1gbit,10gbit", help="tbf rates, comma separated")
    ap.add_argument("--layouts", default="2x1,2x2", help="HOSTSxRANKS, comma separated")
    ap.add_argument("--sizes", default="1,4,16,64", help="MB, comma separated")
    ap.add_argument("--full", action="store_true", help="sizes 1,4,16,64,256 MB")
    ap.add_argument("--algorithms", default=",".join(ALGORITHMS + ["gloo"]))
    ap.add_argument("--compression", default="",
                    help="compressor specs run at the first rate (e.g. fp16,fp8,topk)")
    ap.add_argument("--compressed-algorithm", default="hierarchical")
    ap.add_argument("--num-links", type=int, default=2, help="Open MPI btl_tcp_links")
    ap.add_argument("--btl", default="tcp,sm,self", help="Open MPI btl list")
    ap.add_argument("--mtu", type=int, default=1500)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--json", default="", help="also write all rows to this file")
    args = ap.parse_args(argv)
    if args.full:
        args.sizes = "1,4,16,64,256"
    if args.worker:
        worker(args)
        return 0
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
