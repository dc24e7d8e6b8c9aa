"""Host lists for multi-host runs: ``-H a:2,b:4`` and hostfiles with ``host slots=N`` lines.

Both forms parse to a list of :class:`Host` (name and slot count, in order). Malformed input
raises :class:`~lightcc.common.exceptions.ConfigError` with a one-line message naming the bad
entry, so ``lccrun`` can refuse it before launching anything.
"""
from __future__ import annotations

import re
import socket
from dataclasses import dataclass
from pathlib import Path

from ..common.exceptions import ConfigError

# Host names and IPv4 addresses (``:`` separates the slot count, so no IPv6 literals).
_HOST_RE = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9._-]*[A-Za-z0-9_])?$")
_LOCAL_NAMES = {"localhost", "127.0.0.1", "::1"}


@dataclass(frozen=True)
class Host:
    """One host of the job and how many ranks (slots) it runs."""

    name: str
    slots: int

    def spec(self) -> str:
        """``name:slots`` as Open MPI's ``-H`` option expects it."""
        return f"{self.name}:{self.slots}"


def _check_name(name: str, where: str) -> str:
    if not _HOST_RE.match(name):
        raise ConfigError(f"{where}: {name!r} is not a valid host name")
    return name


def _check_slots(text: str, where: str) -> int:
    try:
        slots = int(text)
    except ValueError:
        raise ConfigError(f"{where}: slots {text!r} is not an integer") from None
    if slots < 1:
        raise ConfigError(f"{where}: slots must be >= 1, got {slots}")
    return slots


def _no_duplicates(hosts: list[Host], where: str) -> list[Host]:
    seen: set[str] = set()
    for host in hosts:
        if host.name in seen:
            raise ConfigError(f"{where}: host {host.name!r} is listed more than once")
        seen.add(host.name)
    return hosts


def parse_host_list(text: str, default_slots: int = 1) -> list[Host]:
    """Parse ``-H host1:slots,host2:slots`` (``:slots`` optional, default ``default_slots``)."""
    where = f"-H {text!r}"
    if not text or not text.strip():
        raise ConfigError(f"{where}: empty host list")
    hosts = []
    for entry in text.split(","):
        entry = entry.strip()
        if not entry:
            raise ConfigError(f"{where}: empty entry (stray comma?)")
        name, sep, slots = entry.partition(":")
        if sep and ":" in slots:
            raise ConfigError(f"{where}: {entry!r} has more than one ':'")
        hosts.append(Host(_check_name(name, where),
                          _check_slots(slots, where) if sep else default_slots))
    return _no_duplicates(hosts, where)


def parse_hostfile_text(text: str, source: str = "hostfile",
                        default_slots: int = 1) -> list[Host]:
    """Parse hostfile lines ``host [slots=N] [max_slots=M]``; ``#`` starts a comment."""
    hosts = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source} line {number}"
        name, *fields = line.split()
        slots = default_slots
        for field in fields:
            key, sep, value = field.partition("=")
            if not sep:
                raise ConfigError(f"{where}: expected 'host slots=N', got {line!r}")
            if key == "slots":
                slots = _check_slots(value, where)
            elif key == "max_slots":
                _check_slots(value, where)
            else:
                raise ConfigError(f"{where}: unknown field {key!r} (known: slots, max_slots)")
        hosts.append(Host(_check_name(name, where), slots))
    if not hosts:
        raise ConfigError(f"{source}: no hosts listed")
    return _no_duplicates(hosts, source)


def parse_hostfile(path: str | Path, default_slots: int = 1) -> list[Host]:
    """Read and parse a hostfile; a missing or unreadable file is a ConfigError."""
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise ConfigError(f"--hostfile {str(path)!r}: no such file") from None
    except OSError as exc:
        raise ConfigError(f"--hostfile {str(path)!r}: cannot read ({exc.strerror})") from None
    return parse_hostfile_text(text, source=f"hostfile {str(path)!r}",
                               default_slots=default_slots)


def total_slots(hosts: list[Host]) -> int:
    return sum(h.slots for h in hosts)


def is_local(name: str) -> bool:
    """Whether ``name`` refers to the machine lccrun runs on."""
    if name in _LOCAL_NAMES:
        return True
    try:
        here = {socket.gethostname(), socket.getfqdn()}
    except OSError:  # pragma: no cover - broken resolver
        return False
    return name in here or name.split(".")[0] in {h.split(".")[0] for h in here}


def distinct_machines(hosts: list[Host]) -> int:
    """Number of different machines, counting every local alias as one."""
    names = {("<local>" if is_local(h.name) else h.name) for h in hosts}
    return len(names)
