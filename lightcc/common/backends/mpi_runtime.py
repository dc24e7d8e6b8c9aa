"""mpi4py's module, loaded on first use, and what runs on MPI outside a communicator object:
thread level, library version, world bootstrap calls (before ``init()``), request adapters, and
the one-byte agreement on a bucket's success. backends/mpi.py re-exports these."""
from __future__ import annotations

import logging
import threading
from functools import partial
from typing import Any

import numpy as np

log = logging.getLogger("lightcc")

_MPI_MODULE = None


def _mpi():
    global _MPI_MODULE
    if _MPI_MODULE is None:
        from mpi4py import MPI

        _MPI_MODULE = MPI
    return _MPI_MODULE


_OPS = {"sum": "SUM", "min": "MIN", "max": "MAX", "prod": "PROD", "band": "BAND", "bor": "BOR",
        "bxor": "BXOR"}
_MPI_OPS: dict[str, Any] = {}      # op string -> MPI.Op, filled on first use
_MPI_TYPES: dict[Any, Any] = {}    # NumPy dtype -> MPI datatype, filled on first use


def _mpi_op(op: str) -> Any:
    mop = _MPI_OPS.get(op)
    if mop is None:
        mop = _MPI_OPS[op] = getattr(_mpi(), _OPS[op])
    return mop


class _Req:
    """Adapts an mpi4py request to the protocol's ``wait``/``test``/``cancel``; a receive also
    tells, once complete, the rank it came from (``source``) and its size (``nbytes``)."""

    __slots__ = ("_req", "_status", "test", "wait")

    def __init__(self, req: Any, status: Any = None) -> None:
        self._req, self._status = req, status
        # test() -> bool and wait() are mpi4py's own methods (no Python frame per test: the
        # direct path tests a request in a tight loop)
        if status is None:
            self.test, self.wait = req.Test, req.Wait
        else:
            self.test, self.wait = partial(req.Test, status), partial(req.Wait, status)

    def cancel(self) -> None:
        """Withdraw a pending receive and wait until MPI has let go of the buffer."""
        self._req.Cancel()
        self._req.Wait()

    @property
    def source(self) -> int:
        return int(self._status.Get_source())

    @property
    def nbytes(self) -> int:
        return int(self._status.Get_count(_mpi().BYTE))


class _Persistent:
    """An MPI-4 persistent collective request: ``start()`` runs the same operation on the same
    buffers again (no argument parsing, no new request object); ``test``/``wait`` as for
    ``_Req``; ``free()`` once inactive."""

    __slots__ = ("start", "test", "wait", "free")

    def __init__(self, req: Any) -> None:
        self.start, self.test, self.wait, self.free = req.Start, req.Test, req.Wait, req.Free


class _Restartable:
    """``_Persistent``'s interface over a nonblocking allreduce posted anew at each
    ``start()``, for MPI libraries older than MPI-4 (no ``MPI_Allreduce_init``)."""

    __slots__ = ("_post", "_req")

    def __init__(self, post: Any) -> None:
        self._post, self._req = post, None

    def start(self) -> None:
        self._req = self._post()

    def test(self) -> bool:
        return self._req.Test()

    def wait(self) -> None:
        self._req.Wait()

    def free(self) -> None:
        self._req = None


def library_version() -> str:
    """The MPI library's version string (e.g. "Open MPI v5.0.8, ...")."""
    return _mpi().Get_library_version()


def thread_multiple() -> bool:
    """True when MPI runs with MPI_THREAD_MULTIPLE (threads besides the engine's may call it)."""
    MPI = _mpi()
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def world_bcast(obj: Any, root: int = 0) -> Any:
    """``root``'s small picklable ``obj`` on every rank of the world (collective; for bootstraps
    that run before ``init()``, such as the c10d rendezvous)."""
    return _mpi().COMM_WORLD.bcast(obj, root=root)


def world_rank_size() -> tuple[int, int]:
    """This process's world rank and the world size, from MPI (works before ``init()``)."""
    comm = _mpi().COMM_WORLD
    return comm.Get_rank(), comm.Get_size()


def max_tag() -> int:
    """The largest point-to-point tag MPI accepts (MPI_TAG_UB)."""
    MPI = _mpi()
    return int(MPI.COMM_WORLD.Get_attr(MPI.TAG_UB))


#: Tag of the agreement's flags over lightcc's TCP links (data messages use small tags).
AGREE_TAG = 1 << 40


def agree_over(comm: Any, rank: int, size: int, failed: bool, what: str,
               timeout: float, links: Any = None) -> list[int]:
    """Ranks of ``comm`` (an mpi4py communicator used for nothing else at this point) on which
    a bucket failed: a max-allreduce of one flag byte per rank; over ``links`` (the
    communicator's TCP links, :mod:`.tcp`) each rank sends its flag to every other one on
    :data:`AGREE_TAG` instead, so the wait blocks in the kernel rather than spinning in MPI.

    A rank that failed waits at most ``timeout`` seconds for its peers: if they never arrive,
    it raised in the middle of the bucket's communication and they are blocked inside MPI (or
    waiting for its data on the links) for good, so it aborts the job (the launcher then names
    this rank) instead of leaving it hung.
    """
    MPI = _mpi()
    flags = np.zeros(size, np.uint8)
    flags[rank] = 1 if failed else 0
    watchdog = None
    if failed:
        def abort() -> None:
            log.critical("%s failed on this rank in the middle of its communication; the "
                         "other ranks are blocked inside MPI and cannot recover: aborting "
                         "the job", what)
            MPI.COMM_WORLD.Abort(70)

        watchdog = threading.Timer(timeout, abort)
        watchdog.daemon = True
        watchdog.start()
    try:
        if links is None:
            comm.Allreduce(MPI.IN_PLACE, [flags, MPI.UNSIGNED_CHAR], op=MPI.MAX)
        else:
            peers = [r for r in range(size) if r != rank]
            mine = flags[rank:rank + 1].copy()     # one buffer for every send
            reqs = [links.irecv(flags[r:r + 1], r, AGREE_TAG) for r in peers]
            reqs += [links.isend(mine, r, AGREE_TAG) for r in peers]
            for req in reqs:
                req.wait()
    finally:
        if watchdog is not None:
            watchdog.cancel()
    return [int(i) for i in np.flatnonzero(flags)]


