"""Changing who is in the group at a reset beyond the shrink (docs/elastic.md): ranks on hosts
that left lccrun's host list leave, and new processes start on listed hosts with free slots
(``MPI_Comm_spawn`` through PRRTE, then ``MPI_Intercomm_merge``) until the group has
``LCC_ELASTIC_MAX_NP`` ranks. A new process joins in ``init()`` (``ulfm.join_parent``) and
gets the training state from the survivors' ``state.sync()``.
"""
from __future__ import annotations

import logging
import socket
import sys
from typing import Any

from ..backends import ulfm
from . import hosts

log = logging.getLogger("lightcc")


def agree_hosts(comm: Any, directory: str | None) -> hosts.HostList:
    """The newest host list any member can read (collective over ``comm``)."""
    seen = comm.allgather(hosts.read(directory))
    return max(seen, key=lambda h: h.version)


def hostnames(comm: Any) -> list[str]:
    """Every member's host name, in rank order (collective)."""
    return comm.allgather(socket.gethostname())


def stays(listed: hosts.HostList, names: list[str]) -> list[bool]:
    """Which members (host names ``names``, in rank order) stay: those on a listed host, the
    first ``slots`` of each host in rank order (a host whose slot count went down keeps
    that many; the members beyond it leave). With no list published, everybody stays."""
    if listed.version == 0:
        return [True] * len(names)
    slots = dict(listed.hosts)
    used: dict[str, int] = {}
    out = []
    for name in names:
        host = listed.owner(name)
        if host is None:
            out.append(False)
            continue
        used[host] = used.get(host, 0) + 1
        out.append(used[host] <= slots[host])
    return out


def without_removed(comm: Any, listed: hosts.HostList, names: list[str]) -> tuple[Any, bool]:
    """``comm`` without the members whose host is no longer listed or is over its slot count
    (:func:`stays`), and whether this process stays (collective over ``comm``)."""
    stay = stays(listed, names)
    if all(stay):
        return comm, True
    me = comm.Get_rank()
    sub = comm.Split(0 if stay[me] else ulfm.UNDEFINED(), me)
    return sub, stay[me]


class _Warned:
    vacated: set = set()      # hosts already named in the warning below


def vacated(listed: hosts.HostList, names: list[str], ran_on: list[str], say: bool
            ) -> list[str]:
    """Listed hosts where members of this group ran (host names ``ran_on``) and none runs
    now (``names``): they get no new processes (``say``: log the warning). Open MPI 5.0.11
    cannot start processes of the job on a host again once all the launch job's processes
    there have ended (the new ones fail in ``MPI_Init`` with "Not supported" from
    ``dpm.c``, and the survivors would wait in the spawn until the watchdog; measured on
    tests/netns's simulated hosts, docs/elastic.md)."""
    here = {listed.owner(n) for n in names}
    gone = sorted({h for h in map(listed.owner, ran_on) if h and h not in here})
    for host in gone:
        if say and host not in _Warned.vacated:
            _Warned.vacated.add(host)
            log.warning("elastic: host %s had ranks of this job and has none left: Open MPI "
                        "cannot start new processes of the job there (docs/elastic.md); it "
                        "gets no new ranks", host)
    return gone


def plan_growth(comm: Any, listed: hosts.HostList, target: int, names: list[str],
                excluded: list[str] = ()) -> list[tuple[str, int, int]]:
    """Rank 0's plan, on every member: ``[(host, new processes, slots), ...]`` that brings
    the group (on host ``names``) to at most ``target`` ranks on free listed slots, none on
    the ``excluded`` (blacklisted) hosts."""
    plan = (listed.free_slots(names, target, excluded)
            if listed.version and target > len(names) else [])
    return comm.bcast(plan, root=0)


def grow(comm: Any, plan: list[tuple[str, int, int]], meta: dict) -> tuple[Any, Any]:
    """Start the processes of ``plan`` running this program (collective over ``comm``);
    returns (merged communicator, survivors first; intercommunicator). The new processes
    receive ``meta`` (launch numbers, host-list version, ...) from rank 0 in
    ``ulfm.join_parent``."""
    argv = [sys.executable, *sys.orig_argv[1:]]
    # PRRTE may still count the slots of processes that died or left: declare the listed
    # slots plus every process started so far (lightcc's plan keeps the listed limit)
    started = meta["next_id"]
    inter, merged = ulfm.spawn(comm, argv, [(h, n, slots + started) for h, n, slots in plan])
    merged.bcast(meta, root=0)
    return merged, inter
