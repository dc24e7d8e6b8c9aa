"""The processes below lccrun: find them in /proc, signal them only while they are still the
process seen (pid + start time), adopt orphans (child subreaper) and reap what was killed."""
from __future__ import annotations

import collections
import os
import signal
import sys
import time
from pathlib import Path

from .flight_summary import rank_pids


def _stat(pid: int | str) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of a process, from /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), int(fields[19])


def descendants(pid: int) -> dict[int, int]:
    """Every process below ``pid`` -> its start time (Linux /proc; empty elsewhere)."""
    children: dict[int, list[tuple[int, int]]] = collections.defaultdict(list)
    try:
        entries = os.listdir("/proc")
    except OSError:
        return {}
    for entry in entries:
        if entry.isdigit():
            st = _stat(entry)
            if st is not None:
                children[st[0]].append((int(entry), st[1]))
    out: dict[int, int] = {}
    todo = [pid]
    while todo:
        for child, start in children.get(todo.pop(), []):
            out[child] = start
            todo.append(child)
    return out


def kill_tree(pid: int | None, known: dict[int, int] | None = None) -> list[int]:
    """SIGKILL ``pid`` (None: already reaped), every process below it, and the ``known``
    (pid -> start time) ones that still exist; returns the pids signalled."""
    targets = {**(known or {}), **(descendants(pid) if pid is not None else {})}
    if pid is not None:
        _signal(pid, signal.SIGKILL)
    return signal_verified(targets, signal.SIGKILL)


def signal_verified(targets: dict[int, int], sig: int) -> list[int]:
    """Send ``sig`` to each pid of ``targets`` (pid -> start time) that is still that process;
    returns the pids signalled."""
    hit = []
    for target, start in targets.items():
        st = _stat(target)
        if st is None or st[1] != start:
            continue  # gone, or the pid now belongs to an unrelated process
        try:
            os.kill(target, sig)
            hit.append(target)
        except (ProcessLookupError, PermissionError):
            pass
    return hit


def request_records(directory: str | None, known: dict[int, int]) -> list[int]:
    """SIGUSR1 to every rank process that registered in the flight recorder's ``directory``
    (``rank<N>.pid``) and is one of lccrun's descendants (``known``); the pids signalled."""
    return signal_verified({pid: known[pid] for pid in rank_pids(directory) if pid in known},
                           signal.SIGUSR1)


def become_subreaper() -> bool:
    """Adopt orphaned descendants (Linux PR_SET_CHILD_SUBREAPER), so that a rank's child
    that outlives its rank is still found and stopped when the job fails."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER = 36
    except (OSError, AttributeError):
        return False


def _reap(pids: list[int]) -> None:
    """Collect the exit status of adopted processes we killed (no zombies left behind)."""
    deadline = time.monotonic() + 1.0
    pending = set(pids)
    while pending and time.monotonic() < deadline:
        for pid in list(pending):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:   # not our child: init or its parent reaps it
                pending.discard(pid)
                continue
            if done:
                pending.discard(pid)
        if pending:
            time.sleep(0.02)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
