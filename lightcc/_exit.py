"""How a failing rank ends the job: shared by lccrun's rank wrapper and ``init()``'s exit hook.

Standard library only, and nothing here imports mpi4py: the rank wrapper imports this module
before the user's program decides whether to use MPI at all, and the core's exit hook
(``lightcc.common.api.exit_hook``) must not import the launcher.

A rank whose error only reports that *another* rank exited or lost its connection (a
*consequence*) waits before ``MPI_Abort`` so that the rank that failed first ends the job and
is the one the launcher names: until that rank's own status record appears in
``$LCC_RUNNER_STATUS_DIR`` (lccrun sets it; then at once), or at most ``CONSEQUENCE_WAIT_S``
(plain mpirun: the whole wait, unless Open MPI ends the job first, as it does once the failed
rank aborts).
"""
from __future__ import annotations

import json
import os
import sys
import time

STATUS_DIR_ENV = "LCC_RUNNER_STATUS_DIR"
#: the longest a consequence waits for its cause before MPI_Abort (see the module docstring)
CONSEQUENCE_WAIT_S = 10.0
_POLL_S = 0.05
#: phrases of lightcc's errors that say another rank went away (control/link.py, outcomes.py)
LOST_RANK_TEXT = ("exited or lost its connection", "closed its connection",
                  "shut down or exited")


def is_consequence(exc: BaseException | None) -> bool:
    """True for lightcc's errors that only say another rank exited or lost its connection
    (checked by class name: importing lightcc's exceptions would import the core)."""
    names = {c.__name__ for c in type(exc).__mro__} if exc is not None else set()
    return "LightCCError" in names and any(text in str(exc) for text in LOST_RANK_TEXT)


#: set in a process that joined an elastic job (MPI_Comm_spawn): its launch number, which
#: names it in lccrun's records instead of its rank in its own spawned job (0, 1, ...)
launch_number: int | None = None


def world_rank() -> int | None:
    """This process's rank in the MPI launch, from the launcher's environment (in a process
    that joined an elastic job: its launch number)."""
    if launch_number is not None:
        return launch_number
    for name in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"):
        value = os.environ.get(name)
        if value is not None and value.isdigit():
            return int(value)
    return None


def wait_for_cause(timeout: float = CONSEQUENCE_WAIT_S) -> bool:
    """After a consequence: sleep until another rank recorded a failure of its own (True) or
    ``timeout`` passed (False; without a status directory, the whole timeout)."""
    directory, me = os.environ.get(STATUS_DIR_ENV), world_rank()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if directory and _cause_recorded(directory, me):
            return True
        time.sleep(_POLL_S)
    return False


def _cause_recorded(directory: str, me: int | None) -> bool:
    try:
        names = [n for n in os.listdir(directory) if n.startswith("rank-") and
                 n.endswith(".json") and n != f"rank-{me}.json"]
    except OSError:
        return False
    for name in names:
        try:
            with open(os.path.join(directory, name)) as fh:
                if not json.load(fh).get("consequence"):
                    return True
        except (OSError, ValueError):
            continue          # being replaced, or torn: read again next time
    return False


def abort_if_mpi(code: int) -> bool:
    """Flush stdout/stderr and ``MPI_Abort(code)`` on the world when this process initialised
    MPI through mpi4py and has not finalised it (Open MPI's launcher then ends every rank);
    False (nothing done) otherwise. Never imports mpi4py itself."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None:
        return False
    try:
        if not mpi.Is_initialized() or mpi.Is_finalized():
            return False
    except Exception:  # noqa: BLE001 - a broken MPI state must not hide the user's exit code
        return False
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream must not stop the abort
            pass
    mpi.COMM_WORLD.Abort(code & 0xFF or 1)
    return True


def report_to_lccrun(where: str, line: bytes, timeout: float = 2.0) -> bool:
    """Send one line to lccrun's registry (``where`` = ``addr1,addr2:port``, each address
    tried in turn; the rank wrapper's start-up report and ``--status`` reports); never
    raises, False when nobody answered."""
    import socket

    addrs, _, port = where.rpartition(":")
    for addr in addrs.split(","):
        try:
            with socket.create_connection((addr, int(port)), timeout=timeout) as conn:
                conn.sendall(line)
            return True
        except (OSError, ValueError):
            continue
    return False
