"""The ``Compressor`` protocol: how a fused bucket crosses the wire.

A compressor owns the *scheme* of a compressed allreduce on one fused bucket, written against
the ``Communicator`` protocol only, because a correct compressed collective is more than
compress -> dense allreduce -> decompress (an FP8 sum overflows, a sum of sparse vectors is
not sparse). The engine hands it a 1-D float32 bucket that holds several tensors packed back
to back (``BucketContext``: names, offsets, sizes, shapes) and expects the bucket summed over
``comm`` in place. A lossy compressor treats each tensor on its own (``BucketContext.spans``),
so a tensor's result never depends on which tensors share its bucket (that depends on timing).
Algorithms that split a bucket (hierarchical, 2D) call it on a slice; ``ctx.base`` says where
the slice starts in the full bucket so per-tensor state (error feedback residuals, keyed by
tensor name) lines up.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from ..comm import Communicator


@dataclass(frozen=True)
class BucketContext:
    """Where a buffer handed to a compressor came from.

    ``names``/``offsets``/``sizes`` describe the tensors packed in the *full* bucket (element
    offsets); ``base`` is the element offset of the buffer being reduced within that bucket
    (0 unless an algorithm split the bucket); ``step`` counts buckets seen by the engine;
    ``shapes`` are the tensors' shapes.
    """

    names: tuple[str, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    base: int = 0
    step: int = 0
    shapes: tuple[tuple[int, ...], ...] = ()   # per tensor (PowerSGD factorizes each one)

    def sub(self, start: int) -> "BucketContext":
        """The context of a slice starting ``start`` elements into this buffer."""
        return BucketContext(self.names, self.offsets, self.sizes, self.base + start, self.step,
                             self.shapes)

    def only(self, names: "set[str]") -> "BucketContext":
        """This context restricted to the tensors named in ``names`` (the others' elements
        then belong to no tensor)."""
        keep = [i for i, name in enumerate(self.names) if name in names]
        pick = lambda seq: tuple(seq[i] for i in keep) if seq else seq   # noqa: E731
        return BucketContext(pick(self.names), pick(self.offsets), pick(self.sizes), self.base,
                             self.step, pick(self.shapes))

    def spans(self, n: int) -> list[tuple[int, int, int]]:
        """A buffer of ``n`` elements cut at tensor boundaries: ``(lo, hi, tlo)`` per piece, in
        order, covering ``[0, n)``; ``tlo`` is where the piece starts inside its tensor (a
        piece not described by the context, e.g. the whole buffer without names, counts as a
        tensor of its own, ``tlo`` 0). Compressors whose result depends on more than one
        element (TopK's k, fp8's scales) work per piece, so a tensor's result does not depend
        on the tensors it was fused with."""
        out, pos = [], 0
        lo_buf = self.base
        for off, size in zip(self.offsets, self.sizes):
            a, b = max(lo_buf, off), min(lo_buf + n, off + size)
            if a < b:
                if a - lo_buf > pos:
                    out.append((pos, a - lo_buf, 0))
                out.append((a - lo_buf, b - lo_buf, a - off))
                pos = b - lo_buf
        if pos < n:
            out.append((pos, n, 0))
        return out


@runtime_checkable
class Compressor(Protocol):
    """One compression format and the collective scheme that keeps it correct."""

    name: str          # canonical spec, e.g. "fp16", "fp8:e4m3:block:256", "topk:0.01:ef"
    lossy: bool

    def allreduce(self, comm: Communicator, buf: Any, ctx: BucketContext) -> None:
        """Sum the 1-D float32 ``buf`` over ``comm`` in place, sending compressed data."""

    def wire_bytes(self, numel: int, nranks: int) -> int:
        """Bytes one rank sends to reduce ``numel`` float32 elements over ``nranks`` ranks."""

    def state_dict(self) -> dict[str, Any]:
        """Persistent state (error-feedback residuals, PowerSGD factors), keyed by tensor."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
