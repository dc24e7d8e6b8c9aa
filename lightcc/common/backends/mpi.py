"""``Communicator`` over mpi4py for host (NumPy) arrays.

Reductions map the array's dtype to the matching MPI datatype; data movement without
arithmetic (gather, broadcast, all-to-all) travels as bytes, so any dtype (float16, bfloat16,
fp8) can be moved. Messages larger than :data:`MAX_CHUNK_ELEMS` are split so that MPI's
32-bit counts never overflow. Byte counts per call follow the usual cost model of each
collective (what an optimal algorithm sends), so benchmarks can compare formats; see
``WireStats``.
"""
from __future__ import annotations

import functools
import logging
import time
from typing import Any, Sequence

import numpy as np

from ..arrays import displacements, num_pieces, sub_blocks
from ..comm import WireStats
from ..exceptions import LightCCError
from ..tracing import NULL

# re-exported: the door's bootstrap and thread-level calls live in mpi_runtime.py
from .mpi_runtime import (_MPI_OPS, _MPI_TYPES, _OPS, _Persistent, _Req, _Restartable,  # noqa: F401
                          _mpi, _mpi_op, agree_over, library_version, max_tag,
                          thread_multiple, world_bcast, world_rank_size)

log = logging.getLogger("lightcc")

MAX_CHUNK_ELEMS = 1 << 30  # elements per reduction call; keeps MPI int counts in range
#: Default allreduce piece (bytes; 0 = one call); each communicator has its own ``chunk_bytes``
#: (its process set's LCC_MPI_CHUNK_BYTES). Open MPI 5's default algorithms for messages above
#: ~16 MB ran 3-4x slower on one node here than a loop of 4 MB calls.
ALLREDUCE_CHUNK_BYTES = 4 << 20
MAX_CHUNK_BYTES = 1 << 30  # bytes per data-movement call on the large-message paths
INT_LIMIT = (1 << 31) - 1  # MPI-3 counts and displacements are C ints
_LARGE_TAG = 7203          # point-to-point tag of the large alltoallv path


def _as_bytes(buf: np.ndarray) -> np.ndarray:
    return buf.reshape(-1).view(np.uint8)


def _timed(call: str):
    """Report the call to the communicator's tracer (one attribute check when tracing is off)."""
    def wrap(fn):
        @functools.wraps(fn)
        def inner(self, *args, **kwargs):
            if not self.tracer.enabled:
                return fn(self, *args, **kwargs)
            start = time.perf_counter()
            before = self.stats.bytes_sent
            out = fn(self, *args, **kwargs)
            self.tracer.span(f"link:{self.name}", call.upper(), start, time.perf_counter(),
                             bytes_sent=self.stats.bytes_sent - before, ranks=self.size)
            return out
        return inner
    return wrap


def bootstrap(comm: Any = None) -> tuple["MPICommunicator", list[str]]:
    """The communicator lightcc runs on and every member's host name (collective).

    ``comm``: None for the world, an mpi4py communicator, or a list of world ranks (a
    communicator of those ranks is made). Raises LightCCError when MPI lacks thread support.
    """
    MPI = _mpi()
    if MPI.Query_thread() < MPI.THREAD_SERIALIZED:
        raise LightCCError("MPI was initialized without thread support; lightcc needs "
                           "MPI_THREAD_SERIALIZED or better (do not set "
                           "mpi4py.rc.thread_level below 'serialized')")
    if comm is None:
        comm = MPI.COMM_WORLD
    elif isinstance(comm, (list, tuple)):
        comm = MPI.COMM_WORLD.Create_group(MPI.COMM_WORLD.Get_group().Incl(list(comm)))
    return MPICommunicator(comm, "base"), comm.allgather(MPI.Get_processor_name())


