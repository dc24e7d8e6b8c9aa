"""PowerSGD: rank-r approximation of each tensor of a bucket, error feedback, warm start.

After Vogels et al. 2019 ("PowerSGD: Practical Low-Rank Gradient Compression") and torch's DDP
``powerSGD_hook``: **per tensor**, a tensor with at least 2 dimensions (``ctx.shapes``) is the
matrix ``M`` of ``shape[0] x rest``; 1-D tensors (biases, norms) and matrices whose factors
would not be smaller travel exactly. A tensor without a shape is viewed as the zero-padded
near-square ``ceil(n / cols) x cols`` matrix, ``cols = ceil(sqrt(n))``. One power iteration
per step, every tensor's factors in one buffer::

    P = M Q;      allreduce(P);  P = orthonormal basis of P (QR)
    Q_i = M^T P;  allreduce(Q);  result = P Q^T  (= P P^T sum_i M_i, the SUM the engine wants)

Q starts from a seeded standard normal (identical on all ranks) and, with warm start, is kept
per tensor for the next step. GPU buffers run the same steps with CuPy (matmul, QR), with
their factors and residuals on the GPU. The residual of rank i is ``M_i - P Q_i^T`` (what its
own matrix lost in the projection; the residuals sum to ``sum M_i - result``). A rank sends
``2 (n-1)/n * 4 r (rows + cols)`` bytes per matrix instead of ``2 (n-1)/n * 4 N``. A tensor
whose gradient is not finite on some rank (an fp16 overflow that GradScaler will skip) is
summed exactly that step, its residual and factors untouched; the others are compressed as
usual, so what happens to a tensor never depends on the tensors it was fused with.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..arrays import array_module, host_copy, like
from ..comm import Communicator
from ..exceptions import ConfigError
from .base import BucketContext
from .memory import ResidualMemory, expire, segments
from .registry import register


def matrix_shape(n: int) -> tuple[int, int]:
    """Near-square ``(rows, cols)`` holding ``n`` elements: ``cols = ceil(sqrt(n))``."""
    cols = max(1, math.isqrt(max(n - 1, 0)) + 1)
    return -(-n // cols), cols


def _allreduce_bytes(nbytes: int, p: int) -> int:
    return 2 * (p - 1) * nbytes // p if p > 1 else 0


@dataclass
class _Part:
    """One tensor (or the part of one) in the buffer: its matrix shape, or None = uncompressed."""

    name: str
    lo: int
    hi: int
    shape: tuple[int, int] | None
    tlo: int = 0          # where the part starts inside its tensor


class PowerSGDCompressor:
    """Rank-``rank`` PowerSGD per tensor of a bucket (see module docstring)."""

    lossy = True

    def __init__(self, rank: int = 2, warm_start: bool = True, error_feedback: bool = True,
                 seed: int = 0) -> None:
        if rank < 1:
            raise ConfigError(f"powersgd rank must be >= 1, got {rank}")
        self.rank = int(rank)
        self.warm_start = bool(warm_start)
        self.error_feedback = bool(error_feedback)
        self.seed = int(seed)
        self.memory = ResidualMemory()
        self.qs: dict[str, np.ndarray] = {}
        self.q_seen: dict[str, int] = {}
        self.name = f"powersgd:{self.rank}" + ("" if warm_start else ":nowarm") + \
            ("" if error_feedback else ":noef")

    def _matrix(self, length: int, shape: tuple[int, ...] | None) -> tuple[int, int] | None:
        """Matrix shape for a tensor part, or None when factors would not be smaller."""
        if shape is not None and len(shape) >= 2 and int(np.prod(shape)) == length:
            rows, cols = int(shape[0]), length // max(int(shape[0]), 1)
        elif shape is not None and len(shape) < 2:
            return None                       # biases, norms: uncompressed, as torch does
        else:
            rows, cols = matrix_shape(length)
        r = min(self.rank, rows, cols)
        return (rows, cols) if length > 0 and (rows + cols) * r < length else None

    def plan(self, n: int, ctx: BucketContext) -> list[_Part]:
        """How each element of a buffer of ``n`` elements travels (gaps go uncompressed)."""
        shapes = dict(zip(ctx.names, getattr(ctx, "shapes", ()) or ()))
        parts, pos = [], 0
        for name, size, lo, hi, tlo in segments(ctx, n):
            if lo > pos:
                parts.append(_Part("", pos, lo, None))
            whole = tlo == 0 and hi - lo == size
            parts.append(_Part(name, lo, hi, self._matrix(hi - lo, shapes.get(name) if whole
                                                          else None), tlo))
            pos = hi
        if pos < n:
            parts.append(_Part("", pos, n, None))
        return parts

    def _initial_q(self, key: str, cols: int, r: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, zlib.crc32(key.encode())])
        return rng.standard_normal((cols, r)).astype(np.float32)

    @staticmethod
    def _key(part: _Part, ctx: BucketContext) -> str:
        """Warm-start key: the tensor and the part of it, not where fusion put it (a bucket
        composed differently next step keeps the factors)."""
        return f"{part.name}@{part.tlo}:{part.hi - part.lo}"

    def allreduce(self, comm: Communicator, buf: np.ndarray, ctx: BucketContext) -> None:
        """Replace ``buf`` by the sum over ``comm``: rank-r per matrix, exact for the rest."""
        n = buf.size
        if comm.size == 1 or n == 0:
            return
        parts = self.plan(n, ctx)
        mats = [p for p in parts if p.shape is not None]
        if not mats:
            comm.allreduce(buf, "sum")
            return
        xp = array_module(buf)
        # one flag per matrix: a non-finite one (e.g. an fp16 overflow that GradScaler will
        # skip) is summed exactly and leaves its residual and warm-start factors untouched,
        # so it cannot poison them; the bucket's other tensors are compressed as usual
        bad = xp.zeros(len(mats), np.uint8)
        for i, part in enumerate(mats):
            bad[i] = xp.logical_not(xp.isfinite(buf[part.lo:part.hi]).all())
        comm.allreduce(bad, "max")
        flags = host_copy(bad)
        mats = [part for part, f in zip(mats, flags) if not f]
        if not mats:
            comm.allreduce(buf, "sum")
            return
        plain = [part for part in parts if part.shape is None] + \
            [part for part, f in zip([q for q in parts if q.shape is not None], flags) if f]
        plain.sort(key=lambda part: part.lo)
        ef_ctx = ctx.only({part.name for part in mats})
        if self.error_feedback:
            self.memory.add_to(buf, ef_ctx)
        ms, qs, keys = [], [], []
        for part in mats:
            rows, cols = part.shape
            r = min(self.rank, rows, cols)
            m = xp.zeros(rows * cols, np.float32)     # near-square shapes are zero padded
            m[:part.hi - part.lo] = buf[part.lo:part.hi]
            ms.append(m.reshape(rows, cols))
            keys.append(self._key(part, ctx))
            q = self.qs.get(keys[-1]) if self.warm_start else None
            qs.append(like(q, buf) if q is not None and q.shape == (cols, r)
                      else like(self._initial_q(keys[-1], cols, r), buf))
        # allreduce 1: every P factor and the uncompressed elements, in one buffer
        ps = [m @ q for m, q in zip(ms, qs)]
        flat = xp.concatenate([p.reshape(-1) for p in ps] +
                              [buf[p.lo:p.hi] for p in plain]).astype(np.float32)
        comm.allreduce(flat, "sum")
        pos = 0
        for i, p in enumerate(ps):
            ps[i] = xp.linalg.qr(flat[pos:pos + p.size].reshape(p.shape).astype(np.float64)
                                 )[0].astype(np.float32)
            pos += p.size
        # allreduce 2: every Q factor
        q_locals = [xp.ascontiguousarray(m.T @ p) for m, p in zip(ms, ps)]
        qflat = xp.concatenate([q.reshape(-1) for q in q_locals]).astype(np.float32)
        comm.allreduce(qflat, "sum")
        if self.error_feedback:
            for part, m, p, ql in zip(mats, ms, ps, q_locals):
                buf[part.lo:part.hi] = (m - p @ ql.T).reshape(-1)[:part.hi - part.lo]
            self.memory.store(buf, ef_ctx)
        for part in plain:
            buf[part.lo:part.hi] = flat[pos:pos + part.hi - part.lo]
            pos += part.hi - part.lo
        qpos = 0
        for part, m, p, ql, key in zip(mats, ms, ps, q_locals, keys):
            q = qflat[qpos:qpos + ql.size].reshape(ql.shape)
            qpos += ql.size
            buf[part.lo:part.hi] = (p @ q.T).reshape(-1)[:part.hi - part.lo]
            if self.warm_start:
                self.qs[key] = q.copy()
                self.q_seen[key] = ctx.step
        for key in expire(self.q_seen, ctx.step, self.memory.ttl_steps):
            self.qs.pop(key, None)

    def wire_bytes(self, numel: int, nranks: int, ctx: BucketContext | None = None) -> int:
        """Bytes one rank sends (all tensors finite): a finiteness check (1 byte per matrix),
        then two ring allreduces, of [P factors + uncompressed] and of Qs.

        Without ``ctx`` the buffer is taken as one tensor.
        """
        if nranks <= 1 or numel == 0:
            return 0
        ctx = ctx or BucketContext(("",), (0,), (numel,))
        parts = self.plan(numel, ctx)
        first = second = nmats = 0
        for part in parts:
            if part.shape is None:
                first += part.hi - part.lo
            else:
                rows, cols = part.shape
                r = min(self.rank, rows, cols)
                first, second = first + rows * r, second + cols * r
                nmats += 1
        if second == 0:
            return _allreduce_bytes(4 * numel, nranks)
        return (_allreduce_bytes(nmats, nranks) + _allreduce_bytes(4 * first, nranks)
                + _allreduce_bytes(4 * second, nranks))

    def state_dict(self) -> dict[str, Any]:
        return {"residuals": self.memory.state_dict(),
                "q": {k: host_copy(v) for k, v in self.qs.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.memory.load_state_dict(state.get("residuals", {}))
        self.qs = {str(k): np.array(v, np.float32) for k, v in state.get("q", {}).items()}


def make_powersgd(options: list[str]) -> PowerSGDCompressor:
    """Options: the rank (default 2), ``nowarm``, ``noef``."""
    rank, warm, ef = 2, True, True
    for opt in options:
        if opt.isdigit():
            rank = int(opt)
        elif opt in ("nowarm", "warm"):
            warm = opt == "warm"
        elif opt in ("noef", "ef"):
            ef = opt == "ef"
        else:
            raise ConfigError(f"powersgd option {opt!r} not understood (a rank, nowarm, noef)")
    return PowerSGDCompressor(rank, warm, ef)


register("powersgd", make_powersgd)
