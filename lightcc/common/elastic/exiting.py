"""How a process of an elastic job ends once the group has changed (docs/elastic.md).

After a shrink, ``MPI_Finalize`` can hang (Open MPI 5.0's finalize fence with a dead peer: 3
of 6 runs here), so the process ends with ``os._exit`` from an ``atexit`` handler that runs
before mpi4py's finalize, keeping the exit status. A process that joined a running group
(``MPI_Comm_spawn``) must instead disconnect from the survivors and finalize: prterun calls
its ``os._exit`` "exiting improperly", and finalizing while connected crashed in Open MPI
5.0.11.
"""
from __future__ import annotations

import atexit
import os
import sys
import traceback
from typing import Any

from ..api import lifecycle
from ..backends import ulfm


class Exit:
    """This process's exit state (one per process)."""

    hooked = False
    code = 0               # the code of sys.exit(n) after a shrink
    alive = 0              # processes in the last shrunk communicator
    inters: list = []      # (intercommunicator, launch numbers at its other end)
    members: set = set()   # launch numbers of the current group
    leaving = False        # this rank's host left the list: it exits alone


def end_without_finalize(alive: int) -> None:
    """After a shrink to ``alive`` processes: end this process with ``os._exit`` at exit
    (registered once). The exit status is kept: ``sys.exit(n)`` is recorded, and an uncaught
    exception on the last process left ends it with status 1 directly (prterun with ULFM
    reports 0 when the last process calls ``MPI_Abort``; with others left the abort still
    ends them)."""
    Exit.alive = alive
    if Exit.hooked:
        return
    Exit.hooked = True

    def leave() -> None:
        try:
            lifecycle.shutdown()
            if not Exit.leaving:
                for other in connected():
                    ulfm.disconnect(other)
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:  # noqa: BLE001 - a closed stream must not block the exit
                    pass
            os._exit(Exit.code)

    original = sys.exit

    def exit_recorded(code: Any = None) -> None:
        """``sys.exit`` that remembers its code for ``leave`` (which ends the process)."""
        Exit.code = exit_status(code)
        original(code)

    sys.exit = exit_recorded
    previous_hook = sys.excepthook

    def hook(tp: type[BaseException], value: BaseException, tb: Any) -> None:
        Exit.code = 130 if issubclass(tp, KeyboardInterrupt) else 1
        if Exit.alive <= 1:
            traceback.print_exception(tp, value, tb)
            leave()
        previous_hook(tp, value, tb)

    sys.excepthook = hook
    atexit.register(leave)


def connect(inter: Any, remote: list[int], members: list[int]) -> None:
    """Remember ``inter`` (to the processes with launch numbers ``remote``) for the
    disconnect at exit; ``members``: the group's launch numbers now."""
    Exit.inters.append((inter, list(remote)))
    Exit.members = set(members)


def connected() -> list[Any]:
    """The intercommunicators to disconnect at exit: those whose other end is still in the
    group. Disconnecting from a process that died hangs in PRRTE (a fence over the dead
    process: ``grpcomm`` "Not found" errors, then nothing), so those are left alone."""
    return [inter for inter, remote in Exit.inters if set(remote) <= Exit.members]


def disconnect_at_exit(inter: Any, remote: list[int], members: list[int]) -> None:
    """In a process that joined: at exit, shut lightcc down and disconnect from the
    survivors (``remote``, launch numbers), then let ``MPI_Finalize`` run (unless a later
    shrink ends it first)."""
    connect(inter, remote, members)

    def disconnect() -> None:
        lifecycle.shutdown()
        ulfm.free(ulfm.Joined.comm)
        for other in connected():
            ulfm.disconnect(other)

    atexit.register(disconnect)


def exit_status(code: Any) -> int:
    """The status the interpreter gives ``sys.exit(code)``: None 0, an int itself, else 1
    (it prints a message)."""
    if code is None:
        return 0
    return code & 0xFF if isinstance(code, int) else 1
