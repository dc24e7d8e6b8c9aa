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
_mesh: list = [None]          # the MPI-free world's first communicator (owns the links)


# ---- lifecycle ------------------------------------------------------------------------------
def init(comm: Any = None, process_sets: Sequence[ProcessSet] | None = None, *,
         store: Any = None, rank: int | None = None, world_size: int | None = None,
         **overrides: Any) -> None:
    """Start lightcc on this process (collective over the job's ranks).

    Under mpirun/lccrun the job is ``comm`` (default MPI.COMM_WORLD); under torchrun, srun and
    whatever sets torchrun's variables, it is every rank of ``WORLD_SIZE``, found through the
    rendezvous store, with no MPI at all (``LCC_TRANSPORT``, :mod:`..backends.launch`).
    ``store`` (with ``rank`` and ``world_size``): a torch.distributed store to rendezvous
    through instead (the c10d backend passes the one ``init_process_group`` made).
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
        from ..backends import launch

        transport, why = launch.choose_transport(cfg.transport, comm is not None,
                                                 store is not None)
        if transport == "mpi":
            base, hostnames = _mpi_bootstrap(cfg, comm)
        else:
            base, hostnames = _tcp_bootstrap(cfg, store, rank, world_size)
            # the direct path calls MPI from the user's thread; over TCP every call goes
            # through the engine
            cfg = cfg.replace(direct_bytes=0)
        eng = state._engine = Engine(cfg, base, hostnames)
        from ..kernels import _threads

        _threads.configure(cfg.codec_threads, hostnames.count(hostnames[eng.rank]))
        _install_rank_prefix(eng.rank)
        if eng.rank == 0:
            log.info("transport: %s (%s)", "MPI" if transport == "mpi" else
                     "MPI-free: rendezvous store + lightcc's TCP links", why)
        exit_hook.install(eng.size)
        if transport == "mpi":
            mca.warn_if_too_late(cfg.num_links, eng.topo.num_nodes, eng.rank)
        _start_extras(eng, cfg)
        global_process_set.ranks = list(range(eng.size))
        if not _atexit_registered:
            atexit.register(shutdown)
            _atexit_registered = True
    for ps in process_sets or ():
        add_process_set(ps)


def _mpi_bootstrap(cfg: config_mod.Config, comm: Any) -> tuple[Any, list[str]]:
    """The MPI world (or ``comm``) and every rank's host name."""
    mca.apply(cfg.num_links, cfg.mpi_idle_sleep_us)
    from ..backends import mpi

    if comm is None:      # a process an elastic job started to grow: join the survivors
        from ..backends import ulfm

        comm = ulfm.join_parent()
    return mpi.bootstrap(comm)


def _tcp_bootstrap(cfg: config_mod.Config, store: Any, rank: int | None,
                   size: int | None) -> tuple[Any, list[str]]:
    """The MPI-free world: a rendezvous through ``store`` (or the launcher's, opened here),
    then lightcc's TCP links between every pair of ranks. Imports neither mpi4py nor torch
    (torch's store when torch is installed)."""
    from ..backends import kvstore, launch, rendezvous
    from ..backends.tcpcomm import TCPCommunicator

    timeout = cfg.rendezvous_timeout
    if store is None:
        where = launch.from_environment()
        rank, size = where.rank, where.size
        address = f"{where.master_addr}:{where.master_port} ({where.source})"
        store = kvstore.open_store(where.master_addr, where.master_port, rank, size, timeout)
    else:
        if rank is None or size is None:
            where = launch.from_environment()
            rank, size = where.rank, where.size
        address = "the store init_process_group made"
    links, hostnames, _ = rendezvous.connect(store, int(rank), int(size), timeout,
                                             cfg.control_addr, address)
    base = TCPCommunicator(links, range(int(size)), "base")
    base.owns_mesh = True
    # rank 0 serves the store: it must outlive the slowest rank's rendezvous
    base.store = store
    _mesh[0] = base
    return base, hostnames


def transport() -> str:
    """``"mpi"`` or ``"tcp"``: what this runtime runs on (needs ``init()``)."""
    _get()
    return "mpi" if _mesh[0] is None else "tcp"


def p2p_communicator(world_ranks: Sequence[int] | None, member: bool = True) -> Any:
    """MPI-free runtime: a communicator of ``world_ranks`` (None: all) for point-to-point
    traffic beside the engine's, on the job's TCP links with tags of its own (collective over
    *all* ranks; non-members pass ``member=False`` and get None). Under MPI: None (the caller
    makes an MPI communicator)."""
    mesh = _mesh[0]
    if mesh is None:
        return None
    members = set(range(mesh.size) if world_ranks is None else world_ranks)
    sub = mesh.split(0 if member and mesh.rank in members else 1, mesh.rank, "c10d.p2p")
    if not (member and mesh.rank in members):
        return None
    return sub


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
    mesh, _mesh[0] = _mesh[0], None
    if mesh is not None:          # the MPI-free world's TCP links, after the engine stopped
        mesh.free()


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
