"""``Communicator`` without MPI: collectives over lightcc's TCP links between every pair of ranks
(:mod:`.tcp`, connected by :mod:`.rendezvous`), for jobs started the torchrun way.

Every communicator of the job (world, local, cross, process sets, their duplicates) shares one
set of links, the *mesh*; a communicator maps its ranks to mesh ranks and puts its own id in
the top bits of every tag (``id << 44 | tag``), so their messages never match each other's.
Collectives are direct exchanges, bandwidth-optimal for the few ranks of a host or a small job:

* ``reduce_scatterv``: block r goes straight to rank r, which reduces the blocks in rank order
  (the same sum on every rank, bit for bit);
* ``allreduce``: below :data:`SMALL_BYTES` every rank sends its buffer to every other and each
  reduces all of them in rank order (one round); above, ``reduce_scatterv`` then
  ``allgatherv`` (each rank sends and receives 2 (n-1)/n of the buffer, as a ring does);
* ``allgatherv``, ``alltoallv``: each block straight to its destination; ``bcast``: the root
  sends to every rank; ``barrier``: a one-byte allreduce.

Waits block in the kernel (the links' threads), so a waiting rank costs no core.
"""
from __future__ import annotations

import logging
import os
import pickle
import threading
import zlib
from typing import Any, Sequence

import numpy as np

from ..arrays import displacements
from ..comm import WireStats
from ..tracing import NULL
from .shm import FLAG_BARRIER, Segment
from .tcp import Links

log = logging.getLogger("lightcc")

