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

import functools
import json
import logging
import os
import socket
import sys
import threading
import time
from typing import Any, Callable

import numpy as np

from .. import config as config_mod
from ... import _exit
from ..api import collectives, lifecycle, state as api_state
from ..backends import ulfm
from ..exceptions import (CollectiveError, LightCCError, MismatchError, ShutdownError,
                          StallError)
from . import exiting, growth, hosts
from .state import HostsUpdatedInterrupt, State

log = logging.getLogger("lightcc")

STATUS_DIR_ENV = _exit.STATUS_DIR_ENV       # lccrun's status directory
WAIT_GRACE_S = 15.0     # the watchdog's margin past LCC_ELASTIC_TIMEOUT (for the wait's end)


class ElasticError(LightCCError):
    """The group could not be re-formed (too few ranks left, or no fault tolerance)."""


class _Membership:
    """The communicator the running engine was built on, and the history of changes."""

    def __init__(self) -> None:
        self.comm: Any = None            # mpi4py communicator of the current group
        self.launch_ranks: list[int] = []    # launch rank of each current rank
        self.changes = 0
        self.my_id = -1                  # this process's launch number (joiners: new ones)
        self.next_id = 0                 # the launch number the next joiner gets
        self.joined = False              # started by a reset to grow the group
        self.started = False             # run() read the first host list
        self.failures: dict[str, int] = {}   # listed host -> ranks lost there
        self.blacklist: list[str] = []       # hosts that get no new ranks
        self.ran_on: list[str] = []          # host names where members of the group ran


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
    _adopt_join()
    if _members.comm is None:
        eng = api_state.engine()
        world = ulfm.world()
        if eng.size != world.Get_size():
            raise ElasticError("elastic training needs lightcc initialized on the whole "
                               "launch world (init() without comm=)")
        _members.comm = world
        _members.launch_ranks = list(range(eng.size))
        _members.my_id, _members.next_id = ulfm.launch_rank(), eng.size
    return _members.comm


def launch_number() -> int:
    """This process's launch number: its rank in the job as launched, or, in a process that
    joined the group later, the number the survivors gave it (3 ranks and a replacement:
    0, 1, 3). It stays the same through resets; lccrun's lines use it."""
    _adopt_join()
    return _members.my_id if _members.my_id >= 0 else ulfm.launch_rank()


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
    watchdog = threading.Thread(target=_watch, args=(done, cfg.elastic_timeout + WAIT_GRACE_S),
                                daemon=True)
    watchdog.start()
    try:
        ulfm.revoke(old)
        _revoke_engine()
        sets = [(ps, list(ps.ranks or ())) for ps in api_state._added_sets]
        eng = api_state._engine
        host_of = dict(zip(old_launch, eng.hostnames)) if eng is not None else {}
        lifecycle.shutdown()
        new = None
        while new is None:
            try:
                new = ulfm.shrink(old)
            except Exception as exc:  # noqa: BLE001 - another rank failed during the shrink
                if not ulfm.is_process_failure(exc):
                    raise
                ulfm.revoke(old)
        exiting.end_without_finalize(new.Get_size())
        launch = new.allgather(_members.my_id)
        lost = sorted(set(old_launch) - set(launch))
        if cfg.elastic_reset_limit and _members.changes >= cfg.elastic_reset_limit:
            raise ElasticError(
                f"elastic: the group was already re-formed {_members.changes} time(s), the "
                f"limit (--reset-limit / LCC_ELASTIC_RESET_LIMIT {cfg.elastic_reset_limit}): "
                f"ending the job")
        _members.ran_on = sorted(set(_members.ran_on) | set(host_of.values()))
        new, launch, joined, inter, listed, removed, banned = _change_hosts(
            new, cfg, start, [host_of.get(r, "") for r in lost])
        if new.Get_size() < cfg.elastic_min_np:
            raise ElasticError(
                f"elastic: {new.Get_size()} rank(s) left after launch rank(s) "
                f"{', '.join(map(str, lost))} failed, fewer than the minimum of "
                f"{cfg.elastic_min_np} (--min-np / LCC_ELASTIC_MIN_NP): ending the job")
        lifecycle.init(comm=new)
        _members.comm, _members.launch_ranks = new, launch
        _members.changes += 1
        hosts.Seen.version = listed.version
        if inter is not None:
            exiting.connect(inter, joined, launch)
        exiting.Exit.members = set(launch)
        dropped = _readd_process_sets(sets, old_launch, launch, joined)
    finally:
        done.set()
    seconds = time.monotonic() - start
    change = {"size": len(launch), "lost": lost, "removed": removed, "joined": joined,
              "blacklisted": banned, "failures": cfg.elastic_blacklist_after,
              "seconds": round(seconds, 3), "change": _members.changes,
              "dropped_sets": dropped}
    _report(change, log_it=api_state.rank() == 0)   # the record: from every rank lccrun
    return change                                   # started here, wherever rank 0 runs


