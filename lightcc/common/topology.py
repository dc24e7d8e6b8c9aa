"""World, local (same node) and cross (same local rank) communicators.

Nodes are found from host names, or, with ``LCC_LOCAL_SIZE=N``, by cutting the world into
consecutive groups of N ranks (simulated nodes on one machine; the last group may be smaller,
e.g. 3 ranks with N=2 give nodes {0,1} and {2}).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .comm import Communicator


@dataclass
class Topology:
    """The three communicators every algorithm may use, and this rank's place in them."""

    world: Communicator
    local: Communicator
    cross: Communicator
    node_of_rank: tuple[int, ...]   # node index of every world rank

    @property
    def rank(self) -> int:
        return self.world.rank

    @property
    def size(self) -> int:
        return self.world.size

    @property
    def local_rank(self) -> int:
        return self.local.rank

    @property
    def local_size(self) -> int:
        return self.local.size

    @property
    def cross_rank(self) -> int:
        return self.cross.rank

    @property
    def cross_size(self) -> int:
        return self.cross.size

    @property
    def num_nodes(self) -> int:
        return max(self.node_of_rank) + 1

    @property
    def is_homogeneous(self) -> bool:
        """True when every node has the same number of ranks."""
        counts = [self.node_of_rank.count(n) for n in range(self.num_nodes)]
        return len(set(counts)) == 1

    def free(self) -> None:
        for comm in (self.cross, self.local):
            comm.free()


def assign_nodes(hostnames: Sequence[str], local_size: int) -> tuple[int, ...]:
    """Node index per rank: by ``local_size`` blocks when > 0, else by first-seen host name."""
    if local_size > 0:
        return tuple(r // local_size for r in range(len(hostnames)))
    order: dict[str, int] = {}
    return tuple(order.setdefault(h, len(order)) for h in hostnames)


def build(world: Communicator, hostnames: Sequence[str], local_size: int) -> Topology:
    """Split ``world`` into local and cross communicators (collective over ``world``)."""
    nodes = assign_nodes(hostnames, local_size)
    me = world.rank
    local_rank = sum(1 for r in range(me) if nodes[r] == nodes[me])
    local = world.split(nodes[me], me, "local")
    cross = world.split(local_rank, me, "cross")
    return Topology(world=world, local=local, cross=cross, node_of_rank=nodes)
