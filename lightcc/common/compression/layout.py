"""How the two-phase compressor (:mod:`.twophase`) sees a bucket: its elements as consecutive
arrays (:class:`Segments`), where the bucket may be cut and how a stretch is coded
(:class:`Layout`), and the byte arena its payloads come from (:class:`Arena`).

A bucket is either one contiguous buffer (the fusion buffer, or a tensor reduced alone) or the
bucket's tensors themselves, never packed (``allreduce_parts``): a stretch of elements is coded
as the pieces of it that lie in each array, which for an element-wise codec are the same bytes
as coding the stretch of a packed copy, and for a scaled codec the same calls (its blocks never
cross a tensor's start). Encoding from and decoding into the tensors saves copying the bucket
into the fusion buffer and back: two passes over its memory per step (28 MB of resmlp's
gradients: 13-17 ms of a 1 Gbit step, docs/profile-1gbit.md).
"""
from __future__ import annotations

import bisect
from typing import Any, Protocol

import numpy as np

from ..arrays import displacements, even_counts
from .base import BucketContext


class Codec(Protocol):
    """Encodes float32 elements of one tensor into a fixed number of bytes (a function of
    their count); ``unit``: elements per scale, counted from the start (0: element-wise)."""

    unit: int

    def nbytes(self, n: int) -> int: ...

    def encode_into(self, x: np.ndarray, out: np.ndarray) -> None: ...

    def decode_into(self, payload: np.ndarray, n: int, out: np.ndarray,
                    accumulate: bool) -> None: ...


class Segments:
    """A bucket's elements as consecutive 1-D arrays: ``[(start, array), ...]`` in order,
    each starting where the previous one ends (one entry: a contiguous buffer)."""

    def __init__(self, parts: list[tuple[int, Any]]) -> None:
        self.starts = [int(s) for s, _ in parts]
        self.arrays = [a for _, a in parts]
        last = parts[-1]
        self.size = int(last[0]) + int(last[1].size) - self.starts[0] if parts else 0

    @classmethod
    def of(cls, buf: Any) -> "Segments":
        """One contiguous buffer."""
        return cls([(0, buf)])

    def views(self, start: int, count: int) -> list[tuple[int, Any]]:
        """``(start, view)`` of each array's share of ``[start, start + count)``."""
        out, end = [], start + count
        i = max(bisect.bisect_right(self.starts, start) - 1, 0)
        while start < end and i < len(self.arrays):
            lo = self.starts[i]
            hi = min(lo + self.arrays[i].size, end)
            if hi > start:
                out.append((start, self.arrays[i][start - lo:hi - lo]))
                start = hi
            i += 1
        return out

    def contiguous(self, start: int, count: int) -> Any:
        """A view of ``[start, start + count)`` when it lies in one array, else None."""
        if count <= 0:
            return self.arrays[0][:0]
        views = self.views(start, count)
        return views[0][1] if len(views) == 1 else None


class Arena:
    """A reusable byte buffer handed out in consecutive views (no allocation per piece)."""

    def __init__(self, buf: np.ndarray, xp_name: str = "numpy") -> None:
        self.buf, self.used, self.xp_name = buf, 0, xp_name

    def take(self, nbytes: int) -> np.ndarray:
        view = self.buf[self.used:self.used + nbytes]
        self.used += nbytes
        assert self.used <= self.buf.size, "arena sized too small"
        return view


class Layout:
    """Where a buffer may be cut, and how a stretch of it is coded: one codec call per array
    of the stretch for an element-wise codec; for a scaled one, one call per tensor in the
    stretch, with stretches cut only where a scaling block starts (``unit`` elements from each
    tensor's start)."""

    def __init__(self, codec: Codec, n: int, ctx: BucketContext | None) -> None:
        self.codec, self.n = codec, n
        self.unit = int(getattr(codec, "unit", 0) or 0)
        spans = ctx.spans(n) if ctx is not None and self.unit else [(0, n, 0)]
        self.starts = [lo for lo, _, _ in spans]
        self.ends = [hi for _, hi, _ in spans]

    def snap(self, x: int) -> int:
        """The block boundary nearest to ``x`` (the lower one on a tie)."""
        if not self.unit or x <= 0 or x >= self.n:
            return min(max(x, 0), self.n)
        i = bisect.bisect_right(self.starts, x) - 1
        lo, hi = self.starts[i], self.ends[i]
        down = lo + (x - lo) // self.unit * self.unit
        up = min(down + self.unit, hi)
        return down if x - down <= up - x else up

    def split(self, start: int, count: int, parts: int) -> list[int]:
        """``count`` elements from ``start`` cut into ``parts`` nearly even sizes at block
        boundaries (some may be 0)."""
        cuts = [self.snap(start + off) for off in displacements(even_counts(count, parts))]
        return [b - a for a, b in zip(cuts, cuts[1:] + [start + count])]

    def lengths(self, start: int, count: int) -> list[int]:
        """Element counts of the codec calls that code ``[start, start + count)`` of one
        contiguous array."""
        if count <= 0:
            return []
        if not self.unit:
            return [count]
        out, x, end = [], start, start + count
        i = bisect.bisect_right(self.starts, x) - 1
        while x < end:
            hi = min(self.ends[i], end)
            out.append(hi - x)
            x, i = hi, i + 1
        return out

    def nbytes(self, start: int, count: int) -> int:
        return sum(self.codec.nbytes(m) for m in self.lengths(start, count))

    def encode(self, seg: Segments | Any, start: int, count: int, out: Any) -> None:
        """Encode ``count`` elements of ``seg`` (Segments, or one array holding exactly them)
        from bucket position ``start`` into the payload ``out``."""
        o = 0
        for a, x in _views(seg, start, count):
            p = 0
            for m in self.lengths(a, x.size):
                nb = self.codec.nbytes(m)
                self.codec.encode_into(x[p:p + m], out[o:o + nb])
                p, o = p + m, o + nb

    def decode(self, payload: Any, seg: Segments | Any, start: int, count: int,
               accumulate: bool) -> None:
        """Decode a payload of ``count`` elements from bucket position ``start`` into ``seg``
        (Segments, or one array of exactly those elements)."""
        o = 0
        for a, x in _views(seg, start, count):
            p = 0
            for m in self.lengths(a, x.size):
                nb = self.codec.nbytes(m)
                self.codec.decode_into(payload[o:o + nb], m, x[p:p + m], accumulate)
                p, o = p + m, o + nb


def _views(seg: Segments | Any, start: int, count: int) -> list[tuple[int, Any]]:
    if isinstance(seg, Segments):
        return seg.views(start, count)
    return [(start, seg)]
