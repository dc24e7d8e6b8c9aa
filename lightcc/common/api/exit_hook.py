"""An uncaught exception on one rank ends the whole job, under any launcher.

Without this, a rank whose script raises prints its traceback and then waits in
``MPI_Finalize`` for the other ranks, while they wait inside a collective for it (a bucket this
rank had agreed to but never ran): the job hangs with no further output. ``lccrun`` avoids that
with its rank wrapper (``lightcc.runner._rankwrap``); for plain ``mpirun`` (and any launcher),
``init()`` on a job of two or more ranks chains this hook onto ``sys.excepthook``: Python's
traceback first, then ``MPI_Abort`` with exit code 1, as ``python -m mpi4py`` does. An error that
only reports that another rank went away (``ShutdownError`` / ``LightCCError`` naming a gone
rank) waits a little first, so that the rank that failed first ends the job and is the one the
launcher names. Exceptions caught by the script, ``sys.exit()`` and exceptions in other threads
are not affected. A script that sets its own ``sys.excepthook`` after ``init()`` replaces this.
"""
from __future__ import annotations

import sys
import time
from typing import Any

from ..exceptions import LightCCError
from ..observability import flight

#: seconds a rank whose error is a consequence of another rank's exit waits before aborting
CONSEQUENCE_WAIT_S = 5.0
_LOST_RANK_TEXT = ("exited or lost its connection", "closed its connection",
                   "shut down or exited")
_installed = False


def is_consequence(exc: BaseException | None) -> bool:
    """True for lightcc's errors that only say another rank exited or lost its connection."""
    return isinstance(exc, LightCCError) and any(t in str(exc) for t in _LOST_RANK_TEXT)


def install(world_size: int) -> None:
    """Chain the abort onto ``sys.excepthook`` (once per process, only for 2+ ranks)."""
    global _installed
    if _installed or world_size < 2:
        return
    _installed = True
    previous = sys.excepthook

    def hook(tp: type[BaseException], value: BaseException, tb: Any) -> None:
        previous(tp, value, tb)
        if issubclass(tp, KeyboardInterrupt):
            code = 130
        else:
            code = 1
        flight.dump_on_exit(f"exited on uncaught {tp.__name__}: {str(value)[:300]}")
        if is_consequence(value):
            time.sleep(CONSEQUENCE_WAIT_S)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed stream must not stop the abort
                pass
        from ..backends import mpi

        mpi.abort_world(code)

    sys.excepthook = hook
