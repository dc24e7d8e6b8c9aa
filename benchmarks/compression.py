"""Compression benchmark: codec speed and compressed allreduce time/bytes (issue 7 item 7).

Run on 2 ranks::

    mpirun -np 2 python benchmarks/compression.py                 # 1-16 MB, < 2 minutes
    mpirun -np 2 python benchmarks/compression.py --max-mb 256    # the issue's full range

Prints one table on rank 0: per compressor and bucket size, the compress+decompress rate of
this rank's kernels (GB/s of fp32 input, for the element formats also torch's own cast as
reference), the compressed allreduce time (median of ``--reps``) and the bytes one rank sent
(counted by the backend), against the uncompressed allreduce of the same bucket.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

from lightcc.common import compression
from lightcc.common.backends.mpi import MPICommunicator
from lightcc.common.compression.base import BucketContext

SPECS = ["fp16", "bf16", "fp8", "fp8:e4m3:block:256", "fp8_e5m2", "topk:0.01", "powersgd:2"]
TORCH_DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp8": "float8_e4m3fn",
                "fp8:e4m3:block:256": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


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
    args = ap.parse_args()
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
