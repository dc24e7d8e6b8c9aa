"""Run on every rank: each algorithm x op x dtype x size against a NumPy reference.

Usage: check_algorithms.py LOCAL_SIZE [--quick] (LOCAL_SIZE 0: nodes from host names, as on
the simulated hosts of tests/netns). Every rank builds every rank's input from a
seed, so the reference is computed locally without MPI. Also checks that all ranks hold
bit-identical results, that a compressor sees only the cross communicator (hierarchical, 2d, native)
or the world (flat, ring, tree), and that ``allreduce(..., "auto")`` runs what ``choose`` says.
Exits non-zero with a message naming the case on the first failure.
"""
from __future__ import annotations

import sys
import zlib

import numpy as np
from mpi4py import MPI

from lightcc.common import algorithms, topology
from lightcc.common.algorithms import hierarchical, ring
from lightcc.common.arrays import displacements, even_counts
from lightcc.common.backends.mpi import MPICommunicator
from lightcc.common.compression.base import BucketContext

ALGOS = ["flat", "ring", "hierarchical", "2d", "tree", "native"]
OPS = ["sum", "min", "max", "prod"]
DTYPES = [np.float32, np.float64, np.int32, np.int64]
SIZES = [0, 1, 2, 7, 1003]
LARGE = 1_000_003
BITWISE = {"band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}


class RecordingCompressor:
    """Exact test compressor: a plain sum over the given comm, recording every call."""

    name = "record"
    lossy = False

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int, int]] = []

    def allreduce(self, comm, buf, ctx: BucketContext) -> None:
        self.calls.append((comm.name, comm.size, int(buf.size), ctx.base))
        comm.allreduce(buf, "sum")

    def wire_bytes(self, numel: int, nranks: int) -> int:
        return 4 * numel

    def state_dict(self):
        return {}

    def load_state_dict(self, state) -> None:
        pass


def make_input(rank: int, n: int, dtype, op: str, case: int) -> np.ndarray:
    rng = np.random.default_rng([rank, n, case])
    if op in BITWISE:
        return rng.integers(0, 256, size=n).astype(dtype)
    if op == "prod":
        return rng.choice(np.array([1, -1, 2, 1], dtype=dtype), size=n)
    if np.issubdtype(dtype, np.integer):
        return rng.integers(-1000, 1000, size=n).astype(dtype)
    return rng.standard_normal(n).astype(dtype)


def reference(p: int, n: int, dtype, op: str, case: int) -> np.ndarray:
    stack = np.stack([make_input(r, n, dtype, op, case) for r in range(p)]) if n else \
        np.zeros((p, 0), dtype)
    if op in BITWISE:
        return BITWISE[op].reduce(stack, axis=0).astype(dtype)
    fn = {"sum": np.sum, "prod": np.prod, "min": np.min, "max": np.max}[op]
    return fn(stack, axis=0).astype(dtype)


def fail(msg: str) -> None:
    sys.stderr.write(f"rank {MPI.COMM_WORLD.rank}: FAIL {msg}\n")
    sys.stderr.flush()
    MPI.COMM_WORLD.Abort(1)


def check(topo, algo: str, op: str, dtype, n: int, case: int, ctx: BucketContext) -> None:
    p, me = topo.size, topo.rank
    buf = make_input(me, n, dtype, op, case)
    algorithms._REGISTRY[algo](buf, op, topo, None, ctx)
    want = reference(p, n, dtype, op, case)
    label = f"{algo} op={op} dtype={np.dtype(dtype).name} n={n} p={p} nodes={topo.node_of_rank}"
    if np.issubdtype(dtype, np.floating) and op == "sum":
        tol = 1e-4 if dtype == np.float32 else 1e-10
        if not np.allclose(buf, want, rtol=tol, atol=tol * p):
            bad = int(np.argmax(np.abs(buf - want)))
            fail(f"{label}: element {bad} is {buf[bad]!r}, reference {want[bad]!r}")
    elif not np.array_equal(buf, want):
        bad = int(np.flatnonzero(buf != want)[0])
        fail(f"{label}: element {bad} is {buf[bad]!r}, reference {want[bad]!r}")
    digest = zlib.crc32(buf.tobytes())
    digests = topo.world.comm.allgather(digest)
    if len(set(digests)) != 1:
        fail(f"{label}: ranks disagree bitwise (crc32 per rank {digests})")


def check_compressor(topo, algo: str, n: int) -> None:
    comp = RecordingCompressor()
    buf = make_input(topo.rank, n, np.float32, "sum", 7)
    ctx = BucketContext(("t",), (0,), (n,), base=0, step=0)
    algorithms._REGISTRY[algo](buf, "sum", topo, comp, ctx)
    want = reference(topo.size, n, np.float32, "sum", 7)
    if not np.allclose(buf, want, rtol=1e-4, atol=1e-3):
        fail(f"{algo} with compressor n={n}: wrong sum")
    nodes, L = topo.num_nodes, topo.local_size
    if algo in ("flat", "ring", "tree"):
        expect = [("world", topo.size, n, 0)]
    elif topo.is_homogeneous:
        counts = even_counts(n, L)
        start = displacements(counts)[topo.local_rank]
        expect = [("cross", nodes, counts[topo.local_rank], start)] if nodes > 1 else []
        if expect and expect[0][2] == 0:
            expect = []
    else:  # leader scheme
        expect = [("cross", nodes, n, 0)] if topo.local_rank == 0 and n else []
    if comp.calls != expect:
        fail(f"{algo} with compressor n={n} nodes={topo.node_of_rank}: compressor calls "
             f"{comp.calls}, expected {expect}")


