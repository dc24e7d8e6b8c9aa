"""Compressed allreduce on every rank vs an independent NumPy simulation (run under mpirun).

Checks, per compressor and buffer size: result == simulation (bitwise for fp16/bf16/fp8/topk,
1e-4 relative for PowerSGD), all ranks bitwise identical, bytes counted by the backend ==
the compressor's wire-byte formula, TopK sends exactly each tensor's k, error feedback over
several steps, no NaN/Inf from finite extreme inputs, NaN/Inf propagate, fp16/bf16
independent of fusion.
Exits non-zero on the first failure.
"""
from __future__ import annotations

import sys
import time
import zlib
from pathlib import Path

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sim  # noqa: E402

from lightcc.common import compression  # noqa: E402
from lightcc.common.backends.mpi import MPICommunicator  # noqa: E402
from lightcc.common.compression.base import BucketContext  # noqa: E402

comm = MPICommunicator(MPI.COMM_WORLD.Dup(), "world")
P, ME = comm.size, comm.rank
checks = 0


def fail(msg: str) -> None:
    print(f"rank {ME}: FAIL {msg}", flush=True)
    MPI.COMM_WORLD.Abort(1)


def inputs_for(kind: str, n: int, seed: int) -> list[np.ndarray]:
    """Every rank's input (each rank regenerates all of them from seeds)."""
    out = []
    for r in range(P):
        rng = np.random.default_rng([seed, r, n, zlib.crc32(kind.encode())])
        if kind == "normal":
            x = rng.standard_normal(n) * rng.uniform(0.1, 3.0)
        elif kind == "extreme":   # huge, tiny, denormal, zero, mixed sign
            pool = np.array([5e37, -5e37, 3e37, 1e-38, -1e-40, 1e-45, 0.0, -0.0, 1.0, -2.5,
                             6e4, 7e4, 500.0, -1e-8], np.float64)
            x = pool[rng.integers(0, pool.size, n)] * rng.choice([1, -1], n)
        elif kind == "nonfinite":
            x = rng.standard_normal(n)
            x[rng.integers(0, n, 3)] = [np.nan, np.inf, -np.inf][r % 3]
        else:
            raise ValueError(kind)
        out.append(x.astype(np.float32))
    return out


def ctx_for(n: int, step: int = 0) -> BucketContext:
    """Two tensors 'a' and 'b' packed back to back."""
    half = n // 2
    return BucketContext(("a", "b"), (0, half), (half, n - half), 0, step)


def residual_of(comp, ctx: BucketContext) -> np.ndarray:
    """The compressor's residuals of the context's tensors, concatenated (zeros if none)."""
    res = comp.memory.residuals
    return np.concatenate([res.get(name, np.zeros(size, np.float32))
                           for name, size in zip(ctx.names, ctx.sizes)])


def same_on_all_ranks(x: np.ndarray, what: str) -> None:
    digests = MPI.COMM_WORLD.allgather(zlib.crc32(x.tobytes()))
    if len(set(digests)) != 1:
        fail(f"{what}: ranks differ (crc32 per rank {digests})")


def bitwise_equal(got: np.ndarray, want: np.ndarray, what: str) -> None:
    global checks
    checks += 1
    same = (got.view(np.int32) == want.view(np.int32)) | (np.isnan(got) & np.isnan(want))
    if not same.all():
        i = int(np.flatnonzero(~same)[0])
        fail(f"{what}: {int((~same).sum())} of {got.size} differ from simulation, first at {i}: "
             f"got {got[i]!r} want {want[i]!r}")


def run(comp, buf: np.ndarray, ctx: BucketContext) -> int:
    before = comm.stats.bytes_sent
    comp.allreduce(comm, buf, ctx)
    return comm.stats.bytes_sent - before


def check_bytes(comp, n: int, sent: int, what: str, ctx: BucketContext) -> None:
    global checks
    checks += 1
    want = comp.rank_wire_bytes(n, P, ME, ctx) if hasattr(comp, "rank_wire_bytes") else \
        comp.wire_bytes(n, P, ctx)
    if sent != want:
        fail(f"{what}: backend counted {sent} bytes sent, formula says {want}")
    total = MPI.COMM_WORLD.allreduce(sent)
    if total // P != comp.wire_bytes(n, P, ctx):
        fail(f"{what}: mean bytes {total // P} != wire_bytes {comp.wire_bytes(n, P, ctx)}")


