"""Two-phase compressed allreduce for element-wise formats (fp16, bf16, fp8).

Phase 1 (reduce-scatter): the buffer is cut into ``comm.size`` chunks (``even_counts``); each
chunk is encoded and sent to its owner with one ``alltoallv``; the owner decodes every rank's
copy (its own included, so results do not depend on who owns a chunk) and sums them in fp32 in
rank order. Phase 2 (allgather): the owner re-encodes the sum and one ``allgatherv`` spreads
the encoded chunks; **every** rank, the owner included, decodes the same bytes, so all ranks
end bitwise identical. A rank sends ``T - E(c_me) + (n-1) E(c_me)`` bytes where ``E(c)`` is the
encoded size of a chunk of ``c`` elements and ``T = sum E(c_r)``; averaged over ranks that is
``2 (n-1)/n * T`` = ``2 (n-1)/n * N * bytes_per_element`` plus scales.

**Pipelined** (chunks above :data:`PIECE_BYTES` of fp32): every chunk is cut into ``K`` pieces
(the same piece boundaries on every rank) and both phases run per piece over ``isend``/``irecv``
instead of one ``alltoallv``/``allgatherv``. A rank encodes and sends piece ``j`` of every other
rank's chunk while earlier pieces are on the wire; the owner sums piece ``j`` (rank order, fp32)
as soon as all copies of it have arrived, re-encodes it and sends it on while later pieces are
still arriving. Encoding, decoding and the slow link then overlap, so on a slow network the time
approaches ``wire bytes / line rate`` instead of ``codec time + wire time``. The bytes on the
wire and the per-piece arithmetic are those of the unpipelined scheme applied to each piece.
Device buffers (CuPy) always use the collective scheme, with the codecs' CUDA kernels; a
communicator with lightcc's TCP links (``LCC_CROSS_TRANSPORT``) always uses the point-to-point
one, in one piece for small buckets, so no wait spins in an MPI collective.

**Scaled formats (fp8) never cut a scaling block.** A scaled codec has a ``unit`` (elements
per scale); its blocks start at each tensor's start (``BucketContext.spans``), chunk and piece
boundaries are moved to the nearest block boundary, and each chunk or piece is coded tensor by
tensor (:class:`.layout.Layout`). Every block is then quantized alone, by every rank and again by its
owner after the sum, so a tensor's result does not depend on the tensors it was fused with,
nor on the number of pieces. Element-wise formats (fp16, bf16) are cut evenly.

**Unpacked buckets** (``allreduce_parts``): the same scheme over a bucket's tensors in their own
memory (:class:`.layout.Segments`), encoded from and decoded into them with the same codec calls
and the same sums, so the results are bitwise those of the packed bucket; the owner sums a
chunk that spans tensors in a scratch region of the arena.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Any

import numpy as np

from ..arrays import array_module, displacements
from ..arrays import num_pieces as _num_pieces
from ..comm import Communicator
from .base import BucketContext
from .layout import Arena, Codec, Layout, Segments

#: fp32 bytes per piece of the pipelined scheme (chunks up to this size use the collective one).
PIECE_BYTES = 1 << 20
#: Upper bound on pieces per chunk (tags ``0 .. 2 * MAX_PIECES - 1`` are used).
MAX_PIECES = 64


def num_pieces(count: int, piece_bytes: int | None = None) -> int:
    """Pieces per chunk for a largest chunk of ``count`` fp32 elements (same on every rank)."""
    piece_bytes = PIECE_BYTES if piece_bytes is None else piece_bytes
    return _num_pieces(4 * int(count), piece_bytes, MAX_PIECES)


def _idle() -> None:
    """The progress hook of a communicator that has none."""


class _Phases:
    """Spans of one compressed allreduce on ``comm``'s tracer (one check when it is off)."""

    def __init__(self, comm: Communicator, fmt: str) -> None:
        tracer = getattr(comm, "tracer", None)
        self.tracer = tracer if tracer is not None and tracer.enabled else None
        self.track = f"link:{comm.name}"
        self.fmt = fmt
        self.start()

    def start(self) -> None:
        """A phase begins now."""
        self.t = time.perf_counter() if self.tracer is not None else 0.0

    def span(self, phase: str, **args: Any) -> None:
        """The phase begun at the last :meth:`start` ends now."""
        if self.tracer is not None:
            self.tracer.span(self.track, phase, self.t, time.perf_counter(), format=self.fmt,
                             **args)