def _change_hosts(comm: Any, cfg: config_mod.Config, start: float, lost_on: list[str]
                  ) -> tuple[Any, list[int], list[int], Any, hosts.HostList, list[int],
                             list[str]]:
    """After the shrink: the ranks on hosts lccrun no longer lists leave (this process exits
    if it is one of them), and new processes start on free listed slots up to
    ``LCC_ELASTIC_MAX_NP``. Below ``LCC_ELASTIC_MIN_NP`` with growth allowed, wait (polling
    the host list every second) until it offers enough free slots, at most until
    ``LCC_ELASTIC_TIMEOUT`` after the reset began. Returns (communicator, launch numbers,
    launch numbers that joined, intercommunicator or None, the host list, launch numbers
    removed, hosts blacklisted now). ``lost_on``: the host names of the ranks that failed
    (``LCC_ELASTIC_BLACKLIST_AFTER`` failures on one listed host exclude it from growth)."""
    listed = growth.agree_hosts(comm, os.environ.get(STATUS_DIR_ENV))
    banned = _count_failures(listed, lost_on, cfg.elastic_blacklist_after)
    before = comm.allgather(_members.my_id)
    comm, stays = growth.without_removed(comm, listed, growth.hostnames(comm))
    if not stays:
        exiting.Exit.leaving = True
        host = listed.owner(socket.gethostname())
        log.warning("elastic: this rank's host %s is no longer in the job's host list: it "
                    "leaves the job" if host is None else "elastic: this rank's host %s has "
                    "fewer slots now than it has ranks: it leaves the job",
                    socket.gethostname())
        raise SystemExit(0)
    launch = comm.allgather(_members.my_id)
    removed = sorted(set(before) - set(launch))
    need = cfg.elastic_min_np if cfg.elastic_max_np else 0
    logged = False
    while True:
        names = growth.hostnames(comm)
        plan = growth.plan_growth(comm, listed, cfg.elastic_max_np, names,
                                  _members.blacklist + growth.vacated(
                                      listed, names, _members.ran_on, comm.Get_rank() == 0))
        offered = sum(n for _, n, _ in plan)
        if len(launch) + offered >= need:
            break
        give_up = comm.bcast(time.monotonic() - start >= cfg.elastic_timeout, root=0)
        if give_up:
            raise ElasticError(
                f"elastic: {len(launch)} rank(s) left, fewer than the minimum of {need} "
                f"(--min-np / LCC_ELASTIC_MIN_NP); waited {time.monotonic() - start:.0f} s "
                f"(--elastic-timeout) for the host list to offer {need - len(launch)} more "
                f"slot(s), it offers {offered}: ending the job")
        if not logged and comm.Get_rank() == 0:
            log.warning("elastic: %d rank(s) left, fewer than the minimum of %d: waiting up to "
                        "%.0f s for hosts", len(launch), need, cfg.elastic_timeout)
        logged = True
        time.sleep(1.0)
        listed = growth.agree_hosts(comm, os.environ.get(STATUS_DIR_ENV))
    if not plan:
        return comm, launch, [], None, listed, removed, banned
    joined = list(range(_members.next_id, _members.next_id + offered))
    _members.next_id += len(joined)
    meta = {"launch": launch + joined, "next_id": _members.next_id,
            "version": listed.version, "changes": _members.changes + 1,
            "failures": _members.failures, "blacklist": _members.blacklist,
            "ran_on": _members.ran_on}
    merged, inter = growth.grow(comm, plan, meta)
    return merged, launch + joined, joined, inter, listed, removed, banned


def _count_failures(listed: hosts.HostList, lost_on: list[str], limit: int) -> list[str]:
    """Count the failed ranks per listed host; the hosts that reach ``limit`` now are
    blacklisted (returned). Every survivor counts the same failures."""
    banned = []
    for name in lost_on:
        host = listed.owner(name) or name
        _members.failures[host] = _members.failures.get(host, 0) + 1
        if limit and _members.failures[host] >= limit and host not in _members.blacklist:
            _members.blacklist.append(host)
            banned.append(host)
    if banned:
        log.warning("elastic: host(s) %s blacklisted after %d failed rank(s): no new ranks "
                    "there", ", ".join(banned), limit)
    return banned


def _first_host_list() -> None:
    """The host list the job started with (lccrun publishes version 1 at launch): the
    newest any rank sees, so that only later changes reset the group. A process that joined
    got it from the survivors."""
    if _members.joined or _members.started:
        return
    _members.started = True
    version = hosts.published(os.environ.get(STATUS_DIR_ENV))
    if api_state.is_initialized() and api_state.size() > 1:
        version = int(collectives.allreduce(np.array([version], np.int64), op=api_state.Max)[0])
    hosts.Seen.version = max(hosts.Seen.version, version)


