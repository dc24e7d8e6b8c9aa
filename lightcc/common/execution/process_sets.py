"""This rank's process sets (:class:`ProcessSets`): one :class:`~.group.Group` per set, the
execution settings they share, and the tracer they report to. It alone adds, removes and
reconfigures groups (at agreed batches, the same on every rank); others read ``groups``.
"""
from __future__ import annotations

from typing import Any, Callable

from ..backends.mpi import MPICommunicator, thread_multiple
from ..control.messages import Coll, Response
from ..topology import Topology, build
from ..tracing import NULL, Tracer
from .direct import DirectPath
from .group import ExecSettings, Group

#: Settings of :class:`~.group.ExecSettings` that a batch may change (the autotuner's).
EXEC_FIELDS = ("fusion_threshold", "algorithm", "auto_thresholds", "min_compress_bytes",
               "ring_chunk_bytes", "mpi_chunk_bytes", "ef_ttl_steps")


class ProcessSets:
    """See module docstring. ``progress`` is the hook communicators call between the pieces
    of a long exchange (the engine's negotiation pump)."""

    def __init__(self, config: Any, topo: Topology, hostnames: list[str], rank: int,
                 base: MPICommunicator, progress: Callable[[], None]) -> None:
        self.config = config
        self.topo, self.hostnames, self.rank = topo, hostnames, rank
        self.progress = progress
        self.settings = ExecSettings.from_config(config)
        self.tracer: Tracer = NULL
        ranks = tuple(range(topo.world.size))
        self.groups: dict[int, Group] = {0: Group(0, ranks, topo, self.settings,
                                                  progress=progress,
                                                  direct=self.direct_path(base, ranks))}

    def direct_path(self, comm: MPICommunicator, ranks: tuple[int, ...]) -> Any:
        """A process set's direct path (collective over ``comm``: it duplicates it), or None
        when LCC_DIRECT_BYTES is 0 or MPI lacks MPI_THREAD_MULTIPLE (the calling thread would
        use MPI beside the engine's)."""
        if self.config.direct_bytes <= 0 or not thread_multiple():
            return None
        return DirectPath(comm.dup("direct"), ranks, self.config.stall_check_time,
                          self.config.stall_shutdown_time)

    def set_tracer(self, tracer: Tracer) -> None:
        """Route trace events of every group's communicators to ``tracer``."""
        self.tracer = tracer
        for group in self.groups.values():
            group.set_tracer(tracer)

    def apply(self, settings: dict) -> None:
        """Tuned settings of an agreed batch (those of :data:`EXEC_FIELDS`), on every group."""
        changes = {k: v for k, v in settings.items() if k in EXEC_FIELDS}
        if not changes:
            return
        if "fusion_threshold" in changes:
            changes["fusion_threshold"] = int(changes["fusion_threshold"])
        if "algorithm" in changes:
            changes["algorithm"] = str(changes["algorithm"])
        self.settings = self.settings.changed(**changes)
        for group in self.groups.values():
            group.apply(self.settings)

    def change(self, resp: Response) -> None:
        """Add or remove the process set of an agreed ADD_PSET / REMOVE_PSET response."""
        if resp.request.coll == Coll.ADD_PSET:
            self._add(resp)
        else:
            self._remove(resp.request.root)

    def _add(self, resp: Response) -> None:
        ranks = tuple(resp.request.splits)
        member = self.rank in ranks
        sub = self.topo.world.split(0 if member else 1, self.rank, f"pset{resp.value}")
        if member:
            hosts = [self.hostnames[r] for r in ranks]
            topo = build(sub, hosts, self.config.local_size, self.config.cross_transport,
                         self.config.control_addr)
            group = Group(resp.value, ranks, topo, self.settings, progress=self.progress,
                          direct=self.direct_path(sub, ranks))
            group.set_tracer(self.tracer)
        else:
            sub.free()
            group = Group(resp.value, ranks, None, self.settings)
        self.groups[resp.value] = group

    def _remove(self, pset_id: int) -> None:
        group = self.groups.pop(pset_id, None)
        if group is not None and group.topo is not None:
            group.free()

    def stepped(self, psets: set[int]) -> None:
        """A batch that used these process sets is done (their step counters advance)."""
        for pset in psets:
            group = self.groups.get(pset)
            if group is not None:
                group.step += 1

    def free(self) -> None:
        """Free every group's communicators (at shutdown)."""
        for group in list(self.groups.values()):
            if group.topo is not None:
                group.free()
