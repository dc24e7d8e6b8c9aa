"""``ring``: chunked, pipelined ring reduce-scatter + allgather over point-to-point calls.

Rank r sends to r+1 and receives from r-1 (world rank order, so with nodes made of
consecutive ranks the ring crosses each node boundary once per direction). The buffer is cut
into ``size`` segments, and every segment into the same number ``K`` of chunks; chunk ``c``
travels the ring on its own (tag ``c``), so after the first step up to ``K`` sends and ``K``
receives are outstanding and a chunk is forwarded as soon as it has been reduced. Keeping
several requests in flight is what lets Open MPI stripe over several TCP links
(``btl_tcp_links``) and keeps a slow link busy while the previous chunk is reduced.

The building blocks :func:`reduce_scatter` and :func:`allgather` work on any communicator and
are reused by the ``2d`` algorithm along rows and columns.

With a compressor, ``ring`` hands the whole buffer to ``compressor.allreduce(world, ...)``
(a compressed sum is the compressor's scheme, not a chain of partial sums); see
docs/topology.md.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Iterator, Sequence

from ..arrays import empty, even_counts, num_pieces, reduce_into, sub_blocks, uses_compressor
from ..comm import Communicator
from ..compression.base import BucketContext, Compressor
from ..topology import Topology

log = logging.getLogger("lightcc")

#: Default bytes per chunk; a segment is split into ceil(segment_bytes / chunk) chunks, the chunk
#: being the communicator's ``ring_chunk_bytes`` (its process set's LCC_RING_CHUNK_BYTES).
CHUNK_BYTES = 1 << 20
#: Upper bound on chunks per segment (= outstanding sends per rank, and the tag range used).
MAX_CHUNKS = 16


def num_chunks(counts: Sequence[int], itemsize: int, chunk_bytes: int | None = None,
               max_chunks: int | None = None) -> int:
    """Chunks per segment for segments of ``counts`` elements (same on every rank, >= 1)."""
    chunk_bytes = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    max_chunks = MAX_CHUNKS if max_chunks is None else max_chunks
    return num_pieces(max(counts) * itemsize if counts else 0, chunk_bytes, max_chunks)


Steps = Iterator[Any]
"""A ring operation as a generator: it yields a request it is waiting on whenever that request
has not completed yet, and finishes when the operation is done. :func:`drive` runs one to the
end; ``hierarchical`` interleaves several (one per pipeline piece) with native collectives."""


def _until_done(req: Any) -> Steps:
    while not req.test():
        yield req


def drive(steps: Steps) -> None:
    """Run ring steps to completion, blocking in ``wait()`` on whatever they wait for."""
    for req in steps:
        req.wait()


def _ring_pass(comm: Communicator, buf: Any, counts: Sequence[int], op: str | None,
               send_seg: Callable[[int], int], recv_seg: Callable[[int], int],
               tag_base: int = 0, nsteps: int | None = None,
               reduce_steps: int | None = None) -> Steps:
    """``nsteps`` (default ``size - 1``) ring steps; a chunk received in one of the first
    ``reduce_steps`` steps (default all) is reduced into ``buf`` (``op``), later ones stored.

    At step ``t`` this rank sends segment ``send_seg(t)`` to the right and receives segment
    ``recv_seg(t)`` from the left; ``send_seg(t + 1) == recv_seg(t)`` so each chunk is
    forwarded right after it arrives. Chunk ``c`` uses tag ``tag_base + c`` and moves through
    its steps on its own: chunk 0 may be in its allgather steps while chunk 5 is still being
    reduced. The communicator's ``progress`` hook (if any) runs once per chunk and step.
    """
    p, r = comm.size, comm.rank
    if p == 1:
        return
    nsteps = p - 1 if nsteps is None else nsteps
    reduce_steps = nsteps if reduce_steps is None or op is None else reduce_steps
    right, left = (r + 1) % p, (r - 1) % p
    k = num_chunks(counts, buf.dtype.itemsize, getattr(comm, "ring_chunk_bytes", None))
    sizes, starts = sub_blocks(counts, k)

    def piece(seg: int, c: int) -> Any:
        return buf[starts[seg][c]:starts[seg][c] + sizes[seg][c]]

    scratch = [empty(max(sizes[s][c] for s in range(p)), buf)
               for c in range(k)] if op is not None else []
    sends: list[Any] = [None] * k
    recvs: list[Any] = [None] * k
    progress = getattr(comm, "progress", None)

    def post(t: int, c: int) -> None:
        out = piece(send_seg(t), c)
        into = piece(recv_seg(t), c)
        if into.size:
            target = scratch[c][:into.size] if t < reduce_steps and op is not None else into
            recvs[c] = comm.irecv(target, left, tag=tag_base + c)
        if out.size:
            sends[c] = comm.isend(out, right, tag=tag_base + c)

    for c in range(k):
        post(0, c)
    for t in range(nsteps):
        for c in range(k):
            if recvs[c] is not None:
                yield from _until_done(recvs[c])
                recvs[c] = None
                if op is not None and t < reduce_steps:
                    into = piece(recv_seg(t), c)
                    reduce_into(into, scratch[c][:into.size], op)
            if sends[c] is not None:
                yield from _until_done(sends[c])
                sends[c] = None
            if t + 1 < nsteps:
                post(t + 1, c)
            if progress is not None:
                progress()


def reduce_scatter_steps(comm: Communicator, buf: Any, counts: Sequence[int], op: str,
                         tag_base: int = 0) -> Steps:
    """Ring steps of :func:`reduce_scatter`."""
    p, r = comm.size, comm.rank
    return _ring_pass(comm, buf, counts, op, lambda t: (r - t - 1) % p,
                      lambda t: (r - t - 2) % p, tag_base)


def allgather_steps(comm: Communicator, buf: Any, counts: Sequence[int],
                    tag_base: int = 0) -> Steps:
    """Ring steps of :func:`allgather`."""
    p, r = comm.size, comm.rank
    return _ring_pass(comm, buf, counts, None, lambda t: (r - t) % p,
                      lambda t: (r - t - 1) % p, tag_base)


def reduce_scatter(comm: Communicator, buf: Any, counts: Sequence[int], op: str) -> None:
    """Reduce ``buf`` over ``comm``; afterwards segment ``comm.rank`` of ``buf`` holds the result.

    Other segments are left holding partial results (scratch).
    """
    drive(reduce_scatter_steps(comm, buf, counts, op))


def allgather(comm: Communicator, buf: Any, counts: Sequence[int]) -> None:
    """Every rank contributes segment ``comm.rank`` of ``buf``; afterwards all hold all segments."""
    drive(allgather_steps(comm, buf, counts))


def ring_allreduce_steps(comm: Communicator, buf: Any, op: str, tag_base: int = 0) -> Steps:
    """Ring steps of :func:`ring_allreduce` (tags ``tag_base .. tag_base + MAX_CHUNKS - 1``)."""
    if comm.size == 1 or buf.size == 0:
        return
    # one pass of 2(p - 1) steps: reduce-scatter steps (segment r - t - 1 out, r - t - 2 in),
    # then allgather steps, which continue the same arithmetic (the segment a chunk finished
    # reducing in step p - 2 is segment r, the first one the allgather sends), so each chunk
    # starts its allgather as soon as it is reduced instead of after every chunk is: the link
    # no longer drains between the two phases
    p, r = comm.size, comm.rank
    counts = even_counts(buf.size, p)
    yield from _ring_pass(comm, buf, counts, op, lambda t: (r - t - 1) % p,
                          lambda t: (r - t - 2) % p, tag_base, 2 * (p - 1), p - 1)


def ring_allreduce(comm: Communicator, buf: Any, op: str) -> None:
    """Pipelined ring allreduce of the 1-D ``buf`` over ``comm``, in place."""
    drive(ring_allreduce_steps(comm, buf, op))


def allreduce(buf: Any, op: str, topo: Topology, compressor: Compressor | None,
              ctx: BucketContext) -> None:
    """Ring over the world; a compressor gets the whole buffer over the world instead."""
    if uses_compressor(compressor, op):
        log.debug("ring: compressor %s given, using its own scheme over the world",
                  getattr(compressor, "name", compressor))
        compressor.allreduce(topo.world, buf, ctx)
        return
    ring_allreduce(topo.world, buf, op)
