"""Allreduce algorithms over the ``Communicator`` protocol, and the ``auto`` choice.

:func:`allreduce` is the engine's single entry point: it sums (or min/max/prod) a 1-D
buffer over the world in place using the named algorithm, letting the compressor (if any)
carry the data that crosses the slowest link.

Algorithms (docs/topology.md): ``flat`` (backend native, in ``LCC_MPI_CHUNK_BYTES`` pieces),
``native`` (one call of the backend's own allreduce for the whole buffer: Open MPI's han or
tuned), ``ring`` (pipelined ring of lightcc's own), ``hierarchical`` (node reduce-scatter /
cross allreduce / node allgather), ``2d`` (the same grid with pipelined rings in both
dimensions), ``tree`` (recursive doubling).

``auto`` (:func:`choose`) picks by buffer size and topology using :data:`THRESHOLDS`, which
the autotuner (or a user) may change with :func:`set_thresholds`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

from ..compression.base import BucketContext, Compressor
from ..topology import Topology
from . import adasum, flat, hierarchical, native, ring, tree, twod

Algorithm = Callable[[Any, str, Topology, "Compressor | None", BucketContext], None]

_REGISTRY: dict[str, Algorithm] = {
    "flat": flat.allreduce,
    "ring": ring.allreduce,
    "hierarchical": hierarchical.allreduce,
    "2d": twod.allreduce,
    "tree": tree.allreduce,
    "native": native.allreduce,
}


@dataclass(frozen=True)
class AutoThresholds:
    """What ``auto`` picks (sizes in bytes of the whole buffer; same on every rank).

    - below ``small_bytes``: ``small`` (latency-bound; the native call is usually a C
      recursive doubling already);
    - one node: ``flat`` — shared memory, nothing topological to exploit;
    - one rank on every node, at or above ``single_rank_bytes`` (8 MB): ``single_rank_nodes``
      for host buffers (device buffers use NCCL's native ring, ``flat``)
      (``ring``: lightcc's pipelined ring keeps several chunks in flight and reached 93-95 %
      of a 1 Gbit line at 16-64 MB where Open MPI's allreduce collapsed to 51-56 %; at 1-4 MB
      Open MPI's was as fast or steadier, 86-95 % against the ring's 77-95 %, docs/topology.md);
    - several nodes with several ranks each, at or above ``hierarchical_bytes``:
      ``multi_node`` for host (MPI) buffers — ``native``: one ``MPI_Allreduce`` of the whole
      buffer, so Open MPI's han (hierarchical, in C) runs it: lightcc's own pipelined
      ``hierarchical`` had matched han on a quiet machine (2 x 2 simulated hosts, 1 Gbit,
      1.41-1.47 Gbit/s bus bandwidth for 1-64 MB, han 1.42-1.49) but lost to it by 8 % in
      issue 29's measurement and by 1.5-2x when the cores were busy (its 128 KB pieces are
      Python-level steps; docs/topology.md) — and ``multi_node_device`` (``hierarchical``,
      native NCCL phases) for device buffers. Host buffers on nodes of different sizes use
      ``flat`` (the leader scheme sends everything over one connection per node pair). Below
      the threshold ``flat``. A compressed bucket under ``native`` takes ``hierarchical``'s
      scheme (the compressor on the cross-node phase only).
    """

    small_bytes: int = 64 * 1024
    small: str = "flat"
    hierarchical_bytes: int = 256 * 1024
    multi_node: str = "native"
    multi_node_device: str = "hierarchical"
    single_rank_nodes: str = "ring"
    single_rank_bytes: int = 8 * 1024 * 1024


#: The thresholds ``auto`` uses now; replace with :func:`set_thresholds`.
THRESHOLDS = AutoThresholds()


def set_thresholds(**changes: Any) -> AutoThresholds:
    """Change fields of :data:`THRESHOLDS` (e.g. ``hierarchical_bytes=1 << 20``); returns them.

    Must be called with the same values on every rank (the choice has to agree everywhere).
    """
    global THRESHOLDS
    for key in ("small", "multi_node", "multi_node_device", "single_rank_nodes"):
        if key in changes and changes[key] not in _REGISTRY:
            raise ValueError(f"{key}={changes[key]!r} is not an algorithm; "
                             f"known: {', '.join(sorted(_REGISTRY))}")
    THRESHOLDS = dataclasses.replace(THRESHOLDS, **changes)
    return THRESHOLDS


def register(name: str, fn: Algorithm) -> None:
    """Add an algorithm under ``name`` (used by the algorithm modules)."""
    _REGISTRY[name] = fn


def available_algorithms() -> list[str]:
    """Names accepted by ``LCC_ALGORITHM`` / ``init(algorithm=...)``."""
    return ["auto", *sorted(_REGISTRY)]


def choose(name: str, nbytes: int, topo: Topology,
           thresholds: AutoThresholds | None = None) -> str:
    """Resolve ``auto`` to a concrete algorithm for a buffer of ``nbytes`` on ``topo``.

    Depends only on values equal on every rank (size, node layout), so all ranks agree.
    """
    if name != "auto":
        if name not in _REGISTRY:
            raise ValueError(f"unknown algorithm {name!r}; known: {', '.join(available_algorithms())}")
        return name
    t = THRESHOLDS if thresholds is None else thresholds
    if topo.size == 1:
        return "flat"
    if nbytes < t.small_bytes:
        return t.small
    nodes = topo.num_nodes
    if nodes == 1 or nbytes < t.hierarchical_bytes:
        return "flat"
    device = getattr(topo.world, "is_device", False)
    if nodes == topo.size:      # one rank per node; NCCL's own ring beats lightcc's over p2p
        return t.single_rank_nodes if nbytes >= t.single_rank_bytes and not device else "flat"
    if device:
        return t.multi_node_device
    return t.multi_node if topo.is_homogeneous else "flat"


def get(name: str) -> Algorithm:
    """The function of the concrete algorithm ``name`` (as :func:`choose` returns it)."""
    return _REGISTRY[name]


def adasum_reduce(buf: Any, op: str, topo: Topology, compressor: Compressor | None,
                  ctx: BucketContext) -> None:
    """The ``adasum`` op's own algorithm (per tensor: ``ctx.sizes``); no compressor applies."""
    adasum.allreduce(topo.world, buf, ctx.sizes)


def allreduce(buf: Any, op: str, topo: Topology, compressor: Compressor | None,
              ctx: BucketContext, algorithm: str = "auto",
              thresholds: AutoThresholds | None = None) -> str:
    """Reduce ``buf`` over ``topo.world`` in place; returns the algorithm actually used.
    ``thresholds`` are the process set's (its ``ExecSettings.auto``) for ``auto``. The
    ``adasum`` op has one algorithm of its own (per tensor: ``ctx.sizes``)."""
    if op == "adasum":
        adasum_reduce(buf, op, topo, compressor, ctx)
        return "adasum"
    name = choose(algorithm, int(buf.nbytes), topo, thresholds)
    _REGISTRY[name](buf, op, topo, compressor, ctx)
    return name
