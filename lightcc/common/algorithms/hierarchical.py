"""``hierarchical``: reduce inside each node, allreduce across nodes, share inside each node.

Homogeneous topology (every node has ``L`` ranks): the buffer is cut into ``L`` shards;

1. intra-node ``reduce_scatterv`` (uncompressed, fast link): local rank ``j`` gets shard ``j``
   summed over its node;
2. inter-node allreduce of shard ``j`` over ``topo.cross`` (the ranks with local rank ``j`` on
   every node): all ``L`` shards cross the slow link in parallel, on ``L`` independent
   communicators (so ``L`` x the TCP connections), each carrying ``1/L`` of the data; this is
   the only phase a compressor sees (``compressor.allreduce(cross, shard, ctx.sub(offset))``);
3. intra-node ``allgatherv`` of the shards.

Each intra-node phase is one native backend collective (shared memory / NCCL inside a node).
The cross-node phase is the native allreduce for device buffers (NCCL) and lightcc's pipelined
ring (:mod:`.ring`) for host buffers: Open MPI's own allreduce between two TCP hosts reached
only 50-56 % of a 1 Gbit line at 16-64 MB, the ring 91-95 %.

**Pipelined** (host buffers, no compressor): the buffer is cut into pieces of
:data:`PIECE_BYTES` (at most :data:`MAX_PIECES`); piece ``i`` is reduce-scattered inside the
node, its cross-node ring is started, and its node allgather is done :data:`DEPTH` pieces later,
so the slow link carries piece ``i`` while pieces ``i+1 .. i+DEPTH`` are reduced inside the
node. The order of the native node collectives is fixed (RS 0, RS 1, ..., then after each
RS the allgather of the piece ``DEPTH`` back), the same on every rank; only the ring steps,
which are point-to-point, advance whenever their messages arrive. Each piece's ring has its own
tag range.

Uneven nodes (e.g. 3 ranks as 2 + 1): the shards of different nodes would not line up with
the cross communicators, so the node *leaders* (local rank 0) carry everything: reduce to the
leader inside the node, allreduce among leaders (``cross`` of local rank 0, which contains
every node's leader), broadcast inside the node. The same bytes cross the slow link, over one
connection per node pair instead of ``L``.
"""
from __future__ import annotations

from typing import Any

from ..arrays import displacements, empty, even_counts, num_pieces, uses_compressor
from ..compression.base import BucketContext, Compressor
from ..topology import Topology
from . import ring

#: Bytes of the buffer per pipeline piece (host buffers without compression). Measured on
#: 2 x 2 simulated hosts at 1 Gbit (64 MB): 2 MB pieces / depth 2 751 ms, 512 KB / 16 595 ms,
#: 256 KB / 32 576 ms, 128 KB / 64 565 ms (= Open MPI's han, 568 ms).
PIECE_BYTES = 128 << 10
#: Upper bound on pieces (larger buffers get larger pieces; bounds the per-piece overhead).
MAX_PIECES = 1024
#: How many pieces' cross-node rings run while later pieces are reduced inside the node.
DEPTH = 64


def cross_allreduce(topo: Topology, shard: Any, op: str, compressor: Compressor | None,
                    ctx: BucketContext) -> None:
    """Allreduce ``shard`` over ``topo.cross``, through the compressor when one applies."""
    if topo.cross.size == 1 or shard.size == 0:
        return
    if uses_compressor(compressor, op):
        compressor.allreduce(topo.cross, shard, ctx)
    elif topo.cross.is_device:
        topo.cross.allreduce(shard, op)
    else:
        ring.ring_allreduce(topo.cross, shard, op)


def pipelined_allreduce(buf: Any, op: str, topo: Topology) -> None:
    """Host buffers, homogeneous nodes, no compressor: pieces through the three phases."""
    local, cross = topo.local, topo.cross
    pcounts = even_counts(buf.size, num_pieces(buf.nbytes, PIECE_BYTES, MAX_PIECES))
    pstarts = displacements(pcounts)
    shards: dict[int, tuple[Any, list[int]]] = {}
    steps: dict[int, ring.Steps] = {}
    waiting: dict[int, Any] = {}        # piece -> request its ring waits on (None: done)

    def advance(i: int) -> None:
        waiting[i] = next(steps[i], None)

    def poll() -> None:
        # oldest piece first (dicts keep insertion order); stop at the first ring still
        # waiting: later pieces' messages come behind its own on the same connections, and
        # testing every in-flight piece each step cost O(pieces x DEPTH) calls
        for i in waiting:
            while waiting[i] is not None and waiting[i].test():
                advance(i)
            if waiting[i] is not None:
                return

    def piece(i: int) -> Any:
        return buf[pstarts[i]:pstarts[i] + pcounts[i]]

    for step in range(len(pcounts) + DEPTH):
        if step < len(pcounts):
            counts = even_counts(pcounts[step], local.size)
            shard = empty(counts[local.rank], buf)
            local.reduce_scatterv(piece(step), shard, counts, op)
            shards[step] = (shard, counts)
            # at most DEPTH + 1 pieces are in flight; a tag range is reused only after its
            # piece has finished here, and MPI matches equal tags from one sender in order
            steps[step] = ring.ring_allreduce_steps(
                cross, shard, op, tag_base=(step % (DEPTH + 1)) * ring.MAX_CHUNKS)
            advance(step)
            poll()
        done = step - DEPTH
        if done >= 0:
            while waiting[done] is not None:
                poll()
                if waiting[done] is not None:
                    waiting[done].wait()
                    advance(done)
            del waiting[done], steps[done]
            shard, counts = shards.pop(done)
            local.allgatherv(shard, piece(done), counts)


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
        if topo.local.size > 1 and not topo.world.is_device \
                and not uses_compressor(compressor, op):
            pipelined_allreduce(buf, op, topo)
        else:
            sharded_allreduce(buf, op, topo, compressor, ctx)
    else:
        leader_allreduce(buf, op, topo, compressor, ctx)
