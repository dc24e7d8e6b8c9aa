"""An uncaught exception on one rank ends the whole job, under any launcher.

Without this, a rank whose script raises prints its traceback and then waits in
``MPI_Finalize`` for the other ranks, while they wait inside a collective for it (a bucket this
rank had agreed to but never ran): the job hangs with no further output. ``lccrun`` avoids that
with its rank wrapper (``lightcc.runner._rankwrap``); for plain ``mpirun`` (and any launcher),
``init()`` on a job of two or more ranks chains this hook onto ``sys.excepthook``: Python's
traceback first, then ``MPI_Abort`` with exit code 1, as ``python -m mpi4py`` does. An error that
only reports that another rank went away (``ShutdownError`` / ``LightCCError`` naming a gone
rank) waits first, so that the rank that failed first ends the job and is the one the launcher
names (``lightcc/_exit.py``, shared with lccrun's rank wrapper). Exceptions caught by the script, ``sys.exit()`` and exceptions in other threads
are not affected. A script that sets its own ``sys.excepthook`` after ``init()`` replaces this.
"""
from __future__ import annotations

import sys
from typing import Any

from ... import _exit
from ..observability import flight

_installed = False


def install(world_size: int) -> None:
    """Chain the abort onto ``sys.excepthook`` (once per process, only for 2+ ranks)."""
    global _installed
    if _installed or world_size < 2:
        return
    _installed = True
    previous = sys.excepthook

    def hook(tp: type[BaseException], value: BaseException, tb: Any) -> None:
        previous(tp, value, tb)
        code = 130 if issubclass(tp, KeyboardInterrupt) else 1
        flight.dump_on_exit(f"exited on uncaught {tp.__name__}: {str(value)[:300]}")
        if _exit.is_consequence(value):
            _exit.wait_for_cause()
        _exit.abort_if_mpi(code)

    sys.excepthook = hook
