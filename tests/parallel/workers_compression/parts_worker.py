"""A fused bucket of float32 tensors reduced in place with fp16 / bf16 / fp8 goes through the
unpacked path (the compressor encodes from and decodes into the tensors, never the fusion
buffer: execution/host.py ``_allreduce_parts``), and its results equal a NumPy computation of
the format's two-phase sum. Prints one line per rank; exits non-zero on any mismatch."""
from __future__ import annotations

import sys

import ml_dtypes
import numpy as np

import lightcc as lcc
from lightcc.common.compression import twophase

calls = {"parts": 0, "packed": 0}
_parts, _packed = twophase.TwoPhaseCompressor.allreduce_parts, \
    twophase.TwoPhaseCompressor.allreduce


def _count_parts(self, *args, **kwargs):
    calls["parts"] += 1
    return _parts(self, *args, **kwargs)


def _count_packed(self, *args, **kwargs):
    calls["packed"] += 1
    return _packed(self, *args, **kwargs)


twophase.TwoPhaseCompressor.allreduce_parts = _count_parts
twophase.TwoPhaseCompressor.allreduce = _count_packed

CAST = {"fp16": np.float16, "bf16": ml_dtypes.bfloat16}


def main() -> None:
    lcc.init()
    rank, size = lcc.rank(), lcc.size()
    # chunks and pieces cut tensors; > 1 MB per chunk at 2 ranks takes the pipelined scheme
    sizes = (300_000, 30_000, 500_001, 50_000)
    for fmt in ("fp16", "bf16", "fp8"):
        rng = np.random.default_rng(rank + 10 * len(fmt))
        xs = [rng.standard_normal(s).astype(np.float32) for s in sizes]
        inputs = np.concatenate(xs)
        before = dict(calls)
        lcc.synchronize(lcc.grouped_allreduce_async(xs, op=lcc.Sum, name=f"parts.{fmt}",
                                                    compression=fmt, outs=xs))
        got = np.concatenate(xs)
        if calls["parts"] != before["parts"] + 1 or calls["packed"] != before["packed"]:
            sys.exit(f"rank {rank}: {fmt} bucket did not take the unpacked path: {calls}")
        every = lcc.allgather(got[None, :])
        if not all(np.array_equal(every[0], row) for row in every):
            sys.exit(f"rank {rank}: {fmt} results differ between ranks")
        if fmt in CAST:
            # the format's sum, computed here: each rank's values in the format, summed in
            # fp32 in rank order, the sum in the format again
            ins = lcc.allgather(inputs[None, :])
            total = np.zeros(inputs.size, np.float32)
            for row in ins:
                total += row.astype(CAST[fmt]).astype(np.float32)
            want = total.astype(CAST[fmt]).astype(np.float32)
            if not np.array_equal(got, want):
                bad = int(np.flatnonzero(got != want)[0])
                sys.exit(f"rank {rank}: {fmt} element {bad}: {got[bad]} != {want[bad]}")
        else:   # scaled fp8: within the format's relative precision of the exact sum
            exact = lcc.allreduce(inputs, op=lcc.Sum, name="parts.exact")
            err = np.abs(got - exact).max() / np.abs(exact).max()
            if not err < 0.15:
                sys.exit(f"rank {rank}: fp8 relative error {err:.3f}")
    print(f"rank {rank}: unpacked compressed buckets ok on {size} ranks ({calls})", flush=True)
    lcc.shutdown()


if __name__ == "__main__":
    main()
