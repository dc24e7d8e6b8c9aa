"""Open MPI's fault tolerance (ULFM: ``MPI_Comm_revoke`` / ``shrink``) as the elastic layer uses
it (docs/elastic.md). The job must be launched with ``mpirun --with-ft ulfm`` (lccrun adds it
for ``--min-np``/``--max-np``/``--elastic-timeout``): otherwise the launcher ends every rank
when one dies, and nothing here gets to run."""
from __future__ import annotations

import os
from typing import Any

from .mpi_runtime import _mpi


def world() -> Any:
    """``MPI.COMM_WORLD`` (the communicator an elastic job starts on)."""
    return _mpi().COMM_WORLD


def launch_rank() -> int:
    """This process's rank in the job as launched (stays the same through shrinks)."""
    return _mpi().COMM_WORLD.Get_rank()


def supported() -> bool:
    """Whether this MPI library has the ULFM calls (Open MPI 5 built with them)."""
    return hasattr(_mpi().Comm, "Shrink") and hasattr(_mpi().Comm, "Revoke")


def enabled_at_launch() -> bool:
    """Whether the launcher enabled fault tolerance (``mpirun --with-ft ulfm`` sets
    ``OMPI_MCA_mpi_ft_enable`` in every rank's environment)."""
    value = os.environ.get("OMPI_MCA_mpi_ft_enable", "").lower()
    return value in ("1", "true", "yes", "enabled")


def revoke(comm: Any) -> None:
    """Revoke ``comm`` (an mpi4py communicator or an object with a ``comm`` attribute): every
    pending and later operation on it fails on every member. Never raises."""
    raw = getattr(comm, "comm", comm)
    if raw is None:
        return
    try:
        if raw != _mpi().COMM_NULL and not raw.Is_revoked():
            raw.Revoke()
    except Exception:  # noqa: BLE001 - already freed or revoked: nothing to stop
        pass


def shrink(comm: Any) -> Any:
    """A new communicator of ``comm``'s live members, in the same order (collective over the
    survivors; raises ``MPI.Exception`` when another member fails during the call)."""
    return comm.Shrink()


def is_process_failure(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is MPI's report of a failed or
    revoked peer (``MPI_ERR_PROC_FAILED``, ``MPI_ERR_PROC_FAILED_PENDING``, ``MPI_ERR_REVOKED``)."""
    MPI = _mpi()
    classes = {getattr(MPI, n) for n in ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING",
                                         "ERR_REVOKED") if hasattr(MPI, n)}
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, MPI.Exception):
            try:
                if exc.Get_error_class() in classes:
                    return True
            except Exception:  # noqa: BLE001 - a broken error object: not ours to judge
                return False
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


def abort(code: int) -> None:
    """``MPI_Abort`` on the launch world: prterun ends every remaining rank."""
    _mpi().COMM_WORLD.Abort(code)
