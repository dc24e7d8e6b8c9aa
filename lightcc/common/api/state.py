"""Runtime state of the API: the running engine, process-set objects, op names, and the
queries that read them (rank, size, topology, stats). Lifecycle (``init``/``shutdown``) is in
lifecycle.py; nothing here starts or stops anything."""
from __future__ import annotations

import logging
import threading
from typing import Any, Sequence

from .. import config as config_mod
from ..engine import Engine
from ..exceptions import InvalidArgumentError, NotInitializedError

Sum = "sum"
Average = "average"
Min = "min"
Max = "max"
Product = "prod"
BitwiseAnd = "band"     # integer and bool tensors only
BitwiseOr = "bor"
BitwiseXor = "bxor"
Adasum = "adasum"

log = logging.getLogger("lightcc")
_lock = threading.RLock()
_engine: Engine | None = None


class ProcessSet:
    """A subset of ranks that runs collectives on its own (Horovod's ``ProcessSet``).

    Create it with the member ranks, then register it on every rank with
    :func:`add_process_set` (or pass it to ``init(process_sets=[...])``).
    """

    def __init__(self, ranks: Sequence[int] | None = None) -> None:
        self.ranks: list[int] | None = None if ranks is None else sorted(int(r) for r in ranks)
        self.process_set_id: int | None = None
        self.removed_because = ""     # why it is no longer added (set by elastic resets)

    def not_added(self) -> InvalidArgumentError:
        """The error for using this set while it is not added (says why, when known)."""
        return InvalidArgumentError(self.removed_because or "this ProcessSet has not been "
                                    "added; call add_process_set() on every rank first")

    def _require(self) -> tuple[Engine, int]:
        eng = _get()
        if self.process_set_id is None:
            raise self.not_added()
        return eng, self.process_set_id

    def size(self) -> int:
        eng, pid = self._require()
        return len(eng.pset(pid).ranks)

    def rank(self) -> int:
        """This process's rank within the set (-1 when not a member)."""
        eng, pid = self._require()
        idx = eng.pset(pid).index(eng.rank)
        return -1 if idx is None else idx

    def included(self) -> bool:
        eng, pid = self._require()
        return eng.rank in eng.pset(pid).ranks

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet()
global_process_set.process_set_id = 0


_added_sets: list["ProcessSet"] = []      # added since init(); unusable after shutdown()


def is_initialized() -> bool:
    return _engine is not None


def _get() -> Engine:
    eng = _engine
    if eng is None:
        raise NotInitializedError("lightcc is not initialized: call lightcc.init() first "
                                  "(or it was shut down)")
    return eng


def engine() -> Engine:
    """The running engine (for the torch layer, the timeline and the autotuner)."""
    return _get()


def config() -> config_mod.Config:
    return _get().config


def rank() -> int:
    return _get().rank


def size() -> int:
    return _get().size


def local_rank() -> int:
    return _get().topo.local_rank


def local_size() -> int:
    return _get().topo.local_size


def cross_rank() -> int:
    return _get().topo.cross_rank


def cross_size() -> int:
    return _get().topo.cross_size


def is_homogeneous() -> bool:
    return _get().topo.is_homogeneous


def stats() -> dict[str, Any]:
    """Wire bytes and call counts per communicator, plus totals, since ``init()``."""
    eng = _get()
    comms = {"world": eng.topo.world, "local": eng.topo.local, "cross": eng.topo.cross}
    for pid, group in eng.groups.items():
        if pid and group.topo is not None:
            comms[f"pset{pid}"] = group.topo.world
        if group.device is not None:       # NCCL communicators count their own bytes
            for c in group.device.comms():
                if all(c.stats is not h.stats for h in comms.values()):
                    comms[f"{'' if not pid else f'pset{pid}.'}device.{c.name}"] = c
    out: dict[str, Any] = {name: c.stats.snapshot() for name, c in comms.items()}
    out["bytes_sent"] = sum(v["bytes_sent"] for v in out.values())
    out["bytes_received"] = sum(v["bytes_received"] for k, v in out.items()
                                if isinstance(v, dict))
    return out


def metrics() -> dict[str, Any]:
    """Counters and recent rates since ``init()`` (collectives, buckets, fused buckets, bytes
    per communicator, compression ratio, queue/negotiation/execute seconds, stalls), cheap
    enough to call every step; docs/timeline.md, "Metrics"."""
    from ..observability import metrics as _metrics

    return _metrics.collect(_get(), stats())
