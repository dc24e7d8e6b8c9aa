"""``native``: the whole buffer in one call of the backend's own allreduce.

For host buffers that is one ``MPI_Allreduce`` on the process set's communicator, so Open
MPI's collective framework chooses the algorithm: ``han`` (its hierarchical component: intra-
node reduce, inter-node allreduce among leaders, intra-node broadcast, pipelined in segments)
where it is enabled, else ``tuned``'s decision rules (recursive doubling, ring, Rabenseifner
...). It differs from ``flat`` only in not cutting the buffer into ``LCC_MPI_CHUNK_BYTES``
pieces: ``flat``'s 4 MB pieces are faster on one host (Open MPI's large-message algorithms
were 3-4x slower there), but each piece is a separate collective that han pipelines from
scratch; ``native`` lets MPI see the whole message, which is what a program calling
``MPI_Allreduce`` itself gets. It is a candidate of ``auto``'s thresholds and of the
autotuner so that lightcc is never slower than MPI alone (issue 29).

Blocking, not ``MPI_Iallreduce``: Open MPI routes the non-blocking call to ``libnbc`` (neither
han nor tuned), measured 1.5x slower at 4 MB across two hosts (docs/profile-1gbit.md).

Device communicators (NCCL) have one native allreduce already: ``native`` is their
``allreduce``. A compressor cannot ride inside MPI's call, so a compressed bucket takes
``hierarchical``'s scheme: exact inside a node, the compressor on the traffic between nodes.
"""
from __future__ import annotations

from typing import Any

from ..arrays import uses_compressor
from ..compression.base import BucketContext, Compressor
from ..topology import Topology
from . import hierarchical


def allreduce(buf: Any, op: str, topo: Topology, compressor: Compressor | None,
              ctx: BucketContext) -> None:
    """One native allreduce of ``buf`` over ``topo.world`` (see module docstring)."""
    if uses_compressor(compressor, op):
        hierarchical.allreduce(buf, op, topo, compressor, ctx)
        return
    world = topo.world
    whole = getattr(world, "native_allreduce", None)
    if whole is None:            # NCCL: its allreduce is already one native call
        world.allreduce(buf, op)
    else:
        whole(buf, op)
