"""Error-feedback memory: per-tensor residuals, kept apart from the compression math.

A lossy compressor adds the residual of each tensor to the bucket before compressing and stores
what it did not send afterwards (Seide et al. 2014; Karimireddy et al. 2019, "EF-SGD").
Residuals are keyed by **tensor name**, not by bucket, so they survive changes of the fusion
plan; ``BucketContext`` (names/offsets/sizes, plus ``base`` for a slice) says which elements of
the buffer belong to which tensor. A residual whose tensor has not been seen for
:data:`TTL_STEPS` engine steps (batches) is dropped, so tensors that stop appearing do not hold
memory forever (``LCC_EF_TTL_STEPS``; 0 keeps everything until :meth:`clear`). Residuals live
where their buffers do (host or GPU memory); ``state_dict`` returns NumPy copies.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import numpy as np

from ..arrays import array_module, host_copy, like
from .base import BucketContext

#: Default steps (batches of the process set) after which an unseen tensor's state is dropped;
#: each memory has its own ``ttl_steps``, set from its process set's ``LCC_EF_TTL_STEPS``.
#: 0 = never.
TTL_STEPS = 10_000


def expire(last_seen: dict[str, int], step: int, ttl: int | None = None) -> list[str]:
    """Keys of ``last_seen`` not seen within ``ttl`` (default :data:`TTL_STEPS`) steps of
    ``step`` (removed from it)."""
    ttl = TTL_STEPS if ttl is None else ttl
    if ttl <= 0:
        return []
    stale = [k for k, seen in last_seen.items() if step - seen > ttl]
    for k in stale:
        del last_seen[k]
    return stale


def segments(ctx: BucketContext, n: int) -> Iterator[tuple[str, int, int, int, int]]:
    """``(name, size, buf_lo, buf_hi, tensor_lo)`` for each tensor overlapping the buffer."""
    lo, hi = ctx.base, ctx.base + n
    for name, off, size in zip(ctx.names, ctx.offsets, ctx.sizes):
        a, b = max(lo, off), min(hi, off + size)
        if a < b:
            yield name, size, a - lo, b - lo, a - off


@dataclass
class ResidualMemory:
    """float32 residual per tensor name (full tensor size)."""

    residuals: dict[str, np.ndarray] = field(default_factory=dict)
    last_seen: dict[str, int] = field(default_factory=dict)
    ttl_steps: int = TTL_STEPS

    def add_to(self, buf: np.ndarray, ctx: BucketContext) -> None:
        """``buf += residual`` for every tensor in the buffer that has one."""
        for name, size, lo, hi, tlo in segments(ctx, buf.size):
            r = self.residuals.get(name)
            if r is not None and r.size == size:
                if type(r) is not type(buf):      # the tensor moved between host and GPU
                    r = self.residuals[name] = like(r, buf)
                buf[lo:hi] += r[tlo:tlo + hi - lo]

    def store(self, residual: np.ndarray, ctx: BucketContext) -> None:
        """Remember ``residual`` (same layout as the buffer) as each tensor's new residual."""
        names = []
        for name, size, lo, hi, tlo in segments(ctx, residual.size):
            names.append(name)
            r = self.residuals.get(name)
            if r is None or r.size != size:
                r = self.residuals[name] = array_module(residual).zeros(size, np.float32)
            elif type(r) is not type(residual):
                r = self.residuals[name] = like(r, residual)
            r[tlo:tlo + hi - lo] = residual[lo:hi]
        self.touch(ctx, names)

    def parts(self, n: int, ctx: BucketContext) -> list[tuple[int, np.ndarray]]:
        """``(start in the buffer, residual view)`` for each tensor in a host buffer of ``n``
        elements, in order, making zero residuals for tensors without one; a compressor
        updates them in place. The tensors count as seen at ``ctx``'s step (:meth:`touch`)."""
        out, names = [], []
        for name, size, lo, hi, tlo in segments(ctx, n):
            names.append(name)
            r = self.residuals.get(name)
            if r is None or r.size != size:
                r = self.residuals[name] = np.zeros(size, np.float32)
            elif type(r) is not np.ndarray:           # the tensor moved from the GPU
                r = self.residuals[name] = host_copy(r).astype(np.float32)
            out.append((lo, r[tlo:tlo + hi - lo]))
        self.touch(ctx, names)
        return out

    def touch(self, ctx: BucketContext, names: Iterable[str] | None = None) -> None:
        """``names`` (default: the tensors of ``ctx``) were seen at ``ctx``'s step; drop the
        residuals unseen for too long."""
        for name in ctx.names if names is None else names:
            self.last_seen[name] = ctx.step
        for name in expire(self.last_seen, ctx.step, self.ttl_steps):
            self.residuals.pop(name, None)

    def clear(self, names: Iterable[str] | None = None) -> None:
        """Forget the residuals of ``names`` (all when None)."""
        if names is None:
            self.residuals.clear()
            self.last_seen.clear()
        for name in names or ():
            self.residuals.pop(name, None)
            self.last_seen.pop(name, None)

    def state_dict(self) -> dict[str, Any]:
        return {name: host_copy(r) for name, r in self.residuals.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.residuals = {str(k): np.array(v, dtype=np.float32).reshape(-1)
                          for k, v in state.items()}
