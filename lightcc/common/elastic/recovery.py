"""Re-forming the group after a rank died: shrink in place with Open MPI's ULFM, then a fresh
lightcc runtime on the survivors (the ordinary ``shutdown()`` / ``init(comm=...)``), and
``run``'s retry loop around the user's training function (Horovod's ``elastic.run``).

Recovery on each survivor (docs/elastic.md): revoke every communicator of the running engine
(a peer blocked in one of them fails at once instead of waiting for the dead rank), shut the
engine down, shrink the launch world to the live ranks, check ``LCC_ELASTIC_MIN_NP``, start a
new engine on the shrunk communicator, and tell lccrun (one status record) who left. A
watchdog ends the job if this takes longer than ``LCC_ELASTIC_TIMEOUT``.
"""
from __future__ import annotations

import atexit
import functools
import json
import logging
import os
import sys
import threading
import time
from typing import Any, Callable

from .. import config as config_mod
from ... import _exit
from ..api import lifecycle, state as api_state
from ..backends import ulfm
from ..exceptions import (CollectiveError, LightCCError, MismatchError, ShutdownError,
                          StallError)
from .state import HostsUpdatedInterrupt, State

log = logging.getLogger("lightcc")

STATUS_DIR_ENV = _exit.STATUS_DIR_ENV       # lccrun's status directory


class ElasticError(LightCCError):
    """The group could not be re-formed (too few ranks left, or no fault tolerance)."""


class _Membership:
    """The communicator the running engine was built on, and the history of changes."""

    def __init__(self) -> None:
        self.comm: Any = None            # mpi4py communicator of the current group
        self.launch_ranks: list[int] = []    # launch rank of each current rank
        self.changes = 0
        self.exit_hooked = False


_members = _Membership()


