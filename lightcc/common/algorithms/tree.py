"""``tree``: recursive doubling, for latency-bound (small) buffers.

``log2(p)`` exchange steps of the whole buffer with partner ``rank XOR 2^i``; when the size is
not a power of two, the ranks above the largest power of two first fold their data into a
partner below it and get the result back at the end (2 extra steps for them). Both partners
of a step compute ``a <op> b`` on the same two arrays, and every op is commutative, so all
ranks end with bit-identical results. With a compressor the buffer goes to
``compressor.allreduce(world, ...)`` unchanged.
"""
from __future__ import annotations

from typing import Any

from ..arrays import empty, reduce_into, uses_compressor
from ..comm import Communicator
from ..compression.base import BucketContext, Compressor
from ..topology import Topology

TAG = 101


def recursive_doubling(comm: Communicator, buf: Any, op: str) -> None:
    """Allreduce the 1-D ``buf`` over ``comm`` in place by recursive doubling."""
    p, r = comm.size, comm.rank
    if p == 1 or buf.size == 0:
        return
    pof2 = 1 << (p.bit_length() - 1)
    extra = p - pof2
    if r >= pof2:                      # fold into r - pof2, then wait for the result
        comm.isend(buf, r - pof2, TAG).wait()
        comm.irecv(buf, r - pof2, TAG).wait()
        return
    tmp = empty(buf.size, buf)
    if r < extra:
        comm.irecv(tmp, r + pof2, TAG).wait()
        reduce_into(buf, tmp, op)
    mask = 1
    while mask < pof2:
        partner = r ^ mask
        rreq = comm.irecv(tmp, partner, TAG)
        sreq = comm.isend(buf, partner, TAG)
        rreq.wait()
        sreq.wait()
        reduce_into(buf, tmp, op)
        mask <<= 1
    if r < extra:
        comm.isend(buf, r + pof2, TAG).wait()


def allreduce(buf: Any, op: str, topo: Topology, compressor: Compressor | None,
              ctx: BucketContext) -> None:
    """Recursive doubling over the world (the compressor's scheme when one is given)."""
    if uses_compressor(compressor, op):
        compressor.allreduce(topo.world, buf, ctx)
        return
    recursive_doubling(topo.world, buf, op)
