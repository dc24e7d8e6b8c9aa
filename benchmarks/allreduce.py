"""Allreduce latency and bus bandwidth: lightcc (named: through the engine; unnamed: the
direct path up to LCC_DIRECT_BYTES, through the NumPy and the torch API; out of place, a new
result per call, as ``lcc.allreduce(x)`` returns; and ``dist.all_reduce`` on a lightcc process
group) vs raw mpi4py vs torch.distributed (gloo), side by side, in one run. A second table gives
each of those ways against the better of mpi4py and gloo, and every column's slowest call
against its p50.

    lccrun -np 2 python benchmarks/allreduce.py            # or: mpirun -np 2 python ...
    lccrun -np 2 python benchmarks/allreduce.py --max-size 64MB --quick
    # 2 simulated hosts at 1 Gbit (root; tests/netns): lightcc's auto and native algorithms,
    # Open MPI's allreduce, gloo, and the line rate (raw TCP and MPI Sendrecv), same run
    python tests/netns/simhosts.py --ranks-per-host 1 -- benchmarks/allreduce.py \
        --sizes 4MB,16MB --algorithms auto,native --line-rate --rounds 3

``--algorithms`` runs the named lightcc column once per algorithm (``init(algorithm=...)``
each time); ``--rounds`` repeats every column (of an algorithm) that often and reports the median of the rounds'
p50s. The peers (mpi4py, gloo, the line rate) are measured right after each lightcc column's
size, and the ratio columns are medians of those back-to-back pairs, so a busy machine's slow
phases hit both sides of a ratio. ``--line-rate`` adds what the link carries outside any collective: each
rank sends the bytes a bandwidth-optimal allreduce sends (``2(n-1)/n`` x size) to the next
rank while receiving as much from the previous one, over a plain TCP socket (iperf-style) and
with ``MPI_Sendrecv``; their "bus bandwidth" is the most an allreduce can reach.

Bus bandwidth = 2(n-1)/n * bytes / time (the usual NCCL-tests definition). p50 over the
timed iterations; the number of iterations per size adapts to a time budget. Rank 0 prints
one table; ratios are lightcc / peer (higher is better for bandwidth).
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
import time

import numpy as np

import lightcc as lcc  # isort: skip  (before mpi4py: it sets Open MPI's parameters first)
from mpi4py import MPI  # isort: skip

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plots import busbw  # noqa: E402  (benchmarks/plots.py: matplotlib only when plotting)

SIZES = [4, 64, 1 << 10, 16 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20]


def parse_size(text: str) -> int:
    text = text.strip().upper()
    for suffix, mult in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10), ("B", 1)):
        if text.endswith(suffix):
            return int(float(text[:-len(suffix)]) * mult)
    return int(text)


def timed(fn, nbytes: int, budget: float, comm) -> tuple[float, float]:
    """(p50, slowest) seconds of ``fn()`` with iterations chosen so a size takes about
    ``budget`` s."""
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
    return float(np.median(samples)), float(max(samples))


def iface_addr(name: str) -> str:
    """The IPv4 address of interface ``name`` (Linux), or 127.0.0.1 when it has none."""
    import fcntl
    import struct

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
        return socket.inet_ntoa(packed[20:24])               # SIOCGIFADDR
    except OSError:
        return "127.0.0.1"


def gloo_group(rank: int, size: int, addr: str, iface: str):
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return None, None
    if addr != "127.0.0.1":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", iface)
    port = MPI.COMM_WORLD.bcast(_free_port(addr) if rank == 0 else None, root=0)
    master = MPI.COMM_WORLD.bcast(addr, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=rank,
                            world_size=size)
    return torch, dist


def _free_port(addr: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


class LineRate:
    """Raw exchanges around the ring (rank r sends to r + 1, receives from r - 1): a TCP socket
    pair and ``MPI_Sendrecv``, each moving the bytes a bandwidth-optimal allreduce sends."""

    def __init__(self, comm, addr: str) -> None:
        self.comm = comm
        listener = socket.socket()
        listener.bind((addr, 0))
        listener.listen(1)
        peers = comm.allgather((addr, listener.getsockname()[1]))
        n, r = comm.size, comm.rank
        self.right, self.left = (r + 1) % n, (r - 1) % n
        self.out = socket.create_connection(peers[self.right])
        self.inc, _ = listener.accept()
        listener.close()

    def tcp(self, send: np.ndarray, recv: np.ndarray) -> None:
        sender = threading.Thread(target=self.out.sendall, args=(memoryview(send).cast("B"),))
        sender.start()
        view, got = memoryview(recv).cast("B"), 0
        while got < view.nbytes:
            got += self.inc.recv_into(view[got:])
        sender.join()

    def mpi(self, send: np.ndarray, recv: np.ndarray) -> None:
        self.comm.Sendrecv([send, MPI.BYTE], self.right, 77, [recv, MPI.BYTE], self.left, 77)

    def close(self) -> None:
        self.out.close()
        self.inc.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-size", default="256MB", help="largest message (default 256MB)")
    ap.add_argument("--sizes", default="", help="comma-separated sizes instead (e.g. 4MB,16MB)")
    ap.add_argument("--budget", type=float, default=0.4, help="seconds per size and library")
    ap.add_argument("--quick", action="store_true", help="short run (budget 0.1 s)")
    ap.add_argument("--no-gloo", action="store_true", help="skip torch.distributed")
    ap.add_argument("--algorithms", default="",
                    help="LCC_ALGORITHM values for the named lightcc column, comma separated "
                         "(default: the environment's, usually auto)")
    ap.add_argument("--line-rate", action="store_true",
                    help="add raw TCP and MPI_Sendrecv exchanges of the same bytes")
    ap.add_argument("--no-unnamed", action="store_true",
                    help="skip the unnamed lightcc columns")
    ap.add_argument("--rounds", type=int, default=1, help="repeat every column (median)")
    ap.add_argument("--plot", default="", metavar="FILE.png",
                    help="also draw bus bandwidth against size, every column (matplotlib)")
    ap.add_argument("--iface", default="lcc0",
                    help="interface for gloo and the raw TCP exchange when it exists "
                         "(the simulated hosts' link), else loopback")
    args = ap.parse_args()
    budget = 0.1 if args.quick else args.budget
    algos = [a for a in args.algorithms.split(",") if a] or [None]
    comm = MPI.COMM_WORLD
    rank, n = comm.rank, comm.size
    addr = iface_addr(args.iface)
    torch, dist = (None, None) if args.no_gloo else gloo_group(rank, n, addr, args.iface)
    line = LineRate(comm, addr) if args.line_rate else None
    if args.sizes:
        sizes = [parse_size(s) for s in args.sizes.split(",")]
    else:
        sizes = [s for s in SIZES if s <= parse_size(args.max_size)]
    samples: dict[tuple[int, str], list[float]] = {}
    paired: dict[tuple[int, str], list[float]] = {}   # lightcc / peer bandwidth, back to back
    worst: dict[tuple[int, str], float] = {}          # slowest call / its round's p50, max

    def measure(nbytes: int, col: str, fn) -> float:
        seconds, slowest = timed(fn, nbytes, budget, comm)
        samples.setdefault((nbytes, col), []).append(seconds)
        worst[nbytes, col] = max(worst.get((nbytes, col), 0.0), slowest / seconds)
        return seconds

    def peers(nbytes: int) -> dict[str, float]:
        """The other libraries and the line rate, right after a lightcc column's size."""
        x = np.random.default_rng(rank).random(max(1, nbytes // 4), dtype=np.float32)
        out = np.empty_like(x)
        got = {"mpi4py": measure(nbytes, "mpi4py", lambda: comm.Allreduce(x, out, op=MPI.SUM))}
        if dist is not None:
            t = torch.from_numpy(x.copy())
            got["gloo"] = measure(nbytes, "gloo", lambda: dist.all_reduce(t))
        if line is not None and n > 1:
            moved = np.ones(max(1, 2 * (n - 1) * nbytes // n), np.uint8)
            into = np.empty_like(moved)
            got["tcp"] = measure(nbytes, "tcp", lambda: line.tcp(moved, into))
            got["sendrecv"] = measure(nbytes, "sendrecv", lambda: line.mpi(moved, into))
        return got

    for algo in algos:
        lcc.init(**({"algorithm": algo} if algo else {}))
        col = "lightcc" if algo is None else f"lightcc[{algo}]"
        apis = algo is algos[0] and not args.no_unnamed
        group = None
        if apis and dist is not None:
            import lightcc.torch as lcc_torch

            # the c10d backend, as DDP and dist.all_reduce users reach lightcc
            group = dist.new_group(backend="lightcc")
        for _ in range(args.rounds):
            for nbytes in sizes:
                x = np.random.default_rng(rank).random(max(1, nbytes // 4), dtype=np.float32)
                out = np.empty_like(x)
                mine = measure(nbytes, col, lambda: lcc.allreduce(x, op=lcc.Sum, name="bench",
                                                                  out=out))
                if apis:
                    # unnamed, as most Horovod scripts call it for metrics (matched by order)
                    measure(nbytes, "lightcc-unnamed",
                            lambda: lcc.allreduce(x, op=lcc.Sum, out=out))
                    # unnamed and out of place: a new result array per call
                    measure(nbytes, "lightcc-new", lambda: lcc.allreduce(x, op=lcc.Sum))
                    if dist is not None:
                        t = torch.from_numpy(x.copy())
                        # the Horovod-style torch API, unnamed (hvd.allreduce(tensor))
                        measure(nbytes, "lightcc.torch-unnamed",
                                lambda: lcc_torch.allreduce(t, op=lcc.Sum))
                        tc = torch.from_numpy(x.copy())
                        measure(nbytes, "lightcc-c10d",
                                lambda: dist.all_reduce(tc, group=group))
                for peer, seconds in peers(nbytes).items():
                    paired.setdefault((nbytes, f"{col}/{peer}"), []).append(seconds / mine)
                if rank == 0:
                    print(f"  measured {col} {nbytes} B", file=sys.stderr, flush=True)
        if group is not None:
            dist.destroy_process_group(group)
        lcc.shutdown()
    rows = []
    for nbytes in sizes:
        rows.append((nbytes, {col: float(np.median(v)) for (b, col), v in samples.items()
                              if b == nbytes},
                      {key: float(np.median(v)) for (b, key), v in paired.items() if b == nbytes}))
    if rank == 0:
        print_table(rows, n)
        print_api_table(rows, worst)
        if args.plot:
            from plots import plot_allreduce

            plot_allreduce(rows, n, args.plot)
            print(f"plot: {args.plot}")
    if line is not None:
        line.close()
    if dist is not None:
        dist.destroy_process_group()


def fmt_size(n: int) -> str:
    for unit, div in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= div:
            return f"{n / div:g} {unit}"
    return f"{n} B"


def print_table(rows, n: int) -> None:
    """One row per size: p50 and bus bandwidth per column (median over rounds), then each
    lightcc column against each peer as the median of back-to-back ratios (a peer is measured
    right after every lightcc column's size, so slow phases of a busy machine hit both), then
    each column's bandwidth as a share of the raw TCP exchange's."""
    first = rows[0][1]
    libs = [k for k in first if k.startswith("lightcc")]
    peers = [k for k in ("mpi4py", "gloo") if k in first]
    bounds = [k for k in ("tcp", "sendrecv") if k in first]
    cols = libs + peers + bounds
    named = [lib for lib in libs if lib == "lightcc" or lib.startswith("lightcc[")]
    head = ["size"] + [f"{c} p50 us" for c in cols] + [f"{c} busbw GB/s" for c in cols]
    head += [f"{lib}/{peer} bw" for lib in named for peer in peers + bounds]
    if "gloo" in peers and "lightcc-unnamed" in first:
        head += ["unnamed p50 / gloo p50", "torch unnamed p50 / gloo p50"]
    print(f"allreduce float32 sum, {n} ranks, host {socket.gethostname()}, pid-local time, "
          "p50 (median over rounds); ratios: median of back-to-back pairs")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for nbytes, res, pairs in rows:
        lat = [f"{res[c] * 1e6:.1f}" for c in cols]
        bw = {c: busbw(nbytes, res[c], n) for c in cols}
        cells = [fmt_size(nbytes), *lat, *(f"{bw[c]:.3f}" for c in cols)]
        cells += [f"{pairs[f'{lib}/{peer}']:.2f}x" for lib in named for peer in peers + bounds]
        if "gloo" in peers and "lightcc-unnamed" in res:
            cells.append(f"{res['lightcc-unnamed'] / res['gloo']:.2f}x")
            if "lightcc.torch-unnamed" in res:
                cells.append(f"{res['lightcc.torch-unnamed'] / res['gloo']:.2f}x")
        print("| " + " | ".join(cells) + " |")


API_COLUMNS = ("lightcc", "lightcc-unnamed", "lightcc-new", "lightcc.torch-unnamed",
               "lightcc-c10d")


def print_api_table(rows, worst: dict) -> None:
    """Each way a user calls lightcc against the better of mpi4py and gloo (p50 / p50, lower is
    better), and each column's slowest call against its round's p50 (max over rounds): a
    bimodal size shows there, not in the medians."""
    first = rows[0][1]
    cols = [c for c in API_COLUMNS if c in first]
    peers = [k for k in ("mpi4py", "gloo") if k in first]
    if not cols or not peers:
        return
    head = ["size"] + [f"{c} / best peer" for c in cols] + \
        [f"{c} slowest/p50" for c in cols + peers]
    print("\np50 against the better of " + " and ".join(peers) + " at each size (1.00x = as "
          "fast; lower is better); slowest call / p50 (max over rounds)")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for nbytes, res, _pairs in rows:
        best = min(res[p] for p in peers)
        cells = [fmt_size(nbytes)] + [f"{res[c] / best:.2f}x" for c in cols]
        cells += [f"{worst[nbytes, c]:.1f}" for c in cols + peers]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
