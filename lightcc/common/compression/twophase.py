"""Two-phase compressed allreduce for element-wise formats (fp16, bf16, fp8).

Phase 1 (reduce-scatter): the buffer is cut into ``comm.size`` chunks (``even_counts``); each
chunk is encoded and sent to its owner with one ``alltoallv``; the owner decodes every rank's
copy (its own included, so results do not depend on who owns a chunk) and sums them in fp32 in
rank order. Phase 2 (allgather): the owner re-encodes the sum and one ``allgatherv`` spreads
the encoded chunks; **every** rank, the owner included, decodes the same bytes, so all ranks
end bitwise identical. A rank sends ``T - E(c_me) + (n-1) E(c_me)`` bytes where ``E(c)`` is the
encoded size of a chunk of ``c`` elements and ``T = sum E(c_r)``; averaged over ranks that is
``2 (n-1)/n * T`` = ``2 (n-1)/n * N * bytes_per_element`` plus scales.
"""
from __future__ import annotations

import time
from typing import Any, Protocol

import numpy as np

from ..backends.base import Communicator, displacements, even_counts
from .base import BucketContext


class Codec(Protocol):
    """Encodes a float32 chunk into a fixed number of bytes (a function of its length)."""

    def nbytes(self, n: int) -> int: ...

    def encode_into(self, x: np.ndarray, out: np.ndarray) -> None: ...

    def decode_into(self, payload: np.ndarray, n: int, out: np.ndarray,
                    accumulate: bool) -> None: ...


class TwoPhaseCompressor:
    """Reduce-scatter and allgather in a compressed element format (see module docstring)."""

    lossy = True

    def __init__(self, name: str, codec: Codec) -> None:
        self.name = name
        self.codec = codec

    def allreduce(self, comm: Communicator, buf: np.ndarray, ctx: BucketContext) -> None:
        """Sum ``buf`` over ``comm`` in place (a single rank keeps ``buf`` exact)."""
        p, me = comm.size, comm.rank
        if p == 1 or buf.size == 0:
            return
        counts = even_counts(buf.size, p)
        starts = displacements(counts)
        enc = [self.codec.nbytes(c) for c in counts]
        estarts = displacements(enc)
        tracer = getattr(comm, "tracer", None)
        trace = tracer is not None and tracer.enabled
        track = f"link:{comm.name}"
        t0 = time.perf_counter() if trace else 0.0
        send = np.empty(sum(enc), np.uint8)
        for r in range(p):
            self.codec.encode_into(buf[starts[r]:starts[r] + counts[r]],
                                   send[estarts[r]:estarts[r] + enc[r]])
        if trace:
            tracer.span(track, "COMPRESS", t0, time.perf_counter(), format=self.name)
        mine, c = enc[me], counts[me]
        recv = np.empty(mine * p, np.uint8)
        comm.alltoallv(send, enc, recv, [mine] * p)
        t1 = time.perf_counter() if trace else 0.0
        acc = np.zeros(c, np.float32)
        for s in range(p):
            self.codec.decode_into(recv[s * mine:(s + 1) * mine], c, acc, True)
        own = np.empty(mine, np.uint8)
        self.codec.encode_into(acc, own)
        if trace:
            tracer.span(track, "DECOMPRESS_ACCUMULATE_RECOMPRESS", t1, time.perf_counter(),
                        format=self.name)
        comm.allgatherv(own, send, enc)
        t2 = time.perf_counter() if trace else 0.0
        for r in range(p):
            self.codec.decode_into(send[estarts[r]:estarts[r] + enc[r]], counts[r],
                                   buf[starts[r]:starts[r] + counts[r]], False)
        if trace:
            tracer.span(track, "DECOMPRESS", t2, time.perf_counter(), format=self.name)

    def rank_wire_bytes(self, numel: int, nranks: int, rank: int) -> int:
        """Bytes rank ``rank`` sends (alltoall to the others + allgather of its chunk)."""
        if nranks <= 1:
            return 0
        enc = [self.codec.nbytes(c) for c in even_counts(numel, nranks)]
        return sum(enc) - enc[rank] + (nranks - 1) * enc[rank]

    def wire_bytes(self, numel: int, nranks: int) -> int:
        """Mean bytes one rank sends: ``2 (n-1)/n * T`` (rounded down)."""
        if nranks <= 1:
            return 0
        enc = [self.codec.nbytes(c) for c in even_counts(numel, nranks)]
        return 2 * (nranks - 1) * sum(enc) // nranks

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def __repr__(self) -> str:
        return f"TwoPhaseCompressor({self.name})"