FP_SPECS = {"fp16": ("fp16", None), "bf16": ("bf16", None), "fp8": ("e4m3", "bucket"),
            "fp8:e4m3:block:64": ("e4m3", "block"), "fp8_e5m2": ("e5m2", "bucket"),
            "fp8:e5m2:block:100": ("e5m2", "block")}


def test_fp() -> None:
    for spec, (fmt, scaling) in FP_SPECS.items():
        comp = compression.make(spec)
        block = int(spec.rsplit(":", 1)[1]) if scaling == "block" else 256
        for kind, sizes in (("normal", (1, P - 1, 7, 4099)), ("extreme", (4099,)),
                            ("nonfinite", (7, 4099))):
            for n in sizes:
                xs = inputs_for(kind, n, 1)
                buf = xs[ME].copy()
                ctx = ctx_for(n)
                sent = run(comp, buf, ctx)
                what = f"{spec} {kind} n={n}"
                want = sim.twophase(xs, fmt, scaling, block, ctx.sizes)
                bitwise_equal(buf, want, what)
                same_on_all_ranks(buf, what)
                check_bytes(comp, n, sent, what, ctx)
                if kind == "extreme" and not np.isfinite(buf).all():
                    fail(f"{what}: non-finite output from finite input")
                if kind == "nonfinite" and n >= 7:
                    with np.errstate(invalid="ignore"):
                        bad = ~np.isfinite(sum(x.astype(np.float64) for x in xs))
                    if np.isfinite(buf[bad]).any():
                        fail(f"{what}: NaN/Inf in the input did not propagate")
    # pipelined scheme (chunks above PIECE_BYTES): pieces never cut a scaling block, so the
    # result is the simulation's, bit for bit; 2 pieces, an uneven split, the MAX_PIECES cap,
    # a tensor of several 64 Ki bucket-scaling blocks
    from lightcc.common.compression import twophase
    saved = twophase.PIECE_BYTES
    twophase.PIECE_BYTES = 4096
    try:
        for spec, (fmt, scaling) in FP_SPECS.items():
            comp = compression.make(spec)
            block = int(spec.rsplit(":", 1)[1]) if scaling == "block" else 256
            for kind, n in (("normal", P * 1024 + 1), ("normal", P * 3000 + 5),
                            ("extreme", P * 2500), ("nonfinite", P * 1500),
                            ("normal", P * 70_000)):
                xs = inputs_for(kind, n, 3)
                buf = xs[ME].copy()
                ctx = ctx_for(n)
                sent = run(comp, buf, ctx)
                what = f"pipelined {spec} {kind} n={n}"
                bitwise_equal(buf, sim.twophase(xs, fmt, scaling, block, ctx.sizes), what)
                same_on_all_ranks(buf, what)
                check_bytes(comp, n, sent, what, ctx)
    finally:
        twophase.PIECE_BYTES = saved
    # a tensor's result does not depend on its bucket: fusing two tensors or not gives the
    # same bits (fp16/bf16 are element-wise; fp8 scales and TopK's k are per tensor)
    for spec in ("fp16", "bf16", "fp8", "fp8:e4m3:block:64", "topk", "topk:0.05:noef"):
        xs = inputs_for("normal", 3001, 2)
        xs[ME][1200:] *= 1e-3                   # tensors of different magnitudes
        fused = xs[ME].copy()
        compression.make(spec).allreduce(
            comm, fused, BucketContext(("a", "b"), (0, 1200), (1200, 1801)))
        a, b = xs[ME][:1200].copy(), xs[ME][1200:].copy()
        compression.make(spec).allreduce(comm, a, BucketContext(("a",), (0,), (1200,)))
        compression.make(spec).allreduce(comm, b, BucketContext(("b",), (0,), (1801,)))
        bitwise_equal(fused, np.concatenate([a, b]), f"{spec} fused vs unfused")