def main() -> None:
    local_size = int(sys.argv[1])
    quick = "--quick" in sys.argv
    world = MPICommunicator(MPI.COMM_WORLD.Dup(), "world")
    names = MPI.COMM_WORLD.allgather(MPI.Get_processor_name())
    topo = topology.build(world, names, local_size)
    ctx = BucketContext(("t",), (0,), (0,))
    case = 0
    for algo in ALGOS:
        for op in OPS:
            for dtype in DTYPES:
                for n in SIZES:
                    case += 1
                    check(topo, algo, op, dtype, n, case, ctx)
        # large buffers: several ring chunks per segment
        if not quick:
            for op, dtype in (("sum", np.float32), ("max", np.int64), ("sum", np.float64)):
                case += 1
                check(topo, algo, op, dtype, LARGE, case, ctx)
    # native: the bitwise ops (bool buckets travel as uint8) in one MPI call each, whatever
    # the MPI chunk size, and a clear error, on every rank, for an op MPI cannot do
    saved_chunk = topo.world.chunk_bytes
    topo.world.chunk_bytes = 256          # native ignores it: one call for the whole buffer
    for op in BITWISE:
        for dtype in (np.uint8, np.int32, np.int64):
            for n in (0, 1, 7, 1003, 40_000):
                case += 1
                check(topo, "native", op, dtype, n, case, ctx)
    calls = []

    class Counting:            # the world's mpi4py communicator, counting Allreduce calls
        def __init__(self, comm) -> None:
            self.comm = comm

        def __getattr__(self, name):
            return getattr(self.comm, name)

        def Allreduce(self, *args, **kwargs):
            calls.append(1)
            return self.comm.Allreduce(*args, **kwargs)

    topo.world.comm = Counting(topo.world.comm)
    case += 1
    check(topo, "native", "sum", np.float32, 40_000, case, ctx)
    topo.world.comm = topo.world.comm.comm
    if len(calls) != 1:
        fail(f"native made {len(calls)} MPI_Allreduce calls for 160 KB, expected 1")
    topo.world.chunk_bytes = saved_chunk
    try:
        algorithms.get("native")(np.ones(4, np.float32), "adasum", topo, None, ctx)
        fail("native accepted op 'adasum'")
    except ValueError as exc:
        if "native algorithm cannot reduce with op 'adasum'" not in str(exc):
            fail(f"native's error for op adasum: {exc}")
    # tiny chunks: many chunks in flight on small buffers
    comms = (topo.world, topo.local, topo.cross)
    saved = [c.ring_chunk_bytes for c in comms]
    for c in comms:
        c.ring_chunk_bytes = 16
    for algo in ("ring", "2d"):
        for n in (5, 97, 1003):
            case += 1
            check(topo, algo, "sum", np.int64, n, case, ctx)
    for c, v in zip(comms, saved):
        c.ring_chunk_bytes = v
    # the MPI backend's reduce_scatterv in pieces of chunk_bytes (uneven blocks, empty blocks,
    # pieces larger than some blocks)
    saved_chunk = topo.world.chunk_bytes
    topo.world.chunk_bytes = 256
    p = topo.size
    for op, dtype in (("sum", np.int64), ("min", np.float32), ("sum", np.float64)):
        for counts in ([1000 + 37 * r for r in range(p)], [0] * (p - 1) + [2001],
                       [3] * p, [500] + [0] * (p - 1)):
            case += 1
            n = sum(counts)
            src = make_input(topo.rank, n, dtype, op, case)
            out = np.empty(counts[topo.rank], dtype)
            topo.world.reduce_scatterv(src, out, counts, op)
            lo = displacements(counts)[topo.rank]
            want = reference(p, n, dtype, op, case)[lo:lo + counts[topo.rank]]
            if not np.allclose(out, want, rtol=1e-6, atol=1e-6):
                fail(f"reduce_scatterv in pieces op={op} counts={counts}: got {out[:4]}, "
                     f"want {want[:4]}")
    topo.world.chunk_bytes = saved_chunk
    # pipelined hierarchical: many pieces (up to the MAX_PIECES cap), several depths
    saved = hierarchical.PIECE_BYTES, hierarchical.DEPTH
    hierarchical.PIECE_BYTES = 64
    for depth in (1, 2, 3):
        hierarchical.DEPTH = depth
        for op, dtype in (("sum", np.int64), ("max", np.float32), ("sum", np.float64)):
            for n in (5, 97, 1003, 40_000):
                case += 1
                check(topo, "hierarchical", op, dtype, n, case, ctx)
    hierarchical.PIECE_BYTES, hierarchical.DEPTH = saved
    for algo in ALGOS:
        for n in (0, 1, 1003):
            check_compressor(topo, algo, n)
    for nbytes in (0, 4, 1 << 12, 1 << 20, 1 << 24):
        buf = np.ones(nbytes // 4, np.float32)
        used = algorithms.allreduce(buf, "sum", topo, None, ctx, "auto")
        if used != algorithms.choose("auto", buf.nbytes, topo) or not np.all(buf == topo.size):
            fail(f"auto at {nbytes} bytes ran {used} with wrong result")
    world.comm.Barrier()
    if topo.rank == 0:
        print(f"OK {case} cases p={topo.size} nodes={topo.node_of_rank}", flush=True)
    topo.free()


if __name__ == "__main__":
    main()