#: below this many bytes allreduce is one round of all-to-all exchange (see module docstring)
SMALL_BYTES = 64 << 10
TAG_BITS = 44                        # user and algorithm tags: 0 .. 2**44 - 1
COLL_TAG = 1 << 42                   # the collectives' own messages
AGREE_TAG = 1 << 40                  # agree(): a channel no data collective uses
SHM_TAG = 1 << 41                    # the shared-memory path's barriers
#: the largest point-to-point tag this transport carries (``p2p`` checks tags against it)
MAX_TAG = (1 << 40) - 1
_UFUNCS = {"sum": np.add, "min": np.minimum, "max": np.maximum, "prod": np.multiply,
           "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}


def _bytes(buf: np.ndarray) -> np.ndarray:
    return buf.reshape(-1).view(np.uint8)


def _wait(reqs: list) -> None:
    for req in reqs:
        req.wait()


class _MPIStyle:
    """The four mpi4py calls the control plane's bootstrap makes (``Get_rank``, ``Get_size``,
    ``bcast``, ``allgather``), over a :class:`TCPCommunicator`."""

    def __init__(self, comm: "TCPCommunicator") -> None:
        self._comm = comm

    def Get_rank(self) -> int:  # noqa: N802 - mpi4py's names
        return self._comm.rank

    def Get_size(self) -> int:  # noqa: N802
        return self._comm.size

    def bcast(self, obj: Any, root: int = 0) -> Any:
        return self._comm.allgather_object(obj if self._comm.rank == root else None)[root]

    def allgather(self, obj: Any) -> list:
        return self._comm.allgather_object(obj)


class TCPCommunicator:
    """A group of ranks over the job's mesh of TCP links (see module docstring)."""

    is_device = False
    max_tag = MAX_TAG

    def __init__(self, mesh: Links, members: Sequence[int], name: str, cid: int = 0) -> None:
        self.mesh, self.members, self.name, self.cid = mesh, list(members), name, cid
        self.rank = self.members.index(mesh.rank)
        self.size = len(self.members)
        self.stats = WireStats()
        self.tracer = NULL
        self.progress = None                 # set by the engine's groups
        self.chunk_bytes = 0                 # set per process set; unused here
        self.ring_chunk_bytes = 1 << 20      # set per process set (LCC_RING_CHUNK_BYTES)
        self._splits = 0
        self.owns_mesh = False               # the job's first communicator closes the mesh
        self.store: Any = None               # the rendezvous store, kept open while it runs
        self.comm = _MPIStyle(self)
        self._segment: Segment | None | bool = False     # False: not tried yet (see shm)

    # -- point to point -----------------------------------------------------------------------
    def _tag(self, tag: int) -> int:
        if not 0 <= tag < (1 << TAG_BITS):
            raise ValueError(f"{self.name}: tag {tag} outside 0..{(1 << TAG_BITS) - 1}")
        return (self.cid << TAG_BITS) | tag

    def _send(self, buf: np.ndarray, dest: int, tag: int) -> Any:
        return self.mesh.isend(_bytes(buf), self.members[dest], self._tag(tag))

    def _recv(self, buf: np.ndarray, source: int, tag: int) -> Any:
        req = self.mesh.irecv(_bytes(buf), self.members[source], self._tag(tag))
        req.source = source
        return req

    def isend(self, buf: np.ndarray, dest: int, tag: int = 0) -> Any:
        self.stats.add("send", buf.nbytes, 0)
        return self._send(buf, dest, tag)

    def irecv(self, buf: np.ndarray, source: int | None, tag: int = 0) -> Any:
        """Start receiving into ``buf`` from ``source`` (a receive from any rank, None, is
        not supported over TCP links: ValueError)."""
        if source is None:
            raise ValueError(f"{self.name}: a receive from any rank is not supported over "
                             f"lightcc's TCP links (the MPI-free transport)")
        self.stats.add("recv", 0, buf.nbytes)
        return self._recv(buf, source, tag)

    # -- collectives ----------------------------------------------------------------------------
    def _peers(self) -> range:
        return range(self.size)

    def allreduce(self, buf: np.ndarray, op: str = "sum") -> None:
        flat = buf.reshape(-1)
        if self.size == 1 or flat.size == 0:
            return
        if flat.nbytes <= SMALL_BYTES:
            every = np.empty((self.size, flat.size), flat.dtype)
            every[self.rank] = flat
            self._exchange_all(flat, every)
            flat[...] = every[0]
            for r in range(1, self.size):
                _UFUNCS[op](flat, every[r], out=flat)
            moved = flat.nbytes * (self.size - 1)
        elif self._shared() is not None and flat.flags.c_contiguous:
            self._segment.allreduce(flat, _UFUNCS[op], self._shm_barrier)
            moved = 2 * (self.size - 1) * flat.nbytes // self.size
        else:
            q, extra = divmod(flat.size, self.size)
            counts = [q + (r < extra) for r in range(self.size)]
            mine = np.empty(counts[self.rank], flat.dtype)
            self._reduce_scatter(flat, mine, counts, op)
            self._allgather(mine, flat, counts)
            moved = 2 * (self.size - 1) * flat.nbytes // self.size
        self.stats.add("allreduce", moved, moved)

    def _shared(self) -> Segment | None:
        """This communicator's same-host segment (made on first use, collectively), or None
        when its members are not all on one host (:mod:`.shm`)."""
        if self._segment is False:
            self._segment = Segment.open(self.rank, self.size, self.allgather_object)
        return self._segment  # type: ignore[return-value]

    def _shm_barrier(self) -> None:
        if FLAG_BARRIER:
            self._segment.barrier(self._links_alive)
            return
        reqs = [self._recv(np.empty(1, np.uint8), r, SHM_TAG)
                for r in self._peers() if r != self.rank]
        reqs += [self._send(np.zeros(1, np.uint8), r, SHM_TAG)
                 for r in self._peers() if r != self.rank]
        _wait(reqs)

    def _links_alive(self) -> None:
        """Raise the error of a member's failed link (that member exited)."""
        for r in self._peers():
            peer = self.mesh.peers.get(self.members[r]) if r != self.rank else None
            if peer is not None and peer.error is not None:
                raise peer.error

    def _exchange_all(self, mine: np.ndarray, every: np.ndarray) -> None:
        reqs = [self._recv(every[r], r, COLL_TAG) for r in self._peers() if r != self.rank]
        reqs += [self._send(mine, r, COLL_TAG) for r in self._peers() if r != self.rank]
        _wait(reqs)

    def _reduce_scatter(self, send: np.ndarray, recv: np.ndarray, counts: Sequence[int],
                        op: str) -> None:
        displs = displacements(counts)
        me, n = self.rank, counts[self.rank]
        theirs = np.empty((self.size, n), send.dtype)
        reqs = [self._recv(theirs[r], r, COLL_TAG)
                for r in self._peers() if r != me and n]
        reqs += [self._send(send[displs[r]:displs[r] + counts[r]], r, COLL_TAG)
                 for r in self._peers() if r != me and counts[r]]
        theirs[me] = send[displs[me]:displs[me] + n]
        _wait(reqs)
        recv[...] = theirs[0]
        for r in range(1, self.size):
            _UFUNCS[op](recv, theirs[r], out=recv)

    def _allgather(self, send: np.ndarray, recv: np.ndarray, counts: Sequence[int]) -> None:
        displs = displacements(counts)
        me = self.rank
        recv[displs[me]:displs[me] + counts[me]] = send[:counts[me]]
        reqs = [self._recv(recv[displs[r]:displs[r] + counts[r]], r, COLL_TAG)
                for r in self._peers() if r != me and counts[r]]
        reqs += [self._send(send[:counts[me]], r, COLL_TAG)
                 for r in self._peers() if r != me and counts[me]]
        _wait(reqs)

    def reduce_scatterv(self, sendbuf: np.ndarray, recvbuf: np.ndarray,
                        counts: Sequence[int], op: str = "sum") -> None:
        counts = [int(c) for c in counts]
        self._reduce_scatter(sendbuf.reshape(-1), recvbuf.reshape(-1), counts, op)
        item = sendbuf.dtype.itemsize
        self.stats.add("reduce_scatter", (sum(counts) - counts[self.rank]) * item,
                       counts[self.rank] * (self.size - 1) * item)

    def allgatherv(self, sendbuf: np.ndarray, recvbuf: np.ndarray,
                   counts: Sequence[int]) -> None:
        counts = [int(c) for c in counts]
        self._allgather(sendbuf.reshape(-1), recvbuf.reshape(-1), counts)
        item = sendbuf.dtype.itemsize
        mine = counts[self.rank] * item
        self.stats.add("allgather", mine * (self.size - 1), sum(counts) * item - mine)

    def alltoallv(self, sendbuf: np.ndarray, sendcounts: Sequence[int], recvbuf: np.ndarray,
                  recvcounts: Sequence[int]) -> None:
        send, recv = sendbuf.reshape(-1), recvbuf.reshape(-1)
        sc, rc = [int(c) for c in sendcounts], [int(c) for c in recvcounts]
        sd, rd, me = displacements(sc), displacements(rc), self.rank
        recv[rd[me]:rd[me] + rc[me]] = send[sd[me]:sd[me] + sc[me]]
        reqs = [self._recv(recv[rd[r]:rd[r] + rc[r]], r, COLL_TAG)
                for r in self._peers() if r != me and rc[r]]
        reqs += [self._send(send[sd[r]:sd[r] + sc[r]], r, COLL_TAG)
                 for r in self._peers() if r != me and sc[r]]
        _wait(reqs)
        item = sendbuf.dtype.itemsize
        self.stats.add("alltoall", (sum(sc) - sc[me]) * item, (sum(rc) - rc[me]) * item)

    def bcast(self, buf: np.ndarray, root: int) -> None:
        if self.size == 1:
            return
        flat = buf.reshape(-1)
        if self.rank == root:
            _wait([self._send(flat, r, COLL_TAG) for r in self._peers() if r != root])
        else:
            self._recv(flat, root, COLL_TAG).wait()
        n = flat.nbytes
        self.stats.add("broadcast", n * (self.size - 1) if self.rank == root else 0,
                       0 if self.rank == root else n)

    def barrier(self) -> None:
        self.allreduce(np.zeros(1, np.uint8), "max")

    def allgather_object(self, obj: Any) -> list:
        """Every rank's small picklable ``obj``, in rank order."""
        data = np.frombuffer(pickle.dumps(obj), np.uint8)
        sizes = np.zeros(self.size, np.int64)
        sizes[self.rank] = data.size
        self.allreduce(sizes, "sum")
        every = np.empty(int(sizes.sum()), np.uint8)
        self._allgather(data, every, sizes.tolist())
        at = displacements(sizes.tolist())
        return [pickle.loads(every[a:a + int(n)].tobytes()) for a, n in zip(at, sizes)]

    # -- agreement on a bucket's success --------------------------------------------------------
    def prepare_agreement(self) -> None:
        """Nothing to prepare: :meth:`agree` has a tag of its own."""

    def agree(self, failed: bool, what: str, timeout: float) -> list[int]:
        """Ranks on which the bucket failed: each rank's flag to every other on
        :data:`AGREE_TAG`. A failed rank whose peers do not answer in ``timeout`` seconds is
        stuck beside peers waiting for its data: it exits (code 70), so the launcher ends the
        job instead of leaving it hung."""
        flags = np.zeros(self.size, np.uint8)
        flags[self.rank] = 1 if failed else 0
        watchdog = None
        if failed:
            def abort() -> None:
                log.critical("%s failed on this rank in the middle of its communication; the "
                             "other ranks cannot recover: exiting", what)
                os._exit(70)

            watchdog = threading.Timer(timeout, abort)
            watchdog.daemon = True
            watchdog.start()
        try:
            mine = flags[self.rank:self.rank + 1].copy()
            reqs = [self._recv(flags[r:r + 1], r, AGREE_TAG)
                    for r in self._peers() if r != self.rank]
            reqs += [self._send(mine, r, AGREE_TAG) for r in self._peers() if r != self.rank]
            _wait(reqs)
        finally:
            if watchdog is not None:
                watchdog.cancel()
        return [int(i) for i in np.flatnonzero(flags)]

    # -- groups -----------------------------------------------------------------------------------
    def split(self, color: int, key: int, name: str) -> "TCPCommunicator":
        """The members that passed the same ``color``, ordered by ``key`` then rank (collective).
        Its id is derived from this communicator's id, how many splits it made and the color,
        so every member computes the same one without a message."""
        mine = np.array([color, key], np.int64)
        every = np.empty(2 * self.size, np.int64)
        self._allgather(mine, every, [2] * self.size)
        table = every.reshape(self.size, 2).tolist()
        same = sorted((k, r) for r, (c, k) in enumerate(table) if c == color)
        self._splits += 1
        cid = zlib.crc32(f"{self.cid}.{self._splits}.{color}".encode()) % ((1 << 19) - 1) + 1
        return TCPCommunicator(self.mesh, [self.members[r] for _, r in same], name, cid)

    def dup(self, name: str) -> "TCPCommunicator":
        """A communicator of the same ranks whose traffic never meets this one's."""
        return self.split(0, self.rank, name)

    def free(self) -> None:
        """Close the mesh when this is the job's first communicator (sub-communicators share
        it and free nothing)."""
        if self._segment:
            self._segment.close()
        self._segment = None
        if self.owns_mesh:
            self.mesh.close()
            self.store = None

    def __repr__(self) -> str:
        return f"TCPCommunicator({self.name}, rank={self.rank}, size={self.size})"