def test_topk() -> None:
    for spec, ratio, ef in (("topk", 0.01, True), ("topk:0.05:noef", 0.05, False),
                            ("topk:0.3", 0.3, True)):
        comp = compression.make(spec)
        for n in (1, 150, 5000, 140_000):   # 140k > 4 * SAMPLE: sampled path
            res = None
            for step in range(3):
                xs = inputs_for("normal" if step < 2 else "nonfinite", n, 10 + step)
                buf = xs[ME].copy()
                ctx = ctx_for(n, step)
                sent = run(comp, buf, ctx)
                want, new_res, k = sim.topk_step(xs, res if ef else None, ratio,
                                                 tuple(s for s in ctx.sizes if s))
                res = new_res
                what = f"{spec} n={n} step={step}"
                bitwise_equal(buf, want, what)
                same_on_all_ranks(buf, what)
                check_bytes(comp, n, sent, what, ctx)
                if comp.last_k != k or sent != 8 * k * (P - 1):
                    fail(f"{what}: sent k={comp.last_k} ({sent} bytes), expected k={k}")
                if ef:
                    mine = residual_of(comp, ctx)
                    bitwise_equal(mine, res[ME], what + " residual")


def shaped_ctx(names, sizes, shapes, step=0) -> BucketContext:
    """A context carrying tensor shapes (``BucketContext.shapes`` when the lead adds it)."""
    offsets = tuple(int(o) for o in np.cumsum((0,) + tuple(sizes[:-1])))
    try:
        return BucketContext(tuple(names), offsets, tuple(sizes), 0, step, shapes=tuple(shapes))
    except TypeError:
        import dataclasses

        @dataclasses.dataclass(frozen=True)
        class Shaped(BucketContext):
            shapes: tuple = ()

        return Shaped(tuple(names), offsets, tuple(sizes), 0, step, tuple(shapes))


def test_powersgd() -> None:
    global checks
    layouts = {   # name -> (names, sizes, shapes or None)
        "flat": (("a", "b"), (2500, 2500), None),
        "shaped": (("w", "bias", "v", "tiny"), (60 * 40, 40, 50 * 30, 6),
                   ((60, 40), (40,), (50, 30), (2, 3))),
    }
    for rank in (1, 2):
        for layout, (names, sizes, shapes) in layouts.items():
            comp = compression.make(f"powersgd:{rank}")
            n = sum(sizes)
            res, qs = None, None
            for step in range(3):
                xs = inputs_for("normal", n, 20 + step)
                buf = xs[ME].copy()
                ctx = (shaped_ctx(names, sizes, shapes, step) if shapes else
                       BucketContext(names, (0, sizes[0]), sizes, 0, step))
                parts = [p for p in comp.plan(n, ctx) if p.shape is not None]
                if qs is None:   # the seeded initial Q is an input of the scheme, taken as is
                    qs = [comp._initial_q(comp._key(p, ctx), p.shape[1],
                                          min(rank, *p.shape)).astype(np.float64) for p in parts]
                sent = run(comp, buf, ctx)
                tensors = [(o, s, shapes[i] if shapes else None)
                           for i, (o, s) in enumerate(zip(ctx.offsets, ctx.sizes))]
                want, res, qs = sim.powersgd_step(xs, res, qs, rank, tensors)
                what = f"powersgd:{rank} {layout} step={step}"
                err = np.abs(buf - want).max() / np.abs(want).max()
                checks += 1
                if not err < 1e-4:
                    fail(f"{what}: relative error {err:.2e} vs simulation")
                same_on_all_ranks(buf, what)
                checks += 1
                if sent != comp.wire_bytes(n, P, ctx):
                    fail(f"{what}: sent {sent} bytes, formula {comp.wire_bytes(n, P, ctx)}")
                err = np.abs(residual_of(comp, ctx) - res[ME]).max() / np.abs(res[ME]).max()
                if not err < 1e-4:
                    fail(f"{what}: residual relative error {err:.2e}")
    comp = compression.make("powersgd")
    buf = np.ones(10, np.float32)
    sent = run(comp, buf, ctx_for(10))   # too small to gain: uncompressed sum
    if not np.array_equal(buf, np.full(10, P, np.float32)):
        fail(f"powersgd small bucket: got {buf}")
    check_bytes(comp, 10, sent, "powersgd small bucket", ctx_for(10))


timings = {}
for test in (test_fp, test_topk, test_powersgd):
    t0 = time.perf_counter()
    test()
    timings[test.__name__] = round(time.perf_counter() - t0, 1)
comm.barrier()
if ME == 0:
    print(f"OK {checks} checks on {P} ranks; seconds {timings}", flush=True)
