"""``2d``: ranks as a grid, rows = nodes, columns = same local rank (TACO 2D / 2D-torus).

1. reduce-scatter along the row (``topo.local``) with the pipelined ring of :mod:`.ring`;
2. allreduce of this rank's shard along the column (``topo.cross``), again a pipelined ring
   (or the compressor's scheme: this is the phase that crosses the slow link);
3. allgather along the row, pipelined ring.

How it differs from ``hierarchical``: the data flow is the same, but every phase is lightcc's
own chunked ring of ``isend``/``irecv`` instead of a native backend collective. That gives
``2(L-1) + 2(N-1)`` latency steps instead of a flat ring's ``2(NL-1)``, per-chunk pipelining
and several outstanding requests per link in *both* dimensions (so multi-link TCP applies to
the columns too), at the cost of not using the backend's intra-node tricks (shared memory
single-copy, NCCL NVLink kernels). Use it where the backend's native collectives are weak
(e.g. a TCP-only MPI); ``hierarchical`` is the better default where they are strong.

Uneven nodes: falls back to the leader scheme of ``hierarchical`` (see its docstring).
"""
from __future__ import annotations

from typing import Any

from ..arrays import displacements, even_counts, uses_compressor
from ..compression.base import BucketContext, Compressor
from ..topology import Topology
from . import hierarchical, ring


def allreduce(buf: Any, op: str, topo: Topology, compressor: Compressor | None,
              ctx: BucketContext) -> None:
    """2D allreduce of ``buf`` over ``topo.world`` (see module docstring)."""
    if topo.size == 1 or buf.size == 0:
        return
    if not topo.is_homogeneous:
        hierarchical.leader_allreduce(buf, op, topo, compressor, ctx)
        return
    counts = even_counts(buf.size, topo.local.size)
    start = displacements(counts)[topo.local.rank]
    shard = buf[start:start + counts[topo.local.rank]]
    ring.reduce_scatter(topo.local, buf, counts, op)
    if topo.cross.size > 1 and shard.size:
        if uses_compressor(compressor, op):
            compressor.allreduce(topo.cross, shard, ctx.sub(start))
        else:
            ring.ring_allreduce(topo.cross, shard, op)
    ring.allgather(topo.local, buf, counts)
