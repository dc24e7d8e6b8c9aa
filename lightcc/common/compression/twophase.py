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
wire and the per-piece arithmetic are those of the unpipelined scheme applied to each piece
(for ``bucket``-scaled fp8 a piece carries its own scale). Device buffers (CuPy) always use the
collective scheme, with the codecs' CUDA kernels.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Any, Protocol

import numpy as np

from ..backends.base import Communicator, displacements, even_counts, sub_blocks
from ..backends.base import num_pieces as _num_pieces
from ..algorithms._ops import array_module
from .base import BucketContext

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


class Codec(Protocol):
    """Encodes a float32 chunk into a fixed number of bytes (a function of its length)."""

    def nbytes(self, n: int) -> int: ...

    def encode_into(self, x: np.ndarray, out: np.ndarray) -> None: ...

    def decode_into(self, payload: np.ndarray, n: int, out: np.ndarray,
                    accumulate: bool) -> None: ...


class _Arena:
    """A reusable byte buffer handed out in consecutive views (no allocation per piece)."""

    def __init__(self, buf: np.ndarray, xp_name: str = "numpy") -> None:
        self.buf, self.used, self.xp_name = buf, 0, xp_name

    def take(self, nbytes: int) -> np.ndarray:
        view = self.buf[self.used:self.used + nbytes]
        self.used += nbytes
        assert self.used <= self.buf.size, "arena sized too small"
        return view


