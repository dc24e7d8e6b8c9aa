"""World, local (same node) and cross (same local rank) communicators.

Nodes are found from host names, or, with ``LCC_LOCAL_SIZE=N``, by cutting the world into
consecutive groups of N ranks (simulated nodes on one machine; the last group may be smaller,
e.g. 3 ranks with N=2 give nodes {0,1} and {2}).
"""
from __future__ import annotations

import logging
import os
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


def build(world: Communicator, hostnames: Sequence[str], local_size: int,
          cross_transport: str = "mpi", control_addr: str = "") -> Topology:
    """Split ``world`` into local and cross communicators (collective over ``world``).

    ``cross_transport`` (``LCC_CROSS_TRANSPORT``): ``tcp`` carries the point-to-point traffic
    of the communicators whose members are all on different nodes (``cross``, and ``world``
    when every node has one rank) over lightcc's own TCP links (backends/tcp.py); ``mpi``
    keeps Open MPI's; ``auto`` is ``tcp`` when the ranks span several nodes and some node
    has several (they compete for its cores while one waits for the wire: +11 % fp16
    training on 2 x 2 simulated hosts at 1 Gbit; with one rank per node the spinning wait
    costs no other rank a core and MPI was 5-8 % faster, docs/topology.md).
    """
    nodes = assign_nodes(hostnames, local_size)
    me = world.rank
    local_rank = sum(1 for r in range(me) if nodes[r] == nodes[me])
    local = world.split(nodes[me], me, "local")
    cross = world.split(local_rank, me, "cross")
    topo = Topology(world=world, local=local, cross=cross, node_of_rank=nodes)
    several_hosts = topo.num_nodes > 1
    if cross_transport == "tcp" and several_hosts or \
            cross_transport == "auto" and several_hosts and topo.num_nodes < topo.size:
        attach_tcp(topo, control_addr)
    return topo


def attach_tcp(topo: Topology, control_addr: str) -> None:
    """Give ``cross`` (and ``world`` when each node has one rank) lightcc's TCP links
    (collective over ``world``; every rank agrees, so all keep MPI if any pair fails)."""
    for comm in (topo.cross, topo.world):
        spread = comm.size > 1 and (comm is topo.cross or topo.num_nodes == topo.size)
        use = getattr(comm, "use_tcp", None)
        # collective over comm's members only; every member sees the same condition
        if spread and use is not None and not use(control_addr):
            logging.getLogger("lightcc").warning(
                "rank %d: lightcc's TCP links for %s could not be set up between every pair "
                "of ranks; its point-to-point traffic stays on MPI (set LCC_CONTROL_ADDR to "
                "an interface every host has, or LCC_CROSS_TRANSPORT=mpi)", topo.rank, comm.name)


def overlap_in_background(setting: str, topo: Topology) -> bool:
    """Whether the background thread starts collectives as soon as they are submitted.

    ``LCC_OVERLAP=1``: yes. ``0`` (*lazy*): collectives start when a thread waits for them
    (``synchronize()``, ``DistributedOptimizer.step()``), so every rank runs them from a thread
    that has nothing else to do. ``auto``: lazy only when the whole job is on one host and that
    host has fewer than two usable cores per rank. There, overlapping buys nothing (the cores
    are busy computing) and costs a lot: a shared-memory collective progresses only while the
    threads of all ranks are on a core at the same time, which a fully loaded host grants in
    scheduler time slices, so a 1 MB allreduce took 7-18 ms instead of 0.3 ms (docs/torch.md).
    """
    if setting in ("1", "on", "true"):
        return True
    if setting in ("0", "off", "false"):
        return False
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return topo.num_nodes > 1 or cores >= 2 * topo.local_size