def _adopt_join() -> None:
    """In a process that joined a running group (``init()`` merged it with the survivors):
    take their membership record once, and at exit disconnect from them before
    ``MPI_Finalize`` (a spawned process that skips finalize is "exiting improperly" for
    prterun; one that finalizes while connected crashed in Open MPI 5.0.11)."""
    meta = ulfm.Joined.meta
    if meta is None or _members.joined:
        return
    _members.comm = ulfm.Joined.comm
    _members.launch_ranks = list(meta["launch"])
    _members.my_id = meta["launch"][ulfm.Joined.comm.Get_rank()]
    _members.next_id, _members.changes = meta["next_id"], meta["changes"]
    _members.failures, _members.blacklist = dict(meta["failures"]), list(meta["blacklist"])
    _members.ran_on = list(meta.get("ran_on", ()))
    _members.joined = True
    hosts.Seen.version = meta["version"]
    exiting.disconnect_at_exit(ulfm.Joined.inter,
                               meta["launch"][:ulfm.Joined.inter.Get_remote_size()],
                               meta["launch"])


def _readd_process_sets(sets: list[tuple[Any, list[int]]], old_launch: list[int],
                        launch: list[int], joined: list[int]) -> list[list[int]]:
    """Add again, on the new group and renumbered, the process sets whose members all
    survived (collective: every survivor had added the same sets in the same order); a set
    that lost a member stays removed (its ``process_set_id`` is None, and it says why).
    Returns the old ranks of the sets dropped."""
    where = {rank: i for i, rank in enumerate(launch)}
    dropped = []
    for ps, ranks in sets:
        members = [old_launch[r] for r in ranks]
        if joined:
            dropped.append(ranks)
            ps.removed_because = (f"process set {ranks} was removed when the elastic group "
                                  f"was re-formed: launch rank(s) "
                                  f"{', '.join(map(str, joined))} joined; add a new one in a "
                                  f"reset callback")
            log.warning("elastic: %s", ps.removed_because)
        elif all(m in where for m in members):
            ps.ranks = sorted(where[m] for m in members)
            lifecycle.add_process_set(ps)
        else:
            dropped.append(ranks)
            gone = ", ".join(str(m) for m in members if m not in where)
            ps.removed_because = (f"process set {ranks} was removed when the elastic group "
                                  f"was re-formed: it lost launch rank(s) {gone}; add a new "
                                  f"one in a reset callback")
            log.warning("elastic: %s", ps.removed_because)
    return dropped


def _watch(done: threading.Event, timeout: float) -> None:
    if not done.wait(timeout):
        log.critical("elastic: the group was not re-formed within %.0f s "
                     "(LCC_ELASTIC_TIMEOUT / --elastic-timeout): ending the job", timeout)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        ulfm.abort(75)


def _report(change: dict, log_it: bool = True) -> None:
    """One line in the log (``log_it``: rank 0), and a record for lccrun, which prints it as
    one line: written by every rank that has lccrun's status directory (its local ranks),
    so the line comes whichever host the new rank 0 runs on (same content, one file)."""
    what = [f"{verb} launch rank(s) {', '.join(map(str, change[key]))}"
            for key, verb in (("lost", "lost"), ("removed", "removed (host left)"),
                              ("joined", "joined")) if change.get(key)]
    if what and log_it:
        log.warning("elastic: %s; continuing with %d ranks (re-formed in %.2f s)",
                    ", ".join(what), change["size"], change["seconds"])
    elif log_it:
        log.warning("elastic: group re-formed with the same %d ranks (hosts updated) in "
                    "%.2f s", change["size"], change["seconds"])
    directory = os.environ.get(STATUS_DIR_ENV)
    if not directory:
        return
    path = os.path.join(directory, f"elastic-{change['change']}.json")
    try:
        tmp = f"{path}.{os.getpid()}.tmp"     # several local ranks write the same record
        with open(tmp, "w") as f:
            json.dump({**change, "time": time.time()}, f)
        os.replace(tmp, path)
    except OSError:
        pass


def run_fn(func: Callable[..., Any], reset_fn: Callable[[], Any] = reset) -> Callable[..., Any]:
    """Horovod's ``elastic.run`` around ``reset_fn``: call ``func(state, ...)`` after
    ``state.sync()``; when a rank dies (a lost-rank error) restore the last commit, re-form
    the group, run the reset callbacks, sync from the new rank 0 and call ``func`` again;
    on ``HostsUpdatedInterrupt`` do the same without the restore."""

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        check_ready()
        _adopt_join()
        _first_host_list()
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