class TwoPhaseCompressor:
    """Reduce-scatter and allgather in a compressed element format (see module docstring).

    Payload buffers come from one byte arena kept between calls (about twice the encoded
    bucket), so a step allocates and page-faults nothing; the owner sums its chunk in fp32 in
    place, in the region of ``buf`` its own copy was encoded from.
    """

    lossy = True
    takes_parts = True     # execution/host.py may hand it a bucket's tensors unpacked

    def __init__(self, name: str, codec: Codec) -> None:
        self.name = name
        self.codec = codec
        self._spare: dict[str, Any] = {}       # the arenas' buffers between calls, per xp

    def _arena(self, nbytes: int, xp: Any = np) -> Arena:
        """An arena of at least ``nbytes`` in ``xp``'s memory (NumPy or CuPy): the kept buffer,
        or a new one (a concurrent call on the same compressor, or a larger bucket)."""
        buf = self._spare.pop(xp.__name__, None)
        if buf is None or buf.size < nbytes:
            buf = xp.empty(nbytes, np.uint8)
        return Arena(buf, xp.__name__)

    def _keep(self, arena: Arena) -> None:
        kept = self._spare.get(arena.xp_name)
        if kept is None or kept.size < arena.buf.size:
            self._spare[arena.xp_name] = arena.buf

    @staticmethod
    def _sum_into(lay: Layout, payloads: list[np.ndarray], start: int, acc: np.ndarray) -> None:
        """``acc`` = the fp32 sum of the decoded payloads, in rank order, from zero."""
        acc.fill(0.0)
        for payload in payloads:
            lay.decode(payload, acc, start, acc.size, True)

    @staticmethod
    def _scratch(arena: Arena, seg: Segments, most: int) -> np.ndarray | None:
        """For unpacked buckets, fp32 room to sum a chunk of up to ``most`` elements in (taken
        first, so it is aligned); None for a contiguous buffer (sums go into it)."""
        if len(seg.arrays) == 1:
            return None
        return arena.take(4 * most).view(np.float32)

    @staticmethod
    def _acc(seg: Segments, scratch: np.ndarray | None, start: int, count: int) -> np.ndarray:
        """Where the owner sums ``[start, start + count)``: the buffer itself when the stretch
        is contiguous there (its own copy is encoded already), else scratch."""
        view = seg.contiguous(start, count)
        return view if view is not None or scratch is None else scratch[:count]

    def allreduce(self, comm: Communicator, buf: np.ndarray, ctx: BucketContext) -> None:
        """Sum ``buf`` over ``comm`` in place (a single rank keeps ``buf`` exact)."""
        self._reduce(comm, Segments.of(buf), ctx, array_module(buf), comm.is_device)

    def allreduce_parts(self, comm: Communicator, bufs: list[tuple[int, np.ndarray]],
                        ctx: BucketContext) -> None:
        """:meth:`allreduce` of a host bucket held as its tensors, ``(start, 1-D float32
        array)`` in order, never packed into one buffer: the same results, bitwise."""
        self._reduce(comm, Segments(bufs), ctx, np, False)

    def _reduce(self, comm: Communicator, seg: Segments, ctx: BucketContext, xp: Any,
                device: bool) -> None:
        p, me = comm.size, comm.rank
        if p == 1 or seg.size == 0:
            return
        lay = Layout(self.codec, seg.size, ctx)
        counts = lay.split(0, seg.size, p)
        # device communicators: the collective scheme (NCCL issues point-to-point calls in
        # groups that must match on both sides, which the pipelined exchange does not)
        k = 1 if device else num_pieces(max(counts))
        if k > 1 or getattr(comm, "links", None) is not None:   # TCP links: no collectives
            self._pipelined(comm, seg, lay, counts, k)
            return
        starts = displacements(counts)
        enc = [lay.nbytes(a, c) for a, c in zip(starts, counts)]
        estarts = displacements(enc)
        mine, c = enc[me], counts[me]
        parts = len(seg.arrays) > 1
        arena = self._arena(sum(enc) + mine * (p + 1) + (4 * c if parts else 0), xp)
        acc = self._acc(seg, self._scratch(arena, seg, c), starts[me], c)
        phases = _Phases(comm, self.name)
        send = arena.take(sum(enc))
        for r in range(p):
            lay.encode(seg, starts[r], counts[r], send[estarts[r]:estarts[r] + enc[r]])
        phases.span("COMPRESS")
        recv = arena.take(mine * p)
        comm.alltoallv(send, enc, recv, [mine] * p)
        phases.start()
        self._sum_into(lay, [recv[s * mine:(s + 1) * mine] for s in range(p)], starts[me], acc)
        own = arena.take(mine)
        lay.encode(acc, starts[me], c, own)
        phases.span("DECOMPRESS_ACCUMULATE_RECOMPRESS")
        comm.allgatherv(own, send, enc)
        phases.start()
        for r in range(p):
            lay.decode(send[estarts[r]:estarts[r] + enc[r]], seg, starts[r], counts[r], False)
        phases.span("DECOMPRESS")
        self._keep(arena)

    def _pipelined(self, comm: Communicator, seg: Segments, lay: Layout, counts: list[int],
                   k: int) -> None:
        """Both phases per piece over point-to-point calls (see module docstring).

        Every receive is posted first. Then, piece by piece: encode and send piece j of every
        other rank's chunk, encode my own copy of my piece j, and between pieces sum, encode,
        send and decode whichever of my pieces have all their copies. Then the same for the
        rest of my pieces, and while none is complete, decode the sums of other ranks' pieces
        that have arrived: work that feeds the wire goes first, the codecs run while it is busy.
        """
        p, me = comm.size, comm.rank
        sizes = [lay.split(a, c, k) for a, c in zip(displacements(counts), counts)]
        starts = [displacements(row) for row in sizes]
        starts = [[a + off for off in row] for a, row in zip(displacements(counts), starts)]
        nb = [[lay.nbytes(a, m) for a, m in zip(srow, row)] for srow, row in zip(starts, sizes)]
        others = [(me + d) % p for d in range(1, p)]
        # sends and receives of every piece once, plus p copies of my pieces and their sums
        # (and, unpacked, room to sum my largest piece in)
        most = max(sizes[me]) if len(seg.arrays) > 1 else 0
        arena = self._arena(4 * most + 2 * sum(map(sum, nb)) + (p - 1) * sum(nb[me]))
        scratch = self._scratch(arena, seg, most)
        phases = _Phases(comm, self.name)

        # copies[j][s]: rank s's encoding of my piece j (mine encoded into slot me); tags j
        copies = [[arena.take(nb[me][j]) for _ in range(p)] for j in range(k)]
        phase1 = [[comm.irecv(copies[j][s], s, tag=j) for s in others] if sizes[me][j] else []
                  for j in range(k)]
        # sums of the other ranks' pieces (tags k + j), decoded in arrival order
        phase2: deque = deque()
        for j in range(k):
            for r in others:
                if sizes[r][j]:
                    b = arena.take(nb[r][j])
                    phase2.append((r, j, b, comm.irecv(b, r, tag=k + j)))
        sends: list = []
        done = 0                              # my pieces summed and sent so far
        pump = getattr(comm, "progress", None) or _idle   # the engine's hook between pieces

        def finish_piece(j: int) -> None:
            n, a = sizes[me][j], starts[me][j]
            if n:
                acc = self._acc(seg, scratch, a, n)   # my copy is encoded: sum there
                self._sum_into(lay, copies[j], a, acc)
                out = arena.take(nb[me][j])
                lay.encode(acc, a, n, out)
                sends.extend(comm.isend(out, r, tag=k + j) for r in others)
                lay.decode(out, seg, a, n, False)

        def decode_next(block: bool) -> bool:
            """Decode the next sum of another rank's piece if it has arrived (or wait for it)."""
            if not phase2 or not (block or phase2[0][3].test()):
                return False
            r, j, b, req = phase2.popleft()
            req.wait()
            lay.decode(b, seg, starts[r][j], sizes[r][j], False)
            return True

        for j in range(k):
            for r in others:
                if sizes[r][j]:
                    e = arena.take(nb[r][j])
                    lay.encode(seg, starts[r][j], sizes[r][j], e)
                    sends.append(comm.isend(e, r, tag=j))
            if sizes[me][j]:
                lay.encode(seg, starts[me][j], sizes[me][j], copies[j][me])
            while done <= j and all(req.test() for req in phase1[done]):
                finish_piece(done)
                done += 1
            pump()
        phases.span("COMPRESS_SEND")
        phases.start()
        # what feeds the wire first (my sums), arrived results in between, else block
        while done < k:
            if all(req.test() for req in phase1[done]):
                finish_piece(done)
                done += 1
            elif not decode_next(False):
                pump()
                for req in phase1[done]:
                    req.wait()
        while phase2:
            pump()
            decode_next(True)
        for req in sends:
            req.wait()
        phases.span("PIPELINED_ACCUMULATE_DECOMPRESS", pieces=k)
        self._keep(arena)

    def rank_wire_bytes(self, numel: int, nranks: int, rank: int,
                        ctx: BucketContext | None = None) -> int:
        """Bytes rank ``rank`` sends (alltoall to the others + allgather of its chunk); the
        buffer's tensors are ``ctx``'s (without it, one tensor)."""
        if nranks <= 1:
            return 0
        enc = self._encoded_chunks(numel, nranks, ctx)
        return sum(enc) - enc[rank] + (nranks - 1) * enc[rank]

    def wire_bytes(self, numel: int, nranks: int, ctx: BucketContext | None = None) -> int:
        """Mean bytes one rank sends: ``2 (n-1)/n * T`` (rounded down)."""
        if nranks <= 1:
            return 0
        return 2 * (nranks - 1) * sum(self._encoded_chunks(numel, nranks, ctx)) // nranks

    def _encoded_chunks(self, numel: int, nranks: int, ctx: BucketContext | None) -> list[int]:
        """Encoded bytes of each rank's chunk (summed over its pieces when pipelined)."""
        lay = Layout(self.codec, numel, ctx)
        counts = lay.split(0, numel, nranks)
        k = num_pieces(max(counts))
        out = []
        for a, c in zip(displacements(counts), counts):
            sizes = lay.split(a, c, k) if k > 1 else [c]
            out.append(sum(lay.nbytes(s, m) for s, m in zip(
                [a + off for off in displacements(sizes)], sizes)))
        return out

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def __repr__(self) -> str:
        return f"TwoPhaseCompressor({self.name})"
