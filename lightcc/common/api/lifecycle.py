"""Starting and stopping lightcc (``init``, ``shutdown``), the timeline and autotuner that come
with it, logging with the rank prefix, and registering process sets (collective calls that
change the runtime's sets)."""
from __future__ import annotations

import atexit
import logging
from typing import Any, Sequence

from .. import config as config_mod
from .. import mca
from ..control.messages import Coll, Request
from ..engine import Engine
from ..exceptions import InvalidArgumentError
from . import exit_hook, state
from .checks import _pset_id
from .collectives import synchronize
from .state import ProcessSet, _added_sets, _get, global_process_set

log = logging.getLogger("lightcc")
mca.apply_from_environment()      # before the script starts MPI, if it has not yet
_atexit_registered = False


# ---- lifecycle ------------------------------------------------------------------------------
def init(comm: Any = None, process_sets: Sequence[ProcessSet] | None = None,
         **overrides: Any) -> None:
    """Start lightcc on this process (collective over ``comm``, default MPI.COMM_WORLD).

    ``overrides`` take precedence over ``LCC_*`` variables, by field name
    (``init(fusion_threshold=8 << 20, algorithm="ring")``). Calling it again while initialized
    does nothing; after ``shutdown()`` it starts a fresh runtime.
    """
    global _atexit_registered
    with state._lock:
        if state._engine is not None:
            return
        cfg = config_mod.load(overrides)
        _setup_logging(cfg.log_level)
        mca.apply(cfg.num_links, cfg.mpi_idle_sleep_us)
        from ..backends import mpi

        if comm is None:      # a process an elastic job started to grow: join the survivors
            from ..backends import ulfm

            comm = ulfm.join_parent()
        base, hostnames = mpi.bootstrap(comm)
        eng = state._engine = Engine(cfg, base, hostnames)
        from ..kernels import _threads

        _threads.configure(cfg.codec_threads, hostnames.count(hostnames[eng.rank]))
        _install_rank_prefix(eng.rank)
        exit_hook.install(eng.size)
        mca.warn_if_too_late(cfg.num_links, eng.topo.num_nodes, eng.rank)
        _start_extras(eng, cfg)
        global_process_set.ranks = list(range(eng.size))
        if not _atexit_registered:
            atexit.register(shutdown)
            _atexit_registered = True
    for ps in process_sets or ():
        add_process_set(ps)


def shutdown() -> None:
    """Stop the background thread; pending collectives fail with ``ShutdownError``.

    Process sets added since ``init()`` become unusable (their ids belong to this runtime).
    """
    with state._lock:
        eng, state._engine = state._engine, None
        for ps in _added_sets:
            ps.process_set_id = None
        _added_sets.clear()
    if eng is not None:
        _stop_extras(eng)
        eng.shutdown(eng.config.shutdown_timeout)


def _start_extras(eng: Engine, cfg: config_mod.Config) -> None:
    """Timeline (``LCC_TIMELINE``) and autotuner (``LCC_AUTOTUNE``), right after the engine."""
    from ..observability import metrics

    metrics.attach(eng)          # lightcc.metrics() counts from init() on
    from ..observability import reporter

    reporter.start(eng.rank, lambda: metrics.collect(eng, state.stats()))   # lccrun --status
    if cfg.timeline:
        from ..observability import timeline

        try:
            timeline.start(eng, cfg.timeline, mark_cycles=True,
                           all_ranks=bool(getattr(cfg, "timeline_all_ranks", False)))
        except OSError as exc:   # a bad path must not leave the other ranks waiting
            log.error("LCC_TIMELINE=%s: cannot write the timeline: %s", cfg.timeline, exc)
    if cfg.autotune != "0":
        from ..tuning import autotune

        autotune.start(eng, cfg)


def _stop_extras(eng: Engine) -> None:
    from ..observability import timeline
    from ..tuning import autotune

    autotune.stop(eng)
    timeline.stop(eng)


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start writing a Chrome/Perfetto trace to ``file_path`` (Horovod's name and arguments).

    Rank 0 writes ``file_path``; other ranks write ``file_path.rank<N>`` only when
    ``LCC_TIMELINE_ALL_RANKS=1``. ``mark_cycles`` adds a marker per engine cycle.
    """
    from ..observability import timeline

    eng = _get()
    timeline.start(eng, str(file_path), mark_cycles=mark_cycles,
                   all_ranks=bool(getattr(eng.config, "timeline_all_ranks", False)))


def stop_timeline() -> None:
    """Stop the timeline started by :func:`start_timeline` (or ``LCC_TIMELINE``), close it."""
    from ..observability import timeline

    timeline.stop(_get())


# ---- helpers --------------------------------------------------------------------------------
def _setup_logging(level: str) -> None:
    mapping = {"trace": logging.DEBUG, "debug": logging.DEBUG, "info": logging.INFO,
               "warning": logging.WARNING, "error": logging.ERROR, "fatal": logging.CRITICAL}
    log.setLevel(mapping[level])
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[lightcc %(rank)s] %(levelname)s: %(message)s"))
        log.addHandler(handler)
        log.propagate = False


class _RankFilter(logging.Filter):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = f"rank {self.rank}"
        return True


def _install_rank_prefix(rank_: int) -> None:
    for f in list(log.filters):
        if isinstance(f, _RankFilter):
            log.removeFilter(f)
    log.addFilter(_RankFilter(rank_))


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set (collective: every rank calls it with the same ranks)."""
    eng = _get()
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if ps.process_set_id is not None:
        raise InvalidArgumentError(f"{ps} was already added")
    ranks = tuple(ps.ranks or ())
    if not ranks or len(set(ranks)) != len(ranks) or not all(0 <= r < eng.size for r in ranks):
        raise InvalidArgumentError(f"process set ranks {list(ranks)} must be distinct ranks in "
                                   f"0..{eng.size - 1}")
    req = Request(Coll.ADD_PSET, f"add_process_set{list(ranks)}", splits=ranks)
    ps.process_set_id = int(synchronize(eng.submit(req)))
    _added_sets.append(ps)
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set (collective over all ranks). Returns True when removed."""
    eng = _get()
    pid = _pset_id(process_set)
    if pid == 0:
        raise InvalidArgumentError("the global process set cannot be removed")
    eng.pset(pid)
    synchronize(eng.submit(Request(Coll.REMOVE_PSET, f"remove_process_set.{pid}", root=pid)))
    if isinstance(process_set, ProcessSet):
        process_set.process_set_id = None
        if process_set in _added_sets:
            _added_sets.remove(process_set)
    return True
