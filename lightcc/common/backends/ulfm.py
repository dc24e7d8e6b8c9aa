"""Open MPI's fault tolerance (ULFM: ``MPI_Comm_revoke`` / ``shrink``) as the elastic layer uses
it (docs/elastic.md). The job must be launched with ``mpirun --with-ft ulfm`` (lccrun adds it
for ``--min-np``/``--max-np``/``--elastic-timeout``): otherwise the launcher ends every rank
when one dies, and nothing here gets to run."""
from __future__ import annotations

import os
from typing import Any

from ... import _exit
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


def parent() -> Any:
    """The intercommunicator to the processes that spawned this one (None when launched)."""
    MPI = _mpi()
    inter = MPI.Comm.Get_parent()
    return None if inter == MPI.COMM_NULL else inter


def spawn(comm: Any, argv: list[str], hosts: list[tuple[str, int, int]]) -> tuple[Any, Any]:
    """Start new processes running ``argv`` (collective over ``comm``; rank 0's arguments
    count): ``hosts`` lists (host, new processes there, slots to declare for it). Returns
    (intercommunicator, merged intracommunicator with ``comm``'s members first).

    Each host is declared to PRRTE with ``PMIX_ADD_HOST`` (``host:slots``), so a host that
    was not in the launch allocation, or more slots on one that was, can be used; the
    ``host`` key names it with the same slots (a bare name means one slot to PRRTE: two
    processes on it failed with "not enough slots")."""
    MPI = _mpi()
    n = sum(count for _, count, _ in hosts)
    infos = []
    for host, count, slots in hosts:
        info = MPI.Info.Create()
        info.Set("PMIX_ADD_HOST", f"{host}:{slots}")
        info.Set("host", f"{host}:{slots}")
        infos.append((count, info))
    if comm.Get_rank() == 0 and len(infos) > 1:
        inter = comm.Spawn_multiple([argv[0]] * len(infos), [argv[1:]] * len(infos),
                                    [c for c, _ in infos], [i for _, i in infos], root=0)
    elif len(infos) > 1:
        inter = comm.Spawn_multiple(None, None, None, None, root=0)
    else:
        inter = comm.Spawn(argv[0], argv[1:], maxprocs=n, info=infos[0][1], root=0)
    for _, info in infos:
        info.Free()
    return inter, inter.Merge(high=False)


def disconnect(inter: Any) -> None:
    """Disconnect from the processes at the other end of ``inter`` (collective with them), so
    that each side's ``MPI_Finalize`` is its own. Never raises."""
    try:
        inter.Disconnect()
    except Exception:  # noqa: BLE001 - a dead peer: nothing left to disconnect from
        pass


def free(comm: Any) -> None:
    """Free ``comm`` (local; never raises). A communicator spanning several jobs that is
    still alive at ``MPI_Finalize`` gets Open MPI's disconnect handshake there, which
    crashed (``opal_net_get_hostname`` inside the TCP transport's ``add_procs``) in a joined
    process on another host."""
    try:
        if comm is not None and comm != _mpi().COMM_NULL:
            comm.Free()
    except Exception:  # noqa: BLE001 - already freed or revoked
        pass


def UNDEFINED() -> int:  # noqa: N802 - MPI's name
    """``MPI.UNDEFINED`` (the colour of a process that leaves a split)."""
    return _mpi().UNDEFINED


class Joined:
    """What a process started by ``spawn`` received when it joined (``join_parent``): the
    intercommunicator to the survivors and their membership record; None elsewhere."""

    inter: Any = None
    comm: Any = None         # the merged communicator lightcc was initialized on
    meta: dict | None = None


def join_parent() -> Any:
    """In a process started by :func:`spawn`: merge with the survivors (collective with
    their ``spawn``), receive rank 0's record (kept in :class:`Joined`) and return the merged
    communicator; None in a process the launcher started."""
    inter = parent()
    if inter is None:
        return None
    merged = inter.Merge(high=True)
    Joined.inter, Joined.comm, Joined.meta = inter, merged, merged.bcast(None, root=0)
    # lccrun's records (the rank wrapper's status file) name this process by its launch
    # number, not by its rank in its own spawned job
    _exit.launch_number = Joined.meta["launch"][merged.Get_rank()]
    return merged
