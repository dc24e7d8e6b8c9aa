"""TopK sparsification with error feedback (Aji & Heafield 2017; Stich et al. 2018).

**Per tensor**: each rank adds its residual to the buffer and keeps, of every tensor of the
bucket (``BucketContext.spans``), the ``k = max(1, ceil(ratio * n))`` entries of largest
magnitude of that tensor's ``n`` (exactly k; NaN/Inf always among them), so what a tensor sends
never depends on the tensors it was fused with (fusion depends on timing). The ranks allgather
their ``(int32 index, float32 value)`` pairs: ``8 (n-1) sum(k)`` bytes sent per rank. Every
rank scatter-adds all pairs, in rank order, into a zeroed buffer, so results are bitwise
identical everywhere and each element's sum is taken in the same order whatever the bucket.
The entries not sent become the new residual (per tensor name, see ``memory.py``). GPU buffers
use the CUDA selection and scatter-add of ``compression/gpu.py`` (same indices and sums).
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..arrays import array_module
from ..comm import Communicator
from ..exceptions import ConfigError
from .base import BucketContext
from .gpu import codec_module
from .memory import ResidualMemory, segments
from .registry import register


class TopKCompressor:
    """Top-k of each buffer by magnitude, allgathered as index/value pairs."""

    lossy = True

    def __init__(self, ratio: float = 0.01, error_feedback: bool = True) -> None:
        if not 0.0 < ratio <= 1.0:
            raise ConfigError(f"topk ratio must be in (0, 1], got {ratio}")
        self.ratio = float(ratio)
        self.error_feedback = bool(error_feedback)
        self.memory = ResidualMemory()
        self.name = f"topk:{self.ratio:g}:{'ef' if error_feedback else 'noef'}"
        self.last_k = 0          # pairs per rank of the last buffer (sum of its k; stats)

    def k_for(self, n: int) -> int:
        """Entries each rank sends for a tensor of ``n`` elements."""
        return min(n, max(1, math.ceil(self.ratio * n)))

    def ks(self, n: int, ctx: BucketContext) -> list[int]:
        """Entries each rank sends per tensor of a buffer of ``n`` elements (``ctx.spans``)."""
        return [self.k_for(hi - lo) for lo, hi, _ in ctx.spans(n)]

    def compress(self, buf: np.ndarray, ctx: BucketContext) -> tuple[np.ndarray, np.ndarray]:
        """Add the residual to ``buf``, pick each tensor's top k, store the new residual.

        Returns ``(indices int32, values float32)`` (ascending positions in ``buf``); ``buf``
        is left holding the residual (the accumulated gradient with the sent entries zeroed).
        """
        if self.error_feedback:
            self.memory.add_to(buf, ctx)
        codecs, xp = codec_module(buf), array_module(buf)
        picks = [codecs.topk_indices(buf[lo:hi], self.k_for(hi - lo)) + lo
                 for lo, hi, _ in ctx.spans(buf.size)]
        idx = picks[0] if len(picks) == 1 else xp.concatenate(picks)
        vals = buf[idx]
        buf[idx] = 0.0
        if self.error_feedback:
            self.memory.store(buf, ctx)
        return idx.astype(np.int32), vals

    @property
    def takes_parts(self) -> bool:
        """Whether :meth:`allreduce_parts` may be used (it needs the residuals)."""
        return self.error_feedback

    def allreduce(self, comm: Communicator, buf: np.ndarray, ctx: BucketContext) -> None:
        """Sum over ``comm`` of every rank's per-tensor top-k, in place (a single rank is
        exact)."""
        n, p = buf.size, comm.size
        if p == 1 or n == 0:
            return
        _check_size(n)
        xp, codecs = array_module(buf), codec_module(buf)
        if self.error_feedback and xp is np and \
                sum(hi - lo for _, _, lo, hi, _ in segments(ctx, n)) == n:
            idx, vals = self._select(buf, n, ctx)    # one pass (kernels/ef_topk.py)
        else:
            idx, vals = self.compress(buf, ctx)
            buf[:] = 0.0
        self._exchange(comm, idx, vals, buf, xp, codecs)

    def allreduce_parts(self, comm: Communicator, bufs: list[tuple[int, np.ndarray]],
                        ctx: BucketContext) -> None:
        """:meth:`allreduce` of a host bucket held as its tensors, ``(start, 1-D float32
        array)`` in order, never packed into one buffer: the same result and residuals,
        bitwise. Needs error feedback (:attr:`takes_parts`)."""
        from ..kernels import sparse

        n, p = sum(b.size for _, b in bufs), comm.size
        if p == 1 or n == 0:
            return
        _check_size(n)
        idx, vals = self._select(bufs, n, ctx)
        self._exchange(comm, idx, vals, bufs, np, sparse)

    def _select(self, buf: Any, n: int, ctx: BucketContext) -> tuple[np.ndarray, np.ndarray]:
        """Error feedback and each tensor's top-k over a host buffer of ``n`` elements (an
        array, or its tensors as ``(start, array)``) in one pass per tensor, each tensor's
        residual updated in place."""
        from ..kernels.ef_topk import ef_topk

        parts = self.memory.parts(n, ctx)
        return ef_topk(buf, parts, [self.k_for(r.size) for _, r in parts])

    def _exchange(self, comm: Communicator, idx: Any, vals: Any, out: Any, xp: Any,
                  codecs: Any) -> None:
        """Allgather every rank's pairs and scatter-add them, in rank order, into ``out``
        (zeroed: a buffer, or a list of host parts)."""
        p = comm.size
        idx = idx.astype(np.int32)
        k = self.last_k = idx.size
        pack = xp.empty(8 * k, np.uint8)
        pack[:4 * k] = idx.view(np.uint8)
        pack[4 * k:] = vals.view(np.uint8)
        allp = xp.empty(8 * k * p, np.uint8)
        comm.allgatherv(pack, allp, [8 * k] * p)
        check = {} if xp is np else {"check": False}   # the GPU kernel skips bad indices
        for r in range(p):
            part = allp[8 * k * r:8 * k * (r + 1)]
            codecs.scatter_add(part[:4 * k].view(np.int32), part[4 * k:].view(np.float32), out,
                               **check)

    def wire_bytes(self, numel: int, nranks: int, ctx: BucketContext | None = None) -> int:
        """``8 (nranks - 1) sum(k)``: each tensor's k int32 indices and k float32 values to
        every other rank (without ``ctx`` the buffer is one tensor)."""
        if nranks <= 1 or numel == 0:
            return 0
        k = self.k_for(numel) if ctx is None else sum(self.ks(numel, ctx))
        return 8 * k * (nranks - 1)

    def state_dict(self) -> dict[str, Any]:
        return {"residuals": self.memory.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.memory.load_state_dict(state.get("residuals", {}))


def _check_size(n: int) -> None:
    if n >= 2 ** 31:
        raise ConfigError(f"topk: bucket of {n} elements exceeds int32 indices; "
                          "lower the fusion threshold")


def make_topk(options: list[str]) -> TopKCompressor:
    """Options: a ratio (default 0.01) and ``ef`` / ``noef`` (default ef)."""
    ratio, ef = 0.01, True
    for opt in options:
        if opt in ("ef", "noef"):
            ef = opt == "ef"
        else:
            try:
                ratio = float(opt)
            except ValueError:
                raise ConfigError(f"topk option {opt!r} not understood (a ratio, ef|noef)") from None
    return TopKCompressor(ratio, ef)


register("topk", make_topk)