def is_peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` says another rank died or left (what ``run`` recovers from): lightcc's
    lost-rank errors, or MPI's ``MPI_ERR_PROC_FAILED``/``MPI_ERR_REVOKED`` anywhere in its
    causes. A mismatch or a stall is a bug in the program, not a lost rank: re-raised."""
    if isinstance(exc, (MismatchError, StallError)):
        return False
    if isinstance(exc, ShutdownError) or _exit.is_consequence(exc):
        return True
    if ulfm.is_process_failure(exc):
        return True
    return isinstance(exc, CollectiveError) and ulfm.is_process_failure(exc.__cause__)


def _current() -> Any:
    """The group's communicator (the launch world until the first shrink)."""
    if _members.comm is None:
        eng = api_state.engine()
        world = ulfm.world()
        if eng.size != world.Get_size():
            raise ElasticError("elastic training needs lightcc initialized on the whole "
                               "launch world (init() without comm=)")
        _members.comm = world
        _members.launch_ranks = list(range(eng.size))
    return _members.comm


def check_ready() -> None:
    """Raise ``ElasticError`` early when a failure could not be survived (no ULFM)."""
    if api_state.size() > 1 and not (ulfm.supported() and ulfm.enabled_at_launch()):
        log.warning("elastic: Open MPI's fault tolerance is off (launch with lccrun --min-np "
                    "or mpirun --with-ft ulfm): a rank that dies will still end the job")


def _revoke_engine() -> None:
    """Revoke every communicator of the running engine (never raises)."""
    eng = api_state._engine
    if eng is None:
        return
    for group in list(getattr(eng, "groups", {}).values()):
        topo = getattr(group, "topo", None)
        for comm in ((topo.world, topo.local, topo.cross) if topo is not None else ()):
            ulfm.revoke(comm)
        direct = getattr(group, "direct", None)
        if direct is not None:
            ulfm.revoke(getattr(direct, "comm", None))


def reset() -> dict:
    """Re-form the group on the survivors (collective over them); returns what changed:
    ``{"size", "lost" (launch ranks), "seconds"}``. Raises ``ElasticError`` below
    ``LCC_ELASTIC_MIN_NP``."""
    start = time.monotonic()
    cfg = config_mod.load({})
    old = _current()
    old_launch = list(_members.launch_ranks)
    done = threading.Event()
    watchdog = threading.Thread(target=_watch, args=(done, cfg.elastic_timeout), daemon=True)
    watchdog.start()
    try:
        ulfm.revoke(old)
        _revoke_engine()
        lifecycle.shutdown()
        new = None
        while new is None:
            try:
                new = ulfm.shrink(old)
            except Exception as exc:  # noqa: BLE001 - another rank failed during the shrink
                if not ulfm.is_process_failure(exc):
                    raise
                ulfm.revoke(old)
        mine = ulfm.launch_rank()
        launch = new.allgather(mine)
        lost = sorted(set(old_launch) - set(launch))
        if new.Get_size() < cfg.elastic_min_np:
            raise ElasticError(
                f"elastic: {new.Get_size()} rank(s) left after launch rank(s) "
                f"{', '.join(map(str, lost))} failed, fewer than the minimum of "
                f"{cfg.elastic_min_np} (--min-np / LCC_ELASTIC_MIN_NP): ending the job")
        lifecycle.init(comm=new)
        _members.comm, _members.launch_ranks = new, launch
        _members.changes += 1
        _exit_without_finalize()
    finally:
        done.set()
    seconds = time.monotonic() - start
    change = {"size": len(launch), "lost": lost, "seconds": round(seconds, 3),
              "change": _members.changes}
    if api_state.rank() == 0:
        _report(change)
    return change


def _watch(done: threading.Event, timeout: float) -> None:
    if not done.wait(timeout):
        log.critical("elastic: the group was not re-formed within %.0f s "
                     "(LCC_ELASTIC_TIMEOUT / --elastic-timeout): ending the job", timeout)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        ulfm.abort(75)


def _report(change: dict) -> None:
    """One line in the log, and a record for lccrun (which prints it as one line)."""
    if change["lost"]:
        log.warning("elastic: lost launch rank(s) %s; continuing with %d ranks (re-formed in "
                    "%.2f s)", ", ".join(map(str, change["lost"])), change["size"],
                    change["seconds"])
    else:
        log.warning("elastic: group re-formed with the same %d ranks (hosts updated) in "
                    "%.2f s", change["size"], change["seconds"])
    directory = os.environ.get(STATUS_DIR_ENV)
    if not directory:
        return
    path = os.path.join(directory, f"elastic-{change['change']}.json")
    try:
        with open(path + ".tmp", "w") as f:
            json.dump({**change, "time": time.time()}, f)
        os.replace(path + ".tmp", path)
    except OSError:
        pass


def _exit_without_finalize() -> None:
    """After a shrink, end the process without ``MPI_Finalize``: with a dead peer, Open MPI
    5.0's finalize fence hung in 3 of 6 runs here (docs/elastic.md). Registered once; runs
    before mpi4py's finalize (Python's atexit handlers come first)."""
    if _members.exit_hooked:
        return
    _members.exit_hooked = True

    def leave() -> None:
        try:
            lifecycle.shutdown()
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:  # noqa: BLE001 - a closed stream must not block the exit
                    pass
            os._exit(0)

    atexit.register(leave)


def run_fn(func: Callable[..., Any], reset_fn: Callable[[], Any] = reset) -> Callable[..., Any]:
    """Horovod's ``elastic.run`` around ``reset_fn``: call ``func(state, ...)`` after
    ``state.sync()``; when a rank dies (a lost-rank error) restore the last commit, re-form
    the group, run the reset callbacks, sync from the new rank 0 and call ``func`` again;
    on ``HostsUpdatedInterrupt`` do the same without the restore."""

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        check_ready()
        skip_sync = False
        while True:
            if not skip_sync:
                state.sync()
            try:
                return func(state, *args, **kwargs)
            except HostsUpdatedInterrupt as exc:
                skip_sync = exc.skip_sync
            except Exception as exc:  # noqa: BLE001 - sorted below
                if not is_peer_failure(exc):
                    raise
                log.warning("elastic: %s: %s; restoring the last commit", type(exc).__name__,
                            str(exc)[:300])
                state.restore()
                skip_sync = False
            reset_fn()
            state.on_reset()

    return wrapper


run = run_fn
