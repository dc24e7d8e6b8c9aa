"""``flat``: one allreduce over the whole world (the backend's native algorithm)."""
from __future__ import annotations

from typing import Any

from ..compression.base import BucketContext, Compressor
from ..topology import Topology


def allreduce(buf: Any, op: str, topo: Topology, compressor: Compressor | None,
              ctx: BucketContext) -> None:
    """Native allreduce, or the compressor's scheme over the world when one is given."""
    if compressor is not None and op == "sum":
        compressor.allreduce(topo.world, buf, ctx)
    else:
        topo.world.allreduce(buf, op)