def p2p_communicator(world_ranks: Sequence[int] | None, name: str = "p2p") -> Any:
    """A communicator of its own for point-to-point traffic beside the engine's (collective over
    its members: ``None`` means the whole world, else only the listed world ranks call it), or
    None when MPI lacks MPI_THREAD_MULTIPLE."""
    MPI = _mpi()
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        return None
    if world_ranks is None:
        return MPICommunicator(MPI.COMM_WORLD.Dup(), name)
    group = MPI.COMM_WORLD.Get_group().Incl([int(r) for r in world_ranks])
    try:
        return MPICommunicator(MPI.COMM_WORLD.Create_group(group, tag=4242), name)
    finally:
        group.Free()


class MPICommunicator:
    """A group of MPI ranks (see ``comm.Communicator``)."""

    is_device = False

    def __init__(self, comm: Any, name: str) -> None:
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.name = name
        self.stats = WireStats()
        self.tracer = NULL
        self.chunk_bytes = ALLREDUCE_CHUNK_BYTES     # set per process set (LCC_MPI_CHUNK_BYTES)
        self._agreement: Any = None                  # duplicate for agree()
        self.ring_chunk_bytes = 1 << 20              # set per process set (LCC_RING_CHUNK_BYTES)
        self.progress = None                         # set by the engine's groups (Engine._pump)
        self.links: Any = None                       # tcp.Links: point-to-point over TCP

    # -- reductions ---------------------------------------------------------------------------
    def _mpi_type(self, dtype: np.dtype) -> Any:
        mtype = _MPI_TYPES.get(dtype)
        if mtype is None:
            try:
                mtype = _MPI_TYPES[dtype] = _mpi()._typedict[np.dtype(dtype).char]
            except KeyError:
                raise TypeError(f"MPI backend cannot reduce dtype {np.dtype(dtype)}") from None
        return mtype

    def iallreduce(self, sendbuf: np.ndarray, recvbuf: np.ndarray | None = None,
                   op: str = "sum") -> _Req:
        """Start reducing ``sendbuf`` over all ranks into ``recvbuf`` (None: in place). Not
        counted in :attr:`stats` (the direct path's small calls; it has a communicator of its
        own that ``lightcc.stats()`` does not list)."""
        mtype = _MPI_TYPES.get(sendbuf.dtype) or self._mpi_type(sendbuf.dtype)
        mop = _MPI_OPS.get(op) or _mpi_op(op)
        if recvbuf is None:
            return _Req(self.comm.Iallreduce(_mpi().IN_PLACE, [sendbuf, mtype], mop))
        return _Req(self.comm.Iallreduce([sendbuf, mtype], [recvbuf, mtype], mop))

    def allreduce_init(self, sendbuf: np.ndarray, recvbuf: np.ndarray | None = None,
                       op: str = "sum") -> _Persistent:
        """A persistent allreduce of ``sendbuf`` into ``recvbuf`` (None: in place), started
        with ``start()`` as often as needed (MPI-4 ``MPI_Allreduce_init``; collective: every
        rank creates its matching request in the same order). Not counted in :attr:`stats`."""
        mtype = self._mpi_type(sendbuf.dtype)
        mop = _mpi_op(op)
        send = _mpi().IN_PLACE if recvbuf is None else [sendbuf, mtype]
        recv = [sendbuf if recvbuf is None else recvbuf, mtype]
        try:
            return _Persistent(self.comm.Allreduce_init(send, recv, mop))
        except NotImplementedError:       # an MPI library older than MPI-4
            return _Restartable(functools.partial(self.comm.Iallreduce, send, recv, mop))

    def allgather_object(self, obj: Any) -> list:
        """Every rank's small picklable ``obj``, in rank order."""
        return self.comm.allgather(obj)

    def dup(self, name: str) -> "MPICommunicator":
        """A communicator of the same ranks whose traffic never meets this one's (collective)."""
        return MPICommunicator(self.comm.Dup(), name)

    @_timed("allreduce")
    def allreduce(self, buf: np.ndarray, op: str = "sum") -> None:
        """Reduce ``buf`` in place in calls of at most ``chunk_bytes`` (0: one call)."""
        self._allreduce(buf, op, self.chunk_bytes)

    @_timed("native_allreduce")
    def native_allreduce(self, buf: np.ndarray, op: str = "sum") -> None:
        """One ``MPI_Allreduce`` of the whole buffer (pieces only past MPI's int counts), so
        Open MPI's coll framework (han, tuned) chooses the algorithm for the whole message,
        where :meth:`allreduce` makes ``chunk_bytes`` calls. ``ValueError`` for an op that
        MPI has no predefined operation for."""
        if op not in _OPS:
            raise ValueError(f"the native algorithm cannot reduce with op {op!r}: MPI's "
                             f"allreduce has {', '.join(_OPS)}")
        self._allreduce(buf, op, 0)

    def _allreduce(self, buf: np.ndarray, op: str, chunk_bytes: int) -> None:
        MPI = _mpi()
        flat = buf.reshape(-1)
        mtype = self._mpi_type(flat.dtype)
        mop = _mpi_op(op)
        step = MAX_CHUNK_ELEMS
        if chunk_bytes > 0:
            step = max(1, min(step, chunk_bytes // flat.itemsize))
        for start in range(0, max(flat.size, 1), step):
            part = flat[start:start + step]
            if part.size:
                self.comm.Allreduce(MPI.IN_PLACE, [part, mtype], op=mop)
        n = flat.nbytes
        moved = 2 * (self.size - 1) * n // self.size if self.size > 1 else 0
        self.stats.add("allreduce", moved, moved)

    @_timed("reduce_scatter")
    def reduce_scatterv(self, sendbuf: np.ndarray, recvbuf: np.ndarray,
                        counts: Sequence[int], op: str = "sum") -> None:
        MPI = _mpi()
        mtype = self._mpi_type(sendbuf.dtype)
        counts = [int(c) for c in counts]
        item = sendbuf.dtype.itemsize
        # in chunk_bytes calls too: Open MPI's Reduce_scatter of 64 MB between 2
        # ranks on one host ran at 1.2 GB/s, in 4 MB calls at 7.6 GB/s
        pieces = 1 if self.chunk_bytes <= 0 or self.size == 1 else \
            num_pieces(sum(counts) * item, self.chunk_bytes)
        if sum(counts) > INT_LIMIT:
            self._reduce_scatterv_large(sendbuf.reshape(-1), recvbuf.reshape(-1), counts,
                                        mtype, getattr(MPI, _OPS[op]))
        elif pieces > 1:
            self._reduce_scatterv_pieces(sendbuf.reshape(-1), recvbuf.reshape(-1), counts,
                                         mtype, getattr(MPI, _OPS[op]), pieces)
        else:
            self.comm.Reduce_scatter([sendbuf.reshape(-1), mtype], [recvbuf.reshape(-1), mtype],
                                     counts, op=getattr(MPI, _OPS[op]))
        sent = (sum(counts) - counts[self.rank]) * item
        recv = counts[self.rank] * (self.size - 1) * item
        self.stats.add("reduce_scatter", sent, recv)

    # -- data movement -------------------------------------------------------------------------
    @_timed("allgather")
    def allgatherv(self, sendbuf: np.ndarray, recvbuf: np.ndarray,
                   counts: Sequence[int]) -> None:
        MPI = _mpi()
        item = sendbuf.dtype.itemsize
        bcounts = [int(c) * item for c in counts]
        if sum(bcounts) > INT_LIMIT:
            self._allgatherv_large(_as_bytes(sendbuf), _as_bytes(recvbuf), bcounts)
        else:
            self.comm.Allgatherv([_as_bytes(sendbuf), MPI.BYTE],
                                 [_as_bytes(recvbuf), bcounts, displacements(bcounts), MPI.BYTE])
        mine = bcounts[self.rank]
        self.stats.add("allgather", mine * (self.size - 1), sum(bcounts) - mine)

    @_timed("alltoall")
    def alltoallv(self, sendbuf: np.ndarray, sendcounts: Sequence[int], recvbuf: np.ndarray,
                  recvcounts: Sequence[int]) -> None:
        MPI = _mpi()
        item = sendbuf.dtype.itemsize
        sc = [int(c) * item for c in sendcounts]
        rc = [int(c) * item for c in recvcounts]
        if max(sum(sc), sum(rc)) > INT_LIMIT:
            self._alltoallv_large(_as_bytes(sendbuf), sc, _as_bytes(recvbuf), rc)
        else:
            self.comm.Alltoallv([_as_bytes(sendbuf), sc, displacements(sc), MPI.BYTE],
                                [_as_bytes(recvbuf), rc, displacements(rc), MPI.BYTE])
        self.stats.add("alltoall", sum(sc) - sc[self.rank], sum(rc) - rc[self.rank])

    @_timed("broadcast")
    def bcast(self, buf: np.ndarray, root: int) -> None:
        self._bcast_bytes(_as_bytes(buf), root)
        n = buf.nbytes
        self.stats.add("broadcast", n * (self.size - 1) if self.rank == root else 0,
                       0 if self.rank == root else n)

    # -- large messages (more than INT_LIMIT bytes / elements in one call) -------------------
    def _bcast_bytes(self, data: np.ndarray, root: int) -> None:
        """Bcast a byte buffer in calls of at most MAX_CHUNK_BYTES (one call when small)."""
        MPI = _mpi()
        for start in range(0, data.size, MAX_CHUNK_BYTES) or (0,):
            self.comm.Bcast([data[start:start + MAX_CHUNK_BYTES], MPI.BYTE], root=root)

    def _allgatherv_large(self, send: np.ndarray, recv: np.ndarray, bcounts: list[int]) -> None:
        """Allgatherv whose total exceeds INT_LIMIT bytes: one chunked bcast per rank's block
        (bandwidth-optimal for blocks this large; no int displacement needed)."""
        displs = displacements(bcounts)
        mine = recv[displs[self.rank]:displs[self.rank] + bcounts[self.rank]]
        mine[...] = send[:bcounts[self.rank]]
        for root in range(self.size):
            if bcounts[root]:
                self._bcast_bytes(recv[displs[root]:displs[root] + bcounts[root]], root)

    def _alltoallv_large(self, send: np.ndarray, sc: list[int], recv: np.ndarray,
                         rc: list[int]) -> None:
        """Alltoallv with more than INT_LIMIT bytes: chunked non-blocking point-to-point."""
        MPI = _mpi()
        sd, rd = displacements(sc), displacements(rc)
        recv[rd[self.rank]:rd[self.rank] + rc[self.rank]] = send[sd[self.rank]:
                                                                 sd[self.rank] + sc[self.rank]]
        reqs = []
        for peer in range(self.size):
            if peer == self.rank:
                continue
            for start in range(0, rc[peer], MAX_CHUNK_BYTES):
                part = recv[rd[peer] + start:rd[peer] + min(rc[peer], start + MAX_CHUNK_BYTES)]
                reqs.append(self.comm.Irecv([part, MPI.BYTE], source=peer, tag=_LARGE_TAG))
            for start in range(0, sc[peer], MAX_CHUNK_BYTES):
                part = send[sd[peer] + start:sd[peer] + min(sc[peer], start + MAX_CHUNK_BYTES)]
                reqs.append(self.comm.Isend([part, MPI.BYTE], dest=peer, tag=_LARGE_TAG))
        MPI.Request.Waitall(reqs)

    def _reduce_scatterv_pieces(self, send: np.ndarray, recv: np.ndarray, counts: list[int],
                                mtype: Any, mop: Any, pieces: int) -> None:
        """Reduce_scatter as ``pieces`` calls of about ``chunk_bytes``: piece q packs
        sub-block q of every rank's block (same split on every rank) and lands in sub-block q
        of ``recv``."""
        subs, starts = sub_blocks(counts, pieces)
        pack = np.empty(-(-sum(counts) // pieces) + self.size, send.dtype)
        mine0 = displacements(counts)[self.rank]
        for q in range(pieces):
            qcounts = [subs[r][q] for r in range(self.size)]
            at = 0
            for r in range(self.size):
                pack[at:at + qcounts[r]] = send[starts[r][q]:starts[r][q] + qcounts[r]]
                at += qcounts[r]
            mine = starts[self.rank][q] - mine0
            self.comm.Reduce_scatter([pack[:at], mtype],
                                     [recv[mine:mine + qcounts[self.rank]], mtype],
                                     qcounts, op=mop)

    def _reduce_scatterv_large(self, send: np.ndarray, recv: np.ndarray, counts: list[int],
                               mtype: Any, mop: Any) -> None:
        """Reduce_scatter of more than INT_LIMIT elements: chunked Reduce to each block's
        owner (counts stay below MAX_CHUNK_ELEMS per call)."""
        displs = displacements(counts)
        for root in range(self.size):
            for start in range(0, counts[root], MAX_CHUNK_ELEMS):
                stop = min(counts[root], start + MAX_CHUNK_ELEMS)
                part = send[displs[root] + start:displs[root] + stop]
                if self.rank == root:
                    self.comm.Reduce([part, mtype], [recv[start:stop], mtype], op=mop,
                                     root=root)
                else:
                    self.comm.Reduce([part, mtype], None, op=mop, root=root)

    def isend(self, buf: np.ndarray, dest: int, tag: int = 0) -> Any:
        MPI = _mpi()
        self.stats.add("send", buf.nbytes, 0)
        if self.links is not None:
            return self.links.isend(buf, dest, tag)
        return _Req(self.comm.Isend([_as_bytes(buf), MPI.BYTE], dest=dest, tag=tag))

    def irecv(self, buf: np.ndarray, source: int | None, tag: int = 0) -> Any:
        """Start receiving into ``buf`` from ``source`` (None: any rank; not over TCP links)."""
        MPI = _mpi()
        self.stats.add("recv", 0, buf.nbytes)
        if self.links is not None:
            if source is None:
                raise ValueError(f"{self.name}: a receive from any rank is not supported over "
                                 f"lightcc's TCP links (LCC_CROSS_TRANSPORT=tcp)")
            return self.links.irecv(buf, source, tag)
        src = MPI.ANY_SOURCE if source is None else source
        return _Req(self.comm.Irecv([_as_bytes(buf), MPI.BYTE], source=src, tag=tag),
                    MPI.Status())

    def barrier(self) -> None:
        self.comm.Barrier()

    def split(self, color: int, key: int, name: str) -> "MPICommunicator":
        return MPICommunicator(self.comm.Split(color, key), name)

    # -- agreement on a bucket's success ------------------------------------------------------
    def prepare_agreement(self) -> None:
        """Make the duplicate communicator :meth:`agree` uses (collective, idempotent; called on
        every rank before a bucket that needs it). Separate from the data communicator so a rank
        that failed early cannot match its peers' data collectives."""
        if self._agreement is None:
            self._agreement = self.comm.Dup()

    def agree(self, failed: bool, what: str, timeout: float) -> list[int]:
        """Ranks on which the bucket failed (see :func:`agree_over`; over this communicator's
        TCP links when it has them)."""
        self.prepare_agreement()
        return agree_over(self._agreement, self.rank, self.size, failed, what, timeout,
                          self.links)

    def use_tcp(self, override: str = "") -> bool:
        """Carry this communicator's point-to-point messages over lightcc's own TCP links
        (:mod:`.tcp`; collective). False on every member, with MPI kept, when some pair of
        members could not connect."""
        from . import tcp

        self.links = tcp.connect(self, self.name, override)
        return self.links is not None

    def free(self) -> None:
        if self.links is not None:
            self.links.close()
            self.links = None
        MPI = _mpi()
        if MPI.Is_finalized():
            return
        if self._agreement is not None:
            self._agreement.Free()
            self._agreement = None
        if self.comm not in (MPI.COMM_WORLD, MPI.COMM_SELF):
            self.comm.Free()

    def __repr__(self) -> str:
        return f"MPICommunicator({self.name}, rank={self.rank}, size={self.size})"
