"""``Communicator`` over NCCL (``cupy.cuda.nccl``) for device (CuPy) arrays.

Bootstrap: rank 0 of an mpi4py communicator creates the NCCL unique id and broadcasts it over
MPI; every rank then joins ``NcclCommunicator(size, uid, rank)`` on its current CUDA device
(the caller picks the device, usually ``local_rank % device_count``). One NCCL communicator
backs one lightcc communicator (world, local, cross, ...); :meth:`NCCLCommunicator.split`
splits the MPI communicator and bootstraps a new NCCL one the same way.

Streams: every call runs on the communicator's own stream, which first waits on an event
recorded on the caller's current stream (so work queued there, e.g. a pack kernel, is
ordered before the collective). In blocking mode (the protocol's default) the call returns
after the host has seen the collective finish; while waiting it polls
``ncclCommGetAsyncError`` and gives up after ``timeout`` seconds, aborting the communicator
and raising :class:`CollectiveError`, so a dead peer never hangs a rank silently. With
``blocking=False`` the caller's stream is made to wait on the collective instead (no host
sync) and :meth:`synchronize` performs the checked wait later.

Data movement without arithmetic (allgather, broadcast, all-to-all, send/recv) travels as
bytes, so any dtype (fp8 codes, bfloat16 bits) can be moved; reductions need a dtype NCCL
knows. ``allgatherv``/``reduce_scatterv`` use NCCL's allgather/reduce-scatter when all counts
are equal and grouped broadcasts/reduces otherwise (no padding copies); ``alltoallv`` and
``isend``/``irecv`` use grouped send/recv. NCCL has no tags: point-to-point messages between
a pair match in posting order, and posted operations are issued together (one NCCL group)
when any of their requests is waited on or tested, so an exchange that posts both sides
before waiting cannot deadlock.

Importing this module does not import CuPy.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Sequence

import numpy as np

from ..arrays import displacements
from ..comm import WireStats
from ..dtypes import BITWISE
from ..exceptions import CollectiveError, InvalidArgumentError, LightCCError
from ..kernels import cuda as kc
from .nccl_runtime import _OPS, _TYPES, _mpi, _nccl, nccl_available  # noqa: F401

log = logging.getLogger("lightcc")

DEFAULT_TIMEOUT = 300.0      # seconds a collective may take before the communicator aborts
_SPIN_POLLS = 200            # busy polls before the wait loop starts sleeping
_SLEEP = 0.0002              # seconds between polls after that

class _P2PRequest:
    """A deferred NCCL send or receive (see module docstring)."""

    def __init__(self, comm: "NCCLCommunicator") -> None:
        self._comm = comm
        self._event: Any = None

    def _issued(self) -> Any:
        if self._event is None:
            self._comm._flush_p2p()
        return self._event

    def wait(self) -> None:
        self._comm._wait_event(self._issued(), "send/recv")

    def test(self) -> bool:
        self._comm._check_async("send/recv")
        return bool(self._issued().done)


class NCCLCommunicator:
    """A group of ranks, one GPU each, talking through NCCL (see module docstring)."""

    is_device = True

    def __init__(self, mpi_comm: Any, name: str, timeout: float = DEFAULT_TIMEOUT,
                 blocking: bool = True, stream: Any = None) -> None:
        cupy = kc.cupy_or_raise()
        nccl = _nccl()
        self.mpi = mpi_comm
        self.rank = mpi_comm.Get_rank()
        self.size = mpi_comm.Get_size()
        self.name = name
        self.timeout = float(timeout)
        self.blocking = bool(blocking)
        self.stats = WireStats()
        self.device = cupy.cuda.runtime.getDevice()
        self.stream = stream if stream is not None else cupy.cuda.Stream(non_blocking=True)
        self._pending: list[tuple[Callable[[], None], _P2PRequest]] = []
        self._aborted = False
        # Reused for every collective (only one runs at a time, under the progress lock):
        # creating a timing event per call cost microseconds of the fixed cost per call.
        self._ev_begin = cupy.cuda.Event(disable_timing=True)
        self._ev_end = cupy.cuda.Event(disable_timing=True)
        uid = nccl.get_unique_id() if self.rank == 0 else None
        uid = mpi_comm.bcast(uid, root=0)
        mpi_comm.Barrier()     # every rank is here, so NCCL init below cannot wait forever
        try:
            self.comm = nccl.NcclCommunicator(self.size, uid, self.rank)
        except Exception as exc:
            raise CollectiveError(f"NCCL init of communicator {name!r} failed on rank "
                                  f"{self.rank}/{self.size} (device {self.device}): {exc}") from exc
        log.debug("rank %d: NCCL communicator %s ready (size %d, device %d)", self.rank, name,
                  self.size, self.device)

    @classmethod
    def from_mpi(cls, comm: Any, **kwargs: Any) -> "NCCLCommunicator":
        """Bootstrap over an ``MPICommunicator`` (its mpi4py communicator is duplicated)."""
        return cls(comm.comm.Dup(), comm.name, **kwargs)

    # -- plumbing ------------------------------------------------------------------------------
    def _check_async(self, what: str) -> None:
        nccl = _nccl()
        try:
            self.comm.check_async_error()
        except nccl.NcclError as exc:
            self._abort()
            raise CollectiveError(f"NCCL {what} on {self.name!r} failed on rank "
                                  f"{self.rank}/{self.size}: {exc}") from exc

    def _abort(self) -> None:
        if not self._aborted:
            self._aborted = True
            try:
                self.comm.abort()
            except Exception:  # already broken; the caller gets the original error
                pass

    def _begin(self) -> None:
        """Order the communicator's stream after the caller's current stream."""
        if self._aborted:
            raise CollectiveError(f"NCCL communicator {self.name!r} was aborted after an "
                                  f"earlier error; reinitialize lightcc")
        cupy = kc.cupy_or_raise()
        cur = cupy.cuda.get_current_stream()
        if cur.ptr != self.stream.ptr:
            self.stream.wait_event(cur.record(self._ev_begin))

    def _end(self, what: str) -> None:
        """Finish a call: checked host wait (blocking) or make the caller's stream wait."""
        cupy = kc.cupy_or_raise()
        event = self.stream.record(self._ev_end)
        if self.blocking:
            self._wait_event(event, what)
        else:
            cupy.cuda.get_current_stream().wait_event(event)

    def _wait_event(self, event: Any, what: str) -> None:
        deadline = time.monotonic() + self.timeout
        polls = 0
        while not event.done:
            polls += 1
            if polls > _SPIN_POLLS:
                self._check_async(what)
                if time.monotonic() > deadline:
                    self._abort()
                    raise CollectiveError(
                        f"NCCL {what} on {self.name!r} did not finish within {self.timeout:g} s "
                        f"on rank {self.rank}/{self.size}; another rank probably stopped or "
                        f"diverged (communicator aborted)")
                time.sleep(_SLEEP)
        self._check_async(what)

    def synchronize(self) -> None:
        """Wait (checked, with timeout) until everything queued on the stream has finished."""
        self._flush_p2p()
        self._wait_event(self.stream.record(), "synchronize")

    def _call(self, what: str, fn: Callable[[], None]) -> None:
        self._issue(what, fn)
        self._end(what)

    def _issue(self, what: str, fn: Callable[[], None]) -> None:
        """Enqueue ``fn``'s NCCL work after the caller's stream; an NCCL error aborts the
        communicator and raises :class:`CollectiveError`."""
        nccl = _nccl()
        self._begin()
        try:
            fn()
        except nccl.NcclError as exc:
            self._abort()
            raise CollectiveError(f"NCCL {what} on {self.name!r} failed on rank "
                                  f"{self.rank}/{self.size}: {exc}") from exc

    @staticmethod
    def _buf(buf: Any) -> Any:
        arr = kc.as_cupy(buf)
        if not arr.flags.c_contiguous:
            raise LightCCError("NCCL buffers must be C-contiguous")
        return arr

    def _dtype(self, arr: Any) -> int:
        nccl = _nccl()
        name = "bfloat16" if str(arr.dtype) == "bfloat16" else np.dtype(arr.dtype).name
        if name not in _TYPES or not hasattr(nccl, _TYPES[name]):
            raise TypeError(f"NCCL backend cannot reduce dtype {arr.dtype}")
        return getattr(nccl, _TYPES[name])

    def _op(self, op: str) -> int:
        if op not in _OPS:
            if op in BITWISE:              # the same op on every rank: none hangs
                raise InvalidArgumentError(
                    f"NCCL has no bitwise reduction ({op}); reduce a host copy of the tensor "
                    f"or set LCC_CPU_REDUCE=1 (GPU buckets reduced on the host)")
            raise ValueError(f"unknown reduction op {op!r}; known: {', '.join(_OPS)}")
        return getattr(_nccl(), _OPS[op])

    # -- reductions ----------------------------------------------------------------------------
    def allreduce(self, buf: Any, op: str = "sum") -> None:
        arr = self._buf(buf)
        dt, nop, s = self._dtype(arr), self._op(op), self.stream.ptr
        if arr.size:
            self._call("allreduce", lambda: self.comm.allReduce(
                arr.data.ptr, arr.data.ptr, arr.size, dt, nop, s))
        moved = 2 * (self.size - 1) * arr.nbytes // self.size if self.size > 1 else 0
        self.stats.add("allreduce", moved, moved)

    def reduce_scatterv(self, sendbuf: Any, recvbuf: Any, counts: Sequence[int],
                        op: str = "sum") -> None:
        send, recv = self._buf(sendbuf), self._buf(recvbuf)
        counts = [int(c) for c in counts]
        dt, nop, s, item = self._dtype(send), self._op(op), self.stream.ptr, send.itemsize
        if len(set(counts)) == 1:
            if counts[0]:
                self._call("reduce_scatter", lambda: self.comm.reduceScatter(
                    send.data.ptr, recv.data.ptr, counts[0], dt, nop, s))
        else:
            starts = displacements(counts)

            def grouped() -> None:
                nccl = _nccl()
                nccl.groupStart()
                try:
                    for r, c in enumerate(counts):
                        if c:
                            dst = recv.data.ptr if r == self.rank else send.data.ptr
                            self.comm.reduce(send.data.ptr + starts[r] * item, dst, c, dt,
                                             nop, r, s)
                finally:
                    nccl.groupEnd()

            self._call("reduce_scatter", grouped)
        sent = (sum(counts) - counts[self.rank]) * item
        self.stats.add("reduce_scatter", sent, counts[self.rank] * (self.size - 1) * item)

    # -- data movement -------------------------------------------------------------------------
    def allgatherv(self, sendbuf: Any, recvbuf: Any, counts: Sequence[int]) -> None:
        send, recv = self._buf(sendbuf), self._buf(recvbuf)
        nccl, s, item = _nccl(), self.stream.ptr, send.itemsize
        bcounts = [int(c) * item for c in counts]
        if len(set(bcounts)) == 1:
            if bcounts[0]:
                self._call("allgather", lambda: self.comm.allGather(
                    send.data.ptr, recv.data.ptr, bcounts[0], nccl.NCCL_UINT8, s))
        else:
            starts = displacements(bcounts)

            def grouped() -> None:
                nccl.groupStart()
                try:
                    for r, c in enumerate(bcounts):
                        if c:
                            src = send.data.ptr if r == self.rank else recv.data.ptr + starts[r]
                            self.comm.broadcast(src, recv.data.ptr + starts[r], c,
                                                nccl.NCCL_UINT8, r, s)
                finally:
                    nccl.groupEnd()

            self._call("allgather", grouped)
        mine = bcounts[self.rank]
        self.stats.add("allgather", mine * (self.size - 1), sum(bcounts) - mine)

    def alltoallv(self, sendbuf: Any, sendcounts: Sequence[int], recvbuf: Any,
                  recvcounts: Sequence[int]) -> None:
        send, recv = self._buf(sendbuf), self._buf(recvbuf)
        nccl, s, item = _nccl(), self.stream.ptr, send.itemsize
        sc = [int(c) * item for c in sendcounts]
        rc = [int(c) * item for c in recvcounts]
        sd, rd = displacements(sc), displacements(rc)
        if sc[self.rank] != rc[self.rank]:
            raise LightCCError(f"alltoallv on {self.name!r}: rank {self.rank} sends itself "
                               f"{sc[self.rank]} bytes but expects {rc[self.rank]}")

        def grouped() -> None:
            cupy = kc.cupy_or_raise()
            if sc[self.rank]:
                cupy.cuda.runtime.memcpyAsync(recv.data.ptr + rd[self.rank],
                                              send.data.ptr + sd[self.rank], sc[self.rank],
                                              cupy.cuda.runtime.memcpyDeviceToDevice, s)
            nccl.groupStart()
            try:
                for r in range(self.size):
                    if r == self.rank:
                        continue
                    if sc[r]:
                        self.comm.send(send.data.ptr + sd[r], sc[r], nccl.NCCL_UINT8, r, s)
                    if rc[r]:
                        self.comm.recv(recv.data.ptr + rd[r], rc[r], nccl.NCCL_UINT8, r, s)
            finally:
                nccl.groupEnd()

        self._call("alltoall", grouped)
        self.stats.add("alltoall", sum(sc) - sc[self.rank], sum(rc) - rc[self.rank])

    def bcast(self, buf: Any, root: int) -> None:
        arr = self._buf(buf)
        nccl, s = _nccl(), self.stream.ptr
        if arr.nbytes:
            self._call("broadcast", lambda: self.comm.bcast(
                arr.data.ptr, arr.nbytes, nccl.NCCL_UINT8, int(root), s))
        n = arr.nbytes
        self.stats.add("broadcast", n * (self.size - 1) if self.rank == root else 0,
                       0 if self.rank == root else n)

    def _post(self, fn: Callable[[], None]) -> _P2PRequest:
        req = _P2PRequest(self)
        self._pending.append((fn, req))
        return req

    def _flush_p2p(self) -> None:
        """Issue every posted send/recv in one NCCL group and give their requests an event."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        nccl = _nccl()

        def grouped() -> None:
            nccl.groupStart()
            try:
                for fn, _ in pending:
                    fn()
            finally:
                nccl.groupEnd()

        self._issue("send/recv", grouped)
        event = self.stream.record()
        for _, req in pending:
            req._event = event

    def isend(self, buf: Any, dest: int, tag: int = 0) -> _P2PRequest:
        arr = self._buf(buf)
        nccl, s = _nccl(), self.stream.ptr
        self.stats.add("send", arr.nbytes, 0)
        return self._post(lambda: self.comm.send(arr.data.ptr, arr.nbytes, nccl.NCCL_UINT8,
                                                 int(dest), s))

    def irecv(self, buf: Any, source: int, tag: int = 0) -> _P2PRequest:
        arr = self._buf(buf)
        nccl, s = _nccl(), self.stream.ptr
        self.stats.add("recv", 0, arr.nbytes)
        return self._post(lambda: self.comm.recv(arr.data.ptr, arr.nbytes, nccl.NCCL_UINT8,
                                                 int(source), s))

    def barrier(self) -> None:
        cupy = kc.cupy_or_raise()
        nccl = _nccl()
        token = cupy.zeros(1, np.int32)
        self._flush_p2p()
        self._begin()
        try:
            self.comm.allReduce(token.data.ptr, token.data.ptr, 1, nccl.NCCL_INT32,
                                nccl.NCCL_SUM, self.stream.ptr)
        except nccl.NcclError as exc:
            self._abort()
            raise CollectiveError(f"NCCL barrier on {self.name!r} failed: {exc}") from exc
        self._wait_event(self.stream.record(), "barrier")

    def split(self, color: int, key: int, name: str) -> "NCCLCommunicator":
        return NCCLCommunicator(self.mpi.Split(color, key), name, self.timeout, self.blocking)

    def prepare_agreement(self) -> None:
        """Nothing to prepare: :meth:`agree` runs on the MPI bootstrap communicator, which
        carries no data collectives."""

    def agree(self, failed: bool, what: str, timeout: float) -> list[int]:
        """Ranks on which the bucket failed, agreed over the bootstrap MPI communicator."""
        from .mpi import agree_over

        return agree_over(self.mpi, self.rank, self.size, failed, what, timeout)

    def free(self) -> None:
        try:
            if not self._aborted:
                self.comm.destroy()
        finally:
            MPI = _mpi()
            if self.mpi not in (MPI.COMM_WORLD, MPI.COMM_SELF) and not MPI.Is_finalized():
                self.mpi.Free()

    def __repr__(self) -> str:
        return f"NCCLCommunicator({self.name}, rank={self.rank}, size={self.size})"
