"""``Communicator`` for device (CuPy) buffers over MPI, staged through pinned host memory.

Used when a process set's device backend is MPI (``LCC_BACKEND=mpi``, or ``auto`` without
NCCL). Each call copies its device send buffer into page-locked host memory with
``cudaMemcpyAsync`` on the caller's current stream (the engine's), waits for that copy (MPI
reads host memory), runs the host :class:`~.mpi.MPICommunicator` call, and copies the result
back asynchronously on the same stream, so later device work is ordered after it. Page-locked
memory makes both copies DMA transfers at PCIe speed that do not stall other streams.

Collective calls reuse two pinned buffers per communicator, grown to the largest message
(:class:`PinnedBuffer`); point-to-point requests take their own pinned block from CuPy's pinned
pool, since several may be in flight. Bytes on the wire are counted by the host communicator.
Importing this module does not import CuPy.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..kernels import cuda as kc


def _runtime() -> Any:
    return kc.cupy_or_raise().cuda.runtime


def copy_to_host(src: Any, dst: np.ndarray, stream: Any) -> None:
    """Copy device array ``src`` into pinned ``dst`` (same bytes) and wait until it is there."""
    if src.nbytes:
        rt = _runtime()
        rt.memcpyAsync(dst.ctypes.data, src.data.ptr, src.nbytes, rt.memcpyDeviceToHost,
                       stream.ptr)
    stream.synchronize()


def copy_to_device(src: np.ndarray, dst: Any, stream: Any) -> None:
    """Queue the copy of pinned ``src`` into device array ``dst`` on ``stream`` (no wait)."""
    if dst.nbytes:
        rt = _runtime()
        rt.memcpyAsync(dst.data.ptr, src.ctypes.data, dst.nbytes, rt.memcpyHostToDevice,
                       stream.ptr)


class PinnedBuffer:
    """A page-locked host buffer, grown to the largest request and reused.

    ``view`` waits (host) for the copy-back queued after the previous use, so a view is never
    overwritten while a transfer out of it is still pending.
    """

    def __init__(self) -> None:
        self._mem: Any = None
        self._bytes = 0
        self._pending: Any = None     # event after the last copy out of the buffer

    def view(self, n: int, dtype: Any) -> np.ndarray:
        """``n`` elements of ``dtype`` at the start of the buffer (contents undefined)."""
        dtype = np.dtype(dtype)
        need = max(int(n) * dtype.itemsize, 1)
        self.settle()
        if self._mem is None or self._bytes < need:
            self._mem = kc.cupy_or_raise().cuda.alloc_pinned_memory(need)
            self._bytes = need
        return np.frombuffer(self._mem, dtype=dtype, count=int(n))

    def done_with(self, stream: Any) -> None:
        """The buffer is free again once ``stream`` passes this point (after a copy-back)."""
        self._pending = stream.record()

    def settle(self) -> None:
        if self._pending is not None:
            self._pending.synchronize()
            self._pending = None

    def release(self) -> None:
        self.settle()
        self._mem, self._bytes = None, 0


class _StagedRequest:
    """A host request plus the pinned block it uses; a receive copies back once, when done."""

    def __init__(self, req: Any, host: np.ndarray, into: Any = None) -> None:
        self._req, self._host, self._into = req, host, into

    def _finish(self) -> None:
        if self._into is not None:
            stream = kc.cupy_or_raise().cuda.get_current_stream()
            copy_to_device(self._host, self._into, stream)
            stream.synchronize()      # the pinned block goes back to CuPy's pool after this
            self._into = None

    def wait(self) -> None:
        self._req.wait()
        self._finish()

    def test(self) -> bool:
        if not self._req.test():
            return False
        self._finish()
        return True


def _host_attr(name: str) -> property:
    """An attribute read from and written to the wrapped host communicator."""
    return property(lambda self: getattr(self.host, name),
                    lambda self, value: setattr(self.host, name, value))


class StagedCommunicator:
    """A host MPI communicator used with device buffers (see module docstring)."""

    is_device = True

    def __init__(self, host: Any, owns_host: bool = False) -> None:
        self.host = host
        self.owns_host = owns_host
        self.rank, self.size, self.name = host.rank, host.size, host.name
        self.stats = host.stats
        self._send = PinnedBuffer()
        self._recv = PinnedBuffer()

    # the settings a group pushes to its communicators go to the host one
    tracer = _host_attr("tracer")
    chunk_bytes = _host_attr("chunk_bytes")
    ring_chunk_bytes = _host_attr("ring_chunk_bytes")
    progress = _host_attr("progress")

    # -- staging --------------------------------------------------------------------------------
    @staticmethod
    def _stream() -> Any:
        return kc.cupy_or_raise().cuda.get_current_stream()

    def _in(self, buf: Any, pinned: PinnedBuffer, stream: Any) -> np.ndarray:
        host = pinned.view(buf.size, buf.dtype)
        copy_to_host(buf.reshape(-1), host, stream)
        return host

    def _out(self, host: np.ndarray, buf: Any, pinned: PinnedBuffer, stream: Any) -> None:
        copy_to_device(host, buf.reshape(-1), stream)
        pinned.done_with(stream)

    # -- collectives ----------------------------------------------------------------------------
    def allreduce(self, buf: Any, op: str = "sum") -> None:
        s = self._stream()
        host = self._in(buf, self._send, s)
        self.host.allreduce(host, op)
        self._out(host, buf, self._send, s)

    def reduce_scatterv(self, sendbuf: Any, recvbuf: Any, counts: Sequence[int],
                        op: str = "sum") -> None:
        s = self._stream()
        send = self._in(sendbuf, self._send, s)
        recv = self._recv.view(recvbuf.size, recvbuf.dtype)
        self.host.reduce_scatterv(send, recv, counts, op)
        self._out(recv, recvbuf, self._recv, s)

    def allgatherv(self, sendbuf: Any, recvbuf: Any, counts: Sequence[int]) -> None:
        s = self._stream()
        send = self._in(sendbuf, self._send, s)
        recv = self._recv.view(recvbuf.size, recvbuf.dtype)
        self.host.allgatherv(send, recv, counts)
        self._out(recv, recvbuf, self._recv, s)

    def alltoallv(self, sendbuf: Any, sendcounts: Sequence[int], recvbuf: Any,
                  recvcounts: Sequence[int]) -> None:
        s = self._stream()
        send = self._in(sendbuf, self._send, s)
        recv = self._recv.view(recvbuf.size, recvbuf.dtype)
        self.host.alltoallv(send, sendcounts, recv, recvcounts)
        self._out(recv, recvbuf, self._recv, s)

    def bcast(self, buf: Any, root: int) -> None:
        s = self._stream()
        if self.rank == root:
            host = self._in(buf, self._send, s)
        else:
            host = self._send.view(buf.size, buf.dtype)
        self.host.bcast(host, root)
        if self.rank != root:
            self._out(host, buf, self._send, s)

    # -- point to point ------------------------------------------------------------------------
    def _block(self, buf: Any) -> np.ndarray:
        mem = kc.cupy_or_raise().cuda.alloc_pinned_memory(max(buf.nbytes, 1))
        return np.frombuffer(mem, dtype=buf.dtype, count=buf.size)

    def isend(self, buf: Any, dest: int, tag: int = 0) -> _StagedRequest:
        host = self._block(buf)
        copy_to_host(buf.reshape(-1), host, self._stream())
        return _StagedRequest(self.host.isend(host, dest, tag), host)

    def irecv(self, buf: Any, source: int, tag: int = 0) -> _StagedRequest:
        host = self._block(buf)
        return _StagedRequest(self.host.irecv(host, source, tag), host, buf.reshape(-1))

    def barrier(self) -> None:
        self.host.barrier()

    def split(self, color: int, key: int, name: str) -> "StagedCommunicator":
        return StagedCommunicator(self.host.split(color, key, name), owns_host=True)

    def free(self) -> None:
        """Release the pinned buffers; the host communicator only when this one made it."""
        self._send.release()
        self._recv.release()
        if self.owns_host:
            self.host.free()

    def __repr__(self) -> str:
        return f"StagedCommunicator({self.name}, rank={self.rank}, size={self.size})"
