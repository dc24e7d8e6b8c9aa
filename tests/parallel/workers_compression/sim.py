"""Independent NumPy simulations of the compressed allreduce schemes (for the tests only).

Written from the scheme descriptions, without importing lightcc's kernels: casts go through
``np.float16`` / ``ml_dtypes``, scales through ``log2``, top-k through a stable argsort.
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np

FLT_MAX = np.float32(np.finfo(np.float32).max)
DTYPES = {"fp16": np.float16, "bf16": ml_dtypes.bfloat16, "e4m3": ml_dtypes.float8_e4m3fn,
          "e5m2": ml_dtypes.float8_e5m2}
MAXES = {"fp16": 65504.0, "bf16": float(ml_dtypes.finfo(ml_dtypes.bfloat16).max),
         "e4m3": 448.0, "e5m2": 57344.0}


def quant_dequant(x: np.ndarray, fmt: str, scaling: str | None, block: int) -> np.ndarray:
    """float32 -> format (RNE, saturating finite values, scaled by 2**e) -> float32."""
    x = np.asarray(x, np.float32)
    if x.size == 0:
        return x.copy()
    fmax = MAXES[fmt]
    bs = block if scaling == "block" else x.size
    nb = -(-x.size // bs)
    fin = np.isfinite(x)
    mag = np.where(fin, np.abs(x), 0).astype(np.float64)
    amax = np.array([mag[i * bs:(i + 1) * bs].max() for i in range(nb)])
    if scaling is None:
        e = np.zeros(nb)
    else:
        with np.errstate(divide="ignore"):
            e = np.where(amax > 0, np.ceil(np.log2(amax / fmax)), 0)
        e = np.clip(e, -126, 126)
    e_el = np.repeat(e, bs)[: x.size]
    with np.errstate(over="ignore", invalid="ignore"):
        y = x.astype(np.float64) * np.exp2(-e_el)
        y = np.where(fin, np.clip(y, -fmax, fmax), y)
        q = y.astype(DTYPES[fmt]).astype(np.float32)
        v = q * np.exp2(e_el).astype(np.float32)
        v = np.where(np.isinf(v) & np.isfinite(q), np.copysign(FLT_MAX, q), v)
    return v.astype(np.float32)


BUCKET_UNIT = 1 << 16     # elements per scale of "bucket"-scaled fp8 (docs/compression.md)


def twophase(inputs: list[np.ndarray], fmt: str, scaling: str | None = None,
             block: int = 256, sizes: tuple[int, ...] | None = None) -> np.ndarray:
    """Sum of ``inputs`` as reduce-scatter + allgather in the compressed format.

    Every rank quantizes each scaling block on its own (``block`` elements for block
    scaling, 64 Ki for bucket scaling, counted from the start of each tensor of ``sizes``;
    element-wise formats have no blocks); the owner sums the dequantized copies in rank
    order in fp32 and quantizes the sum again with the block's own scale. Chunks and pieces
    never cut a block, so how the buffer is shared among the ranks does not change the result.
    """
    n = inputs[0].size
    sizes = sizes or (n,)
    unit = None if scaling is None else (block if scaling == "block" else BUCKET_UNIT)
    out = np.empty(n, np.float32)
    start = 0
    for size in sizes:
        step = unit or max(size, 1)
        for lo in range(start, start + size, step):
            hi = min(lo + step, start + size)
            acc = np.zeros(hi - lo, np.float32)
            for x in inputs:
                with np.errstate(invalid="ignore", over="ignore"):
                    acc = (acc + quant_dequant(x[lo:hi], fmt, scaling and "block", hi - lo)
                           ).astype(np.float32)
            out[lo:hi] = quant_dequant(acc, fmt, scaling and "block", hi - lo)
        start += size
    return out


def topk_select(acc: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest |acc| (NaN as largest; ties to the lower index), ascending."""
    key = np.abs(acc).astype(np.float64)
    key[np.isnan(key)] = np.inf
    order = np.argsort(-key, kind="stable")
    return np.sort(order[:k])


def topk_step(inputs: list[np.ndarray], residuals: list[np.ndarray] | None, ratio: float,
              sizes: tuple[int, ...] | None = None):
    """One TopK step for every rank, each tensor of ``sizes`` (default: one) on its own:
    (summed result, new residuals, pairs each rank sends)."""
    n = inputs[0].size
    sizes = sizes or (n,)
    out = np.zeros(n, np.float32)
    new_res = []
    for i, x in enumerate(inputs):
        acc = x.astype(np.float32) + (residuals[i] if residuals is not None else 0)
        acc = acc.astype(np.float32)
        res = acc.copy()
        start = 0
        for size in sizes:
            k = min(size, max(1, math.ceil(ratio * size)))
            idx = start + topk_select(acc[start:start + size], k)
            out[idx] += acc[idx]
            res[idx] = 0
            start += size
        new_res.append(res)
    total = sum(min(s, max(1, math.ceil(ratio * s))) for s in sizes)
    return out, new_res, total


def powersgd_step(inputs, residuals, qs, rank, tensors):
    """One PowerSGD step (float64 algebra) over tensors given as ``(offset, size, shape|None)``.

    A tensor with a shape of >= 2 dims is the matrix (shape[0], rest); without a shape it is
    the zero-padded (ceil(n / ceil(sqrt n)), ceil(sqrt n)) matrix; 1-D shapes and matrices
    whose factors are not smaller travel exactly. Returns (result, new residuals, new qs).
    """
    n = inputs[0].size
    acc = [x.astype(np.float64) + (residuals[i] if residuals is not None else 0)
           for i, x in enumerate(inputs)]
    out = sum(acc)                       # exact sum; compressed tensors overwritten below
    res = [np.zeros(n) for _ in inputs]
    new_qs = []
    j = 0
    for off, size, shape in tensors:
        if shape is not None and len(shape) >= 2:
            rows, cols = shape[0], size // shape[0]
        elif shape is not None:
            continue
        else:
            cols = math.ceil(math.sqrt(size))
            rows = -(-size // cols)
        r = min(rank, rows, cols)
        if (rows + cols) * r >= size:
            continue
        mats = []
        for a in acc:
            m = np.zeros(rows * cols)
            m[:size] = a[off:off + size]
            mats.append(m.reshape(rows, cols))
        p = np.linalg.qr(sum(m @ qs[j] for m in mats))[0]
        q_locals = [m.T @ p for m in mats]
        q = sum(q_locals)
        out[off:off + size] = (p @ q.T).reshape(-1)[:size]
        for i, (m, ql) in enumerate(zip(mats, q_locals)):
            res[i][off:off + size] = (m - p @ ql.T).reshape(-1)[:size]
        new_qs.append(q)
        j += 1
    return out, res, new_qs
