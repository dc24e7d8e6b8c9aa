"""``hierarchical``: reduce inside each node, allreduce across nodes, share inside each node.

Homogeneous topology (every node has ``L`` ranks): the buffer is cut into ``L`` shards;

1. intra-node ``reduce_scatterv`` (uncompressed, fast link): local rank ``j`` gets shard ``j``
   summed over its node;
2. inter-node allreduce of shard ``j`` over ``topo.cross`` (the ranks with local rank ``j`` on
   every node): all ``L`` shards cross the slow link in parallel, on ``L`` independent
   communicators (so ``L`` x the TCP connections), each carrying ``1/L`` of the data; this is
   the only phase a compressor sees (``compressor.allreduce(cross, shard, ctx.sub(offset))``);
3. intra-node ``allgatherv`` of the shards.

Each phase is one native backend collective (shared memory / NCCL inside a node).

Uneven nodes (e.g. 3 ranks as 2 + 1): the shards of different nodes would not line up with
the cross communicators, so the node *leaders* (local rank 0) carry everything: reduce to the
leader inside the node, allreduce among leaders (``cross`` of local rank 0, which contains
every node's leader), broadcast inside the node. The same bytes cross the slow link, over one
connection per node pair instead of ``L``.
"""
from __future__ import annotations

from typing import Any

from ..backends.base import displacements, even_counts
from ..compression.base import BucketContext, Compressor
from ..topology import Topology
from ._ops import empty, uses_compressor


def cross_allreduce(topo: Topology, shard: Any, op: str, compressor: Compressor | None,
                    ctx: BucketContext) -> None:
    """Allreduce ``shard`` over ``topo.cross``, through the compressor when one applies."""
    if topo.cross.size == 1 or shard.size == 0:
        return
    if uses_compressor(compressor, op):
        compressor.allreduce(topo.cross, shard, ctx)
    else:
        topo.cross.allreduce(shard, op)


def leader_allreduce(buf: Any, op: str, topo: Topology, compressor: Compressor | None,
                     ctx: BucketContext) -> None:
    """Reduce to local rank 0, allreduce among node leaders, broadcast inside each node."""
    local = topo.local
    if local.size > 1:
        counts = [buf.size] + [0] * (local.size - 1)
        tmp = empty(buf.size if local.rank == 0 else 0, buf)
        local.reduce_scatterv(buf, tmp, counts, op)
        if local.rank == 0:
            buf[...] = tmp
    if local.rank == 0:
        cross_allreduce(topo, buf, op, compressor, ctx)
    if local.size > 1:
        local.bcast(buf, 0)


def sharded_allreduce(buf: Any, op: str, topo: Topology, compressor: Compressor | None,
                      ctx: BucketContext) -> None:
    """Reduce-scatter in the node, allreduce each shard across nodes, allgather in the node."""
    local = topo.local
    if local.size == 1:
        cross_allreduce(topo, buf, op, compressor, ctx)
        return
    counts = even_counts(buf.size, local.size)
    start = displacements(counts)[local.rank]
    shard = empty(counts[local.rank], buf)
    local.reduce_scatterv(buf, shard, counts, op)
    cross_allreduce(topo, shard, op, compressor, ctx.sub(start))
    local.allgatherv(shard, buf, counts)


def allreduce(buf: Any, op: str, topo: Topology, compressor: Compressor | None,
              ctx: BucketContext) -> None:
    """Hierarchical allreduce of ``buf`` over ``topo.world`` (see module docstring)."""
    if topo.size == 1 or buf.size == 0:
        return
    if topo.is_homogeneous:
        sharded_allreduce(buf, op, topo, compressor, ctx)
    else:
        leader_allreduce(buf, op, topo, compressor, ctx)
