"""lccrun's side of elastic host changes: publish the host list to the ranks and follow the
``--host-discovery-script`` while the job runs (docs/elastic.md).

At launch the list is ``-H``/``--hostfile``/the script's hosts, or this machine with
``max(-np, --max-np)`` slots. Every ``--host-discovery-period`` seconds the script runs again;
a different list gets the next version number in ``hosts.json`` (``lightcc.common.elastic
.hosts``), and every rank raises ``HostsUpdatedInterrupt`` at its next commit. A script that
fails or prints nothing leaves the list as it was (one warning).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

from ..common.elastic import hosts as hosts_file
from ..common.exceptions import ConfigError
from .hosts import Host, parse_host_list


class Discovery:
    """The published host list and the polling of the discovery script."""

    def __init__(self, directory: str, initial: list[Host], script: str | None = None,
                 period: float = 1.0, default_slots: int = 1) -> None:
        self.directory, self.script, self.period = directory, script, period
        self.default_slots = default_slots
        self.current = [(h.name, h.slots) for h in initial]
        self.version = 1
        self.next_poll = time.monotonic() + period
        self.warned = False
        hosts_file.write(directory, self.version, self.current)

    def poll(self, now: float | None = None) -> list[str]:
        """Run the script when due; returns lccrun's lines about a change (none if same)."""
        now = time.monotonic() if now is None else now
        if self.script is None or now < self.next_poll:
            return []
        self.next_poll = now + self.period
        found = self._run()
        if found is None or found == self.current:
            return []
        old, self.current = self.current, found
        self.version += 1
        hosts_file.write(self.directory, self.version, found)
        return [f"lccrun: elastic: hosts changed ({describe(old, found)}); the ranks re-form "
                f"the group at their next commit"]

    def _run(self) -> list[tuple[str, int]] | None:
        try:
            out = subprocess.run([self.script], capture_output=True, text=True, timeout=30)
            lines = [ln.strip() for ln in out.stdout.splitlines() if ln.strip()]
            if out.returncode != 0 or not lines:
                raise ConfigError(f"exited with code {out.returncode}, printed "
                                  f"{len(lines)} host(s)")
            return [(h.name, h.slots)
                    for h in parse_host_list(",".join(lines), self.default_slots)]
        except (OSError, subprocess.TimeoutExpired, ConfigError) as exc:
            if not self.warned:
                self.warned = True
                print(f"lccrun: warning: --host-discovery-script: {exc}; keeping the last "
                      f"host list", file=sys.stderr, flush=True)
            return None


def describe(old: list[tuple[str, int]], new: list[tuple[str, int]]) -> str:
    """``+b:2, -a, c 1->2 slots`` for the change from ``old`` to ``new``."""
    was, now = dict(old), dict(new)
    parts = [f"+{h}:{s}" for h, s in new if h not in was]
    parts += [f"-{h}" for h, _ in old if h not in now]
    parts += [f"{h} {was[h]}->{s} slots" for h, s in new if h in was and was[h] != s]
    return ", ".join(parts)


def discover_hosts(script: str, timeout: float = 60.0, default_slots: int = 1) -> list[Host]:
    """Hosts from a Horovod discovery script: one ``host:slots`` (or ``host``) per line."""
    path = os.path.abspath(script)
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise ConfigError(f"--host-discovery-script {script!r}: not an executable file")
    try:
        out = subprocess.run([path], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError(f"--host-discovery-script {script!r}: {exc}") from None
    if out.returncode != 0:
        raise ConfigError(f"--host-discovery-script {script!r} exited with code "
                         f"{out.returncode}: {out.stderr.strip()[:200]}")
    lines = [ln.strip() for ln in out.stdout.splitlines() if ln.strip()]
    if not lines:
        raise ConfigError(f"--host-discovery-script {script!r} printed no host")
    return parse_host_list(",".join(lines), default_slots)
