"""The job's host list as lccrun publishes it to the ranks of an elastic job (docs/elastic.md).

lccrun writes ``hosts.json`` into its status directory (``LCC_RUNNER_STATUS_DIR``) at launch and
whenever the ``--host-discovery-script`` prints a different list: a version number (1, 2, ...),
the hosts with their slots, and the name of lccrun's own machine. Ranks read it at each
``commit()`` (one ``stat``), and the reset after a change uses it to decide which ranks leave
and how many new ones start where. No MPI here.
"""
from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass

FILE = "hosts.json"
_LOCAL = {"localhost", "127.0.0.1", "::1"}


@dataclass(frozen=True)
class HostList:
    """One published host list: ``hosts`` is ``[(name, slots), ...]`` in order."""

    version: int = 0
    hosts: tuple[tuple[str, int], ...] = ()
    launcher: str = ""             # lccrun's host name: where "localhost" entries are

    def owner(self, hostname: str) -> str | None:
        """The listed host a process on ``hostname`` belongs to (None: not listed)."""
        short = hostname.split(".")[0]
        for name, _ in self.hosts:
            if name in (hostname, short) or name.split(".")[0] == short:
                return name
            if name in _LOCAL and self.launcher and short == self.launcher.split(".")[0]:
                return name
        return None

    def free_slots(self, hostnames: list[str], target: int,
                   excluded: "list[str] | tuple" = ()) -> list[tuple[str, int, int]]:
        """Where to start new processes so that the group (running on ``hostnames``) grows to
        at most ``target``: ``[(host, new processes, its slots), ...]``, hosts in list order
        (not the ``excluded`` ones), each filled up to its slots."""
        used: dict[str, int] = {}
        for h in hostnames:
            owner = self.owner(h)
            if owner is not None:
                used[owner] = used.get(owner, 0) + 1
        want = target - len(hostnames)
        plan = []
        for name, slots in self.hosts:
            if want <= 0:
                break
            if name in excluded:
                continue
            free = min(slots - used.get(name, 0), want)
            if free > 0:
                plan.append((name, free, slots))
                want -= free
        return plan


def read(directory: str | None) -> HostList:
    """The last list lccrun published in ``directory`` (an empty one, version 0, if none)."""
    if not directory:
        return HostList()
    try:
        with open(os.path.join(directory, FILE)) as f:
            rec = json.load(f)
        return HostList(int(rec["version"]), tuple((str(h), int(s)) for h, s in rec["hosts"]),
                        str(rec.get("launcher", "")))
    except (OSError, ValueError, KeyError, TypeError):
        return HostList()


def write(directory: str, version: int, hosts: list[tuple[str, int]]) -> None:
    """Publish a host list (atomically: ranks never read half a file)."""
    path = os.path.join(directory, FILE)
    with open(path + ".tmp", "w") as f:
        json.dump({"version": version, "hosts": [list(h) for h in hosts],
                   "launcher": socket.gethostname()}, f)
    os.replace(path + ".tmp", path)


class Seen:
    """The version of the host list the current group was formed with (set at each reset and
    when a process joins; 0 before any)."""

    version = 0


def published(directory: str | None) -> int:
    """The version lccrun last published (0: none, or not visible from this host)."""
    return read(directory).version if directory else 0
