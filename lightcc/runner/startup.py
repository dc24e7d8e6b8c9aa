"""Start-up progress: which ranks are up, which host lccrun still waits for, ``--start-timeout``.

lccrun listens on a TCP port of its own (:class:`Registry`); every rank's wrapper
(:mod:`~lightcc.runner._rankwrap`) connects once when its process starts and sends
``<token> <rank> <host> <pid>``. Until every rank has come, lccrun prints a line every
``PROGRESS_INTERVAL_S`` seconds naming what is missing, by the host each rank was placed on
(``--map-by slot``: the hosts' slots in order)::

    lccrun: 6/8 ranks up after 10 s; waiting for node3 (ranks 6, 7)

When no rank of a remote host is up, lccrun asks the launch agent (``ssh`` with lccrun's port
and key, or the ``plm_ssh_agent`` given in ``--mpi-args``) to run ``true`` there, so a host
that does not answer is named as such. Past ``--start-timeout`` the job ends with that line as
the error. A connection without the job's token is dropped.
"""
from __future__ import annotations

import json
import os
import secrets
import shlex
import signal
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from ._rankwrap import ADDR_ENV, TOKEN_ENV
from .diagnosis import ranks_text
from .hosts import Host, is_local

PROGRESS_INTERVAL_S = 5.0        # seconds between progress lines while ranks are missing
PROBE_TIMEOUT_S = 10.0           # a host whose agent has not run ``true`` by then: no answer
START_TIMEOUT_EXIT = 124         # lccrun's exit code when --start-timeout expires


def layout(hosts: list[Host] | None, np_: int, mapped_by_user: bool = False) -> dict[int, str]:
    """Rank -> host name under ``--map-by slot`` (every rank on ``localhost`` without hosts;
    ``""``, unknown, when the user's ``--mpi-args`` choose another mapping)."""
    if mapped_by_user:
        return {rank: "" for rank in range(np_)}
    if not hosts:
        return {rank: "localhost" for rank in range(np_)}
    out: dict[int, str] = {}
    for host in hosts:
        for _ in range(host.slots):
            if len(out) == np_:
                return out
            out[len(out)] = host.name
    return out


def progress_line(up: set[int], placed: dict[int, str], elapsed: float,
                  silent: set[str] = frozenset()) -> str:
    """``6/8 ranks up after 10 s; waiting for node3 (ranks 6, 7)`` (without ``lccrun: ``);
    hosts in ``silent`` did not answer the launch agent, which the line says."""
    missing: dict[str, list[int]] = {}
    for rank, host in sorted(placed.items()):
        if rank not in up:
            missing.setdefault(host, []).append(rank)
    text = f"{len(up & placed.keys())}/{len(placed)} ranks up after {elapsed:.0f} s"
    if not missing:
        return text
    if "" in missing:                  # placement unknown (--map-by in --mpi-args)
        return f"{text}; waiting for {ranks_text(missing[''])}"
    text += "; waiting for " + ", ".join(f"{h} ({ranks_text(r)})" for h, r in missing.items())
    dead = sorted(h for h in missing if h in silent)
    if dead:
        text += (f"; {', '.join(dead)} {'does' if len(dead) == 1 else 'do'} not answer the "
                 f"launch agent (ssh), and Open MPI starts no rank until every host's daemon "
                 f"is up")
    return text


def agent_command(mpi_args: list[str], ssh_port: int | None,
                  ssh_identity_file: str | None) -> list[str]:
    """How Open MPI reaches a remote host: ``--prtemca plm_ssh_agent X`` from ``--mpi-args``,
    else ``ssh`` with lccrun's port and key (non-interactive)."""
    for i, word in enumerate(mpi_args[:-2]):
        if word in ("--prtemca", "--mca") and mpi_args[i + 1] in ("plm_ssh_agent",
                                                                  "plm_rsh_agent"):
            return shlex.split(mpi_args[i + 2])
    cmd = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={int(PROBE_TIMEOUT_S)}"]
    if ssh_port is not None:
        cmd += ["-p", str(ssh_port)]
    if ssh_identity_file is not None:
        cmd += ["-i", ssh_identity_file]
    return cmd


