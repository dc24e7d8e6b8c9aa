"""Compression benchmark: codec speed and compressed allreduce time/bytes (issue 7 item 7).

Run on 2 ranks::

    mpirun -np 2 python benchmarks/compression.py                 # 1-16 MB, < 2 minutes
    mpirun -np 2 python benchmarks/compression.py --max-mb 256    # the issue's full range

or, one process, the codecs alone against torch's casts (``--codecs``; see :func:`codec_table`)::

    python benchmarks/compression.py --codecs [--threads 1] [--reps 7]

Prints one table on rank 0: per compressor and bucket size, the compress+decompress rate of
this rank's kernels (GB/s of fp32 input, for the element formats also torch's own cast as
reference), the compressed allreduce time (median of ``--reps``) and the bytes one rank sent
(counted by the backend), against the uncompressed allreduce of the same bucket.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from lightcc.common import compression
from lightcc.common.compression.base import BucketContext

SPECS = ["fp16", "bf16", "fp8", "fp8:e4m3:block:256", "fp8_e5m2", "topk:0.01", "powersgd:2"]
TORCH_DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp8": "float8_e4m3fn",
                "fp8:e4m3:block:256": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def best_of(fns: list, reps: int) -> list[float]:
    """Fastest seconds of each of ``fns`` over ``reps`` rounds after one warm-up; the functions
    take turns within a round, so a busy spell on a shared machine slows all of them alike and
    the minimum is the least disturbed run."""
    for fn in fns:
        fn()
    out = [float("inf")] * len(fns)
    for _ in range(reps):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            out[i] = min(out[i], time.perf_counter() - t0)
    return out


#: ``--codecs`` rows: label, spec, torch dtype of the reference cast
CODEC_ROWS = [("fp16", "fp16", "float16"), ("bf16", "bf16", "bfloat16"),
              ("e4m3 bucket", "fp8", "float8_e4m3fn"),
              ("e4m3 block256", "fp8:e4m3:block:256", "float8_e4m3fn"),
              ("e5m2 bucket", "fp8_e5m2", "float8_e5m2"),
              ("e5m2 block256", "fp8:e5m2:block:256", "float8_e5m2")]


def codec_rates(spec: str, dtype_name: str, x: np.ndarray, reps: int) -> list[float]:
    """GB/s of fp32 (input of encode, output of decode) for lightcc's codec and torch's cast:
    encode, torch encode, decode, torch decode, decode+accumulate, torch accumulate."""
    import torch

    codec = compression.make(spec).codec
    payload = np.empty(codec.nbytes(x.size), np.uint8)
    out = np.zeros_like(x)
    codec.encode_into(x, payload)
    t, dt = torch.from_numpy(x), getattr(torch, dtype_name)
    low, acc, tmp = t.to(dt), torch.from_numpy(out), torch.empty_like(t)
    mixed = dt in (torch.float16, torch.bfloat16)   # add_ promotes these, not fp8

    def torch_accumulate():
        if mixed:
            acc.add_(low)
        else:
            tmp.copy_(low)
            acc.add_(tmp)
    secs = []
    for ours, theirs in [(lambda: codec.encode_into(x, payload), lambda: low.copy_(t)),
                         (lambda: codec.decode_into(payload, x.size, out, False),
                          lambda: tmp.copy_(low)),
                         (lambda: codec.decode_into(payload, x.size, out, True),
                          torch_accumulate)]:
        secs += best_of([ours, theirs], reps)
    return [x.nbytes / s / 1e9 for s in secs]


def codec_table(sizes_m: list[int], reps: int, threads: int) -> None:
    """Print the codec table: per row and size, lightcc vs torch GB/s and their ratio.

    torch's reference is its plain cast into a preallocated tensor (``copy_``; fp8 without
    scales, and torch turns finite overflow into Inf/NaN where lightcc saturates) and
    ``acc.add_(low)`` (fp8: cast, then add) for the fused decode+accumulate of the two-phase
    owner. ``threads`` sets both libraries' CPU threads.
    """
    import torch

    from lightcc.common.kernels import _threads

    torch.set_num_threads(threads)
    _threads.configure(threads)
    print(f"codec GB/s of fp32 data, {threads} thread(s), best of {reps}; x = lightcc / torch")
    print(f"{'codec':14s} {'M':>3s} | {'enc':>6s} {'torch':>6s} {'x':>5s} | {'dec':>6s} "
          f"{'torch':>6s} {'x':>5s} | {'dec+acc':>7s} {'torch':>6s} {'x':>5s}")
    for m in sizes_m:
        x = np.random.default_rng(m).standard_normal(m << 20).astype(np.float32)
        for label, spec, dtype_name in CODEC_ROWS:
            r = codec_rates(spec, dtype_name, x, reps)
            print(f"{label:14s} {m:3d} | {r[0]:6.2f} {r[1]:6.2f} {r[0] / r[1]:5.2f} | "
                  f"{r[2]:6.2f} {r[3]:6.2f} {r[2] / r[3]:5.2f} | {r[4]:7.2f} {r[5]:6.2f} "
                  f"{r[4] / r[5]:5.2f}")


def timed(fn, reps: int) -> float:
    """Median seconds of ``fn()`` over ``reps`` runs (after one warm-up)."""
    fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return float(np.median(out))


def codec_rate(comp, x: np.ndarray, reps: int) -> float:
    """GB/s (fp32 input bytes) of encode + decode, for element formats; topk: selection only."""
    if hasattr(comp, "codec"):
        payload = np.empty(comp.codec.nbytes(x.size), np.uint8)
        out = np.empty_like(x)

        def run():
            comp.codec.encode_into(x, payload)
            comp.codec.decode_into(payload, x.size, out, False)
    elif hasattr(comp, "k_for"):
        from lightcc.common.kernels import topk_indices

        def run():
            topk_indices(x, comp.k_for(x.size))
    else:
        return float("nan")
    return x.nbytes / timed(run, reps) / 1e9


def torch_rate(spec: str, x: np.ndarray, reps: int) -> float:
    """GB/s of torch's own CPU cast there and back (reference), or nan without torch."""
    try:
        import torch
    except ImportError:
        return float("nan")
    name = TORCH_DTYPES.get(spec)
    if name is None:
        if spec.startswith("topk"):
            t = torch.from_numpy(x)
            k = max(1, int(np.ceil(0.01 * x.size)))
            return x.nbytes / timed(lambda: torch.topk(t.abs(), k, sorted=False), 1) / 1e9
        return float("nan")
    t, dt = torch.from_numpy(x), getattr(torch, name)
    return x.nbytes / timed(lambda: t.to(dt).to(torch.float32), reps) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--min-mb", type=float, default=1)
    ap.add_argument("--max-mb", type=float, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--specs", default=",".join(SPECS))
    ap.add_argument("--codecs", action="store_true",
                    help="one process: codec GB/s against torch's casts, no MPI")
    ap.add_argument("--codec-sizes", default="1,4,16", help="M elements, comma separated")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads for --codecs")
    args = ap.parse_args()
    if args.codecs:
        codec_table([int(m) for m in args.codec_sizes.split(",")], max(args.reps, 9),
                    args.threads)
        return
    from mpi4py import MPI

    from lightcc.common.backends.mpi import MPICommunicator

    comm = MPICommunicator(MPI.COMM_WORLD.Dup(), "world")
    sizes, mb = [], args.min_mb
    while mb <= args.max_mb:
        sizes.append(mb)
        mb *= 4
    rows = []
    for mb in sizes:
        n = int(mb * (1 << 20)) // 4
        x = np.random.default_rng(comm.rank).standard_normal(n).astype(np.float32)
        cols = int(np.sqrt(n))
        ctx = BucketContext(("w",), (0,), (n,))
        if hasattr(BucketContext, "__dataclass_fields__") and \
                "shapes" in BucketContext.__dataclass_fields__:
            ctx = BucketContext(("w",), (0,), (n,), shapes=((n // cols, cols),))

        def base_run():
            buf = x.copy()
            comm.allreduce(buf, "sum")
        comm.barrier()
        s0 = comm.stats.bytes_sent
        t_base = timed(base_run, args.reps)
        base_bytes = (comm.stats.bytes_sent - s0) // (args.reps + 1)
        rows.append(("none", mb, float("nan"), float("nan"), t_base, base_bytes, 1.0, 1.0))
        for spec in args.specs.split(","):
            comp = compression.make(spec)
            comm.barrier()
            s0 = comm.stats.bytes_sent

            def run():
                buf = x.copy()
                comp.allreduce(comm, buf, ctx)
            t = timed(run, args.reps)
            nbytes = (comm.stats.bytes_sent - s0) // (args.reps + 1)
            rate = codec_rate(comp, x, args.reps)
            ref = torch_rate(spec, x, args.reps) if mb == sizes[0] or mb <= 16 else float("nan")
            rows.append((spec, mb, rate, ref, t, nbytes, base_bytes / max(nbytes, 1),
                         t_base / t))
    if comm.rank == 0:
        print(f"{comm.size} ranks; codec GB/s = fp32 GB/s through encode+decode (topk: "
              "selection; torch ref: cast there and back / torch.topk)")
        print(f"{'compressor':20s} {'MB':>6s} {'codec':>7s} {'torch':>7s} {'ms':>9s} "
              f"{'bytes sent':>12s} {'bytes x':>8s} {'time x':>7s}")
        for spec, mb, rate, ref, t, nbytes, bx, tx in rows:
            print(f"{spec:20s} {mb:6g} {rate:7.2f} {ref:7.2f} {t * 1e3:9.2f} {nbytes:12d} "
                  f"{bx:8.2f} {tx:7.2f}")


if __name__ == "__main__":
    main()