class TwoPhaseCompressor:
    """Reduce-scatter and allgather in a compressed element format (see module docstring).

    Payload buffers come from one byte arena kept between calls (about twice the encoded
    bucket), so a step allocates and page-faults nothing; the owner sums its chunk in fp32 in
    place, in the region of ``buf`` its own copy was encoded from.
    """

    lossy = True

    def __init__(self, name: str, codec: Codec) -> None:
        self.name = name
        self.codec = codec
        self._spare: dict[str, Any] = {}       # the arenas' buffers between calls, per xp

    def _arena(self, nbytes: int, xp: Any = np) -> _Arena:
        """An arena of at least ``nbytes`` in ``xp``'s memory (NumPy or CuPy): the kept buffer,
        or a new one (a concurrent call on the same compressor, or a larger bucket)."""
        buf = self._spare.pop(xp.__name__, None)
        if buf is None or buf.size < nbytes:
            buf = xp.empty(nbytes, np.uint8)
        return _Arena(buf, xp.__name__)

    def _keep(self, arena: _Arena) -> None:
        kept = self._spare.get(arena.xp_name)
        if kept is None or kept.size < arena.buf.size:
            self._spare[arena.xp_name] = arena.buf

    def _sum_into(self, payloads: list[np.ndarray], n: int, acc: np.ndarray) -> None:
        """``acc`` = the fp32 sum of the decoded payloads, in rank order, from zero."""
        acc.fill(0.0)
        for payload in payloads:
            self.codec.decode_into(payload, n, acc, True)

    def allreduce(self, comm: Communicator, buf: np.ndarray, ctx: BucketContext) -> None:
        """Sum ``buf`` over ``comm`` in place (a single rank keeps ``buf`` exact)."""
        p, me = comm.size, comm.rank
        if p == 1 or buf.size == 0:
            return
        counts = even_counts(buf.size, p)
        # device communicators: the collective scheme (NCCL issues point-to-point calls in
        # groups that must match on both sides, which the pipelined exchange does not)
        k = 1 if comm.is_device else num_pieces(max(counts))
        if k > 1:
            self._pipelined(comm, buf, counts, k)
            return
        starts = displacements(counts)
        enc = [self.codec.nbytes(c) for c in counts]
        estarts = displacements(enc)
        mine, c = enc[me], counts[me]
        arena = self._arena(sum(enc) + mine * (p + 1), array_module(buf))
        phases = _Phases(comm, self.name)
        send = arena.take(sum(enc))
        for r in range(p):
            self.codec.encode_into(buf[starts[r]:starts[r] + counts[r]],
                                   send[estarts[r]:estarts[r] + enc[r]])
        phases.span("COMPRESS")
        recv = arena.take(mine * p)
        comm.alltoallv(send, enc, recv, [mine] * p)
        phases.start()
        acc = buf[starts[me]:starts[me] + c]      # encoded above: free to sum into
        self._sum_into([recv[s * mine:(s + 1) * mine] for s in range(p)], c, acc)
        own = arena.take(mine)
        self.codec.encode_into(acc, own)
        phases.span("DECOMPRESS_ACCUMULATE_RECOMPRESS")
        comm.allgatherv(own, send, enc)
        phases.start()
        for r in range(p):
            self.codec.decode_into(send[estarts[r]:estarts[r] + enc[r]], counts[r],
                                   buf[starts[r]:starts[r] + counts[r]], False)
        phases.span("DECOMPRESS")
        self._keep(arena)

    def _pipelined(self, comm: Communicator, buf: np.ndarray, counts: list[int], k: int) -> None:
        """Both phases per piece over point-to-point calls (see module docstring).

        Every receive is posted first. Then, piece by piece: encode and send piece j of every
        other rank's chunk, encode my own copy of my piece j, and between pieces sum, encode,
        send and decode whichever of my pieces have all their copies. Then the same for the
        rest of my pieces, and while none is complete, decode the sums of other ranks' pieces
        that have arrived: work that feeds the wire goes first, the codecs run while it is busy.
        """
        p, me, codec = comm.size, comm.rank, self.codec
        sizes, starts = sub_blocks(counts, k)
        nb = [[codec.nbytes(n) for n in row] for row in sizes]
        others = [(me + d) % p for d in range(1, p)]
        # sends and receives of every piece once, plus p copies of my pieces and their sums
        arena = self._arena(2 * sum(map(sum, nb)) + (p - 1) * sum(nb[me]))
        phases = _Phases(comm, self.name)

        def piece(r: int, j: int) -> np.ndarray:
            return buf[starts[r][j]:starts[r][j] + sizes[r][j]]

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
            n = sizes[me][j]
            if n:
                acc = piece(me, j)            # my copy is encoded: sum in place
                self._sum_into(copies[j], n, acc)
                out = arena.take(nb[me][j])
                codec.encode_into(acc, out)
                sends.extend(comm.isend(out, r, tag=k + j) for r in others)
                codec.decode_into(out, n, acc, False)

        def decode_next(block: bool) -> bool:
            """Decode the next sum of another rank's piece if it has arrived (or wait for it)."""
            if not phase2 or not (block or phase2[0][3].test()):
                return False
            r, j, b, req = phase2.popleft()
            req.wait()
            codec.decode_into(b, sizes[r][j], piece(r, j), False)
            return True

        for j in range(k):
            for r in others:
                if sizes[r][j]:
                    e = arena.take(nb[r][j])
                    codec.encode_into(piece(r, j), e)
                    sends.append(comm.isend(e, r, tag=j))
            if sizes[me][j]:
                codec.encode_into(piece(me, j), copies[j][me])
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

    def rank_wire_bytes(self, numel: int, nranks: int, rank: int) -> int:
        """Bytes rank ``rank`` sends (alltoall to the others + allgather of its chunk)."""
        if nranks <= 1:
            return 0
        enc = self._encoded_chunks(numel, nranks)
        return sum(enc) - enc[rank] + (nranks - 1) * enc[rank]

    def wire_bytes(self, numel: int, nranks: int) -> int:
        """Mean bytes one rank sends: ``2 (n-1)/n * T`` (rounded down)."""
        if nranks <= 1:
            return 0
        return 2 * (nranks - 1) * sum(self._encoded_chunks(numel, nranks)) // nranks

    def _encoded_chunks(self, numel: int, nranks: int) -> list[int]:
        """Encoded bytes of each rank's chunk (summed over its pieces when pipelined)."""
        counts = even_counts(numel, nranks)
        k = num_pieces(max(counts))
        if k == 1:
            return [self.codec.nbytes(c) for c in counts]
        return [sum(self.codec.nbytes(x) for x in even_counts(c, k)) for c in counts]

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def __repr__(self) -> str:
        return f"TwoPhaseCompressor({self.name})"