def answers(agent: list[str], host: str, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """Whether ``agent host true`` succeeds within ``timeout`` seconds."""
    try:
        proc = subprocess.Popen([*agent, host, "true"], stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
    except OSError:
        return False
    try:
        return proc.wait(timeout=timeout) == 0
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        proc.wait()
        return False


class Registry:
    """The TCP port the rank wrappers report to; :attr:`up` maps rank -> (host, pid)."""

    def __init__(self, addresses: list[str]) -> None:
        self.token = secrets.token_hex(16)
        self.up: dict[int, tuple[str, int]] = {}
        self.status: dict[int, tuple[float, dict]] = {}
        self.strangers = 0
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("0.0.0.0", 0))
        self._sock.listen(128)
        self.port = int(self._sock.getsockname()[1])
        self.addresses = addresses
        self._closed = False
        self._thread = threading.Thread(target=self._serve, daemon=True,
                                        name="lccrun-registry")
        self._thread.start()

    def env(self) -> dict[str, str]:
        return {ADDR_ENV: f"{','.join(self.addresses)}:{self.port}", TOKEN_ENV: self.token}

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(2.0)
                try:
                    text = _read_all(conn).decode(errors="replace")
                except OSError:
                    continue
                self._take(text)

    def _take(self, text: str) -> None:
        """One report: ``<token> <rank> <host> <pid>`` (started) or ``status <token> <rank>
        <json>`` (``--status``); anything else, or a wrong token, is dropped."""
        if text.startswith("status "):
            parts = text.split(" ", 3)
            if len(parts) == 4 and parts[1] == self.token and parts[2].isdigit():
                try:
                    report = json.loads(parts[3])
                except ValueError:
                    report = None
                if isinstance(report, dict):
                    with self._lock:
                        self.status[int(parts[2])] = (time.monotonic(), report)
                    return
            self.strangers += 1
            return
        data = text.split()
        if len(data) != 4 or data[0] != self.token or not data[1].isdigit() \
                or not data[3].isdigit():
            self.strangers += 1   # not one of this job's ranks: dropped
            return
        with self._lock:
            self.up.setdefault(int(data[1]), (data[2], int(data[3])))

    def reports(self) -> dict[int, tuple[float, dict]]:
        """rank -> (when received, its latest ``--status`` report)."""
        with self._lock:
            return dict(self.status)

    def ranks_up(self) -> set[int]:
        with self._lock:
            return set(self.up)

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.close()
        except OSError:
            pass


def _read_all(conn: socket.socket, limit: int = 65536) -> bytes:
    """What the peer sent until it closed (at most ``limit`` bytes)."""
    chunks, size = [], 0
    while size < limit:
        chunk = conn.recv(limit - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


class StartWatch:
    """Decides when to print a progress line and when ``--start-timeout`` has expired."""

    def __init__(self, registry: Registry, placed: dict[int, str], timeout: float | None,
                 agent: list[str] | None = None, interval: float = PROGRESS_INTERVAL_S,
                 now: float | None = None) -> None:
        self.registry, self.placed, self.timeout = registry, placed, timeout
        self.agent, self.interval = agent, interval
        self.started = time.monotonic() if now is None else now
        self.next_line = self.started + interval
        self.done = False
        self.printed = False
        self.silent: set[str] = set()
        self._probe = None
        self._probed: set[str] = set()

    def poll(self, now: float | None = None) -> tuple[list[str], str | None]:
        """(progress lines to print, the error line if the start timeout expired)."""
        if self.done:
            return [], None
        now = time.monotonic() if now is None else now
        up = self.registry.ranks_up()
        elapsed = now - self.started
        if up >= self.placed.keys():
            self.done = True
            return ([f"lccrun: all {len(self.placed)} ranks up after {elapsed:.0f} s"]
                    if self.printed else []), None
        if now >= self.next_line or (self.timeout is not None and elapsed >= self.timeout / 2):
            self._maybe_probe(up, self._probe_budget(elapsed))
        if self.timeout is not None and elapsed >= self.timeout:
            self.done = True
            return [], (f"lccrun: error: --start-timeout {self.timeout:g} s expired: "
                        f"{progress_line(up, self.placed, elapsed, self.silent)}")
        if now < self.next_line:
            return [], None
        self.next_line = now + self.interval
        self.printed = True
        return [f"lccrun: {progress_line(up, self.placed, elapsed, self.silent)}"], None

    def _probe_budget(self, elapsed: float) -> float:
        """Seconds a probe may take: its own limit, or less so it ends before the timeout."""
        if self.timeout is None:
            return PROBE_TIMEOUT_S
        return max(0.5, min(PROBE_TIMEOUT_S, (self.timeout - elapsed) * 0.8))

    def _maybe_probe(self, up: set[int], budget: float) -> None:
        """Ask the launch agent about remote hosts none of whose ranks is up (once each)."""
        if self.agent is None:
            return
        if self._probe is not None:
            if not self._probe.done():
                return
            self.silent |= self._probe.result()
            self._probe = None
        hosts_up = {self.placed[r] for r in up if r in self.placed}
        todo = sorted({h for h in self.placed.values() if h not in hosts_up
                       and h not in self._probed and not is_local(h)})
        if todo:
            self._probed |= set(todo)
            self._probe = _Background(lambda: _silent_hosts(self.agent, todo, budget))


def _silent_hosts(agent: list[str], hosts: list[str], timeout: float) -> set[str]:
    """The hosts among ``hosts`` that do not answer ``agent host true`` (probed at once)."""
    with ThreadPoolExecutor(max_workers=min(16, len(hosts))) as pool:
        results = list(pool.map(lambda h: answers(agent, h, timeout), hosts))
    return {h for h, ok in zip(hosts, results) if not ok}


class _Background:
    """Run ``fn`` in a daemon thread; ``done()`` / ``result()`` like a future."""

    def __init__(self, fn) -> None:
        self._result = None
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn) -> None:
        self._result = fn()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self):
        return self._result if self._result is not None else set()
