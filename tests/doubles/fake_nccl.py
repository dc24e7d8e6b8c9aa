"""A ``cupy.cuda.nccl`` double whose ranks are threads of one process, with NCCL's rules.

``NcclCommunicator(ndev, uid, rank)`` joins the world of ``uid`` (made by ``get_unique_id``).
Calls take raw device pointers, element counts, ``NCCL_*`` type and op codes and a stream
pointer, in NCCL's argument order; pointers must lie in fake device memory, counts in bounds,
the stream must be an int. Each call is logged on its stream (``fake_cupy.LOG``).

Semantics follow NCCL where it matters for deadlocks: calls between ``groupStart`` and
``groupEnd`` are issued together at ``groupEnd``; a send completes only once the peer has
issued the matching receive (k-th send to a peer matches its k-th receive from us), and a
group returns when all its sends were matched and all its receives filled. Two ranks whose
groups wait for each other's *later* groups therefore time out here as they would hang on
GPUs (:class:`NcclError` "deadlock"). Collectives match in call order on every rank; a
mismatch (different op or count) is an error.

Also here: :class:`ThreadMPIComm` (what ``NCCLCommunicator`` bootstraps over: ``bcast``,
``Barrier``, ``Dup``, ``Split``, ``Free``) and :class:`ThreadHostComm`, a host ``Communicator``
for thread ranks, so device code paths run at several ranks in one process.
"""
from __future__ import annotations

import itertools
import threading
from collections import defaultdict, deque
from typing import Any, Callable

import ml_dtypes
import numpy as np

from lightcc.common.arrays import displacements
from lightcc.common.comm import WireStats
from lightcc.common.tracing import NULL

from . import fake_cupy as fc

TIMEOUT = 10.0
_TYPES = {"NCCL_INT8": np.int8, "NCCL_UINT8": np.uint8, "NCCL_INT32": np.int32,
          "NCCL_UINT32": np.uint32, "NCCL_INT64": np.int64, "NCCL_UINT64": np.uint64,
          "NCCL_FLOAT16": np.float16, "NCCL_FLOAT32": np.float32, "NCCL_FLOAT64": np.float64}
_OPS = {"NCCL_SUM": np.add, "NCCL_PROD": np.multiply, "NCCL_MAX": np.maximum,
        "NCCL_MIN": np.minimum}
CODES: dict[str, int] = {name: i for i, name in enumerate([*_TYPES, "NCCL_BFLOAT16", *_OPS])}
DTYPE = {CODES[n]: np.dtype(t) for n, t in _TYPES.items()}
DTYPE[CODES["NCCL_BFLOAT16"]] = np.dtype(ml_dtypes.bfloat16)
UFUNC = {CODES[n]: f for n, f in _OPS.items()}


class NcclError(RuntimeError):
    pass


class _World:
    """Shared state of one NCCL communicator (all its thread ranks)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.cv = threading.Condition()
        self.coll: dict[int, dict[int, tuple]] = defaultdict(dict)    # seq -> rank -> data
        self.taken: dict[int, int] = defaultdict(int)
        self.posted: dict[tuple[int, int], int] = defaultdict(int)     # (src, dst) -> recvs
        self.mail: dict[tuple[int, int, int], np.ndarray] = {}         # (src, dst, seq)

    def wait_for(self, pred: Callable[[], bool], what: str) -> None:
        if not self.cv.wait_for(pred, TIMEOUT):
            raise NcclError(f"fake NCCL deadlock: {what} did not complete in {TIMEOUT} s")


_WORLDS: dict[bytes, _World] = {}
_uids = itertools.count()
_tls = threading.local()


def get_unique_id() -> bytes:
    return f"uid{next(_uids)}".encode().ljust(128, b"\0")


def get_version() -> int:
    return 22800


def groupStart() -> None:  # noqa: N802 (NCCL's names)
    _tls.group = getattr(_tls, "group", 0) + 1
    _tls.pending = getattr(_tls, "pending", []) if _tls.group > 1 else []


def groupEnd() -> None:  # noqa: N802
    _tls.group -= 1
    if _tls.group == 0:
        pending, _tls.pending = _tls.pending, []
        _run(pending)


def _run(ops: list) -> None:
    """Issue ``ops`` of one rank together (see module docstring)."""
    by_comm: dict[int, list] = defaultdict(list)
    for comm, kind, args in ops:
        by_comm[id(comm)].append((comm, kind, args))
    for items in by_comm.values():
        comm = items[0][0]
        p2p = [(k, a) for _, k, a in items if k in ("send", "recv")]
        if p2p:
            comm._p2p(p2p)
        for _, kind, args in items:
            if kind not in ("send", "recv"):
                comm._collective(kind, *args)


class NcclCommunicator:
    """One rank of a fake NCCL communicator (NCCL's method names and argument order)."""

    def __init__(self, ndev: int, commId: bytes, rank: int) -> None:  # noqa: N803
        assert isinstance(commId, bytes) and len(commId) == 128, "NCCL unique ids are 128 bytes"
        self.world = _WORLDS.setdefault(commId, _World(ndev))
        assert self.world.size == ndev, "ranks disagree on the communicator size"
        self.rank, self.size = rank, ndev
        self.seq = 0
        self.sends: dict[int, int] = defaultdict(int)
        self.recvs: dict[int, int] = defaultdict(int)
        self.calls: list[tuple[str, tuple]] = []
        self.async_error: str | None = None
        self.aborted = False

    # -- argument checks ---------------------------------------------------------------------
    def _mem(self, ptr: int, count: int, dtype: int, what: str) -> np.ndarray:
        assert isinstance(ptr, int), f"{what}: pointer must be an int, got {type(ptr).__name__}"
        assert isinstance(count, int) and count >= 0, f"{what}: bad count {count!r}"
        dt = DTYPE[dtype]
        nbytes = count * dt.itemsize
        kind = fc.MEMORY.kind_of(ptr, nbytes)
        assert kind == "device", f"{what}: buffer at {ptr:#x} is {kind} memory, not device"
        return fc.raw(ptr, nbytes).view(dt)

    def _call(self, kind: str, stream: int, args: tuple) -> None:
        assert isinstance(stream, int), f"{kind}: stream must be an int pointer, got {stream!r}"
        if self.aborted:
            raise NcclError("communicator was aborted")
        self.calls.append((kind, args))
        fc.LOG.add("nccl", stream, (kind, self.rank))
        if getattr(_tls, "group", 0):
            _tls.pending.append((self, kind, args))
        else:
            _run([(self, kind, args)])

    # -- NCCL API ------------------------------------------------------------------------------
    def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):  # noqa: N802
        self._call("allreduce", stream, (sendbuf, recvbuf, count, datatype, op))

    def reduceScatter(self, sendbuf, recvbuf, recvcount, datatype, op, stream):  # noqa: N802
        self._call("reducescatter", stream, (sendbuf, recvbuf, recvcount, datatype, op))

    def allGather(self, sendbuf, recvbuf, count, datatype, stream):  # noqa: N802
        self._call("allgather", stream, (sendbuf, recvbuf, count, datatype))

    def broadcast(self, sendbuf, recvbuf, count, datatype, root, stream):
        self._call("broadcast", stream, (sendbuf, recvbuf, count, datatype, root))

    def bcast(self, buff, count, datatype, root, stream):
        self._call("broadcast", stream, (buff, buff, count, datatype, root))

    def reduce(self, sendbuf, recvbuf, count, datatype, op, root, stream):
        self._call("reduce", stream, (sendbuf, recvbuf, count, datatype, op, root))

    def send(self, sendbuf, count, datatype, peer, stream):
        self._call("send", stream, (sendbuf, count, datatype, peer))

    def recv(self, recvbuf, count, datatype, peer, stream):
        self._call("recv", stream, (recvbuf, count, datatype, peer))

    def check_async_error(self) -> None:
        if self.async_error:
            raise NcclError(self.async_error)

    def abort(self) -> None:
        self.aborted = True

    def destroy(self) -> None:
        self.calls.append(("destroy", ()))

    # -- execution -----------------------------------------------------------------------------
    def _collective(self, kind: str, *args: Any) -> None:
        w, me, seq = self.world, self.rank, self.seq
        self.seq += 1
        send, recv, count, dt = args[:4]
        n_in = count * (self.size if kind == "reducescatter" else 1)
        n_out = count * (self.size if kind == "allgather" else 1)
        src = self._mem(send, n_in, dt, kind).copy()
        dst = self._mem(recv, n_out, dt, kind) if kind != "reduce" or args[5] == me else None
        with w.cv:
            w.coll[seq][me] = (kind, count, dt, args[4:], src)
            w.cv.notify_all()
            w.wait_for(lambda: len(w.coll[seq]) == self.size, f"{kind} #{seq} on rank {me}")
            calls = [w.coll[seq][r] for r in range(self.size)]
            w.taken[seq] += 1
            if w.taken[seq] == self.size:
                del w.coll[seq], w.taken[seq]
        sig = calls[me][:4]
        for r, c in enumerate(calls):
            if c[:4] != sig:
                raise NcclError(f"fake NCCL: call #{seq} is {sig[:2]} on rank {me} but "
                                f"{c[:2]} on rank {r}")
        data = [c[4] for c in calls]
        if kind in ("allreduce", "reducescatter", "reduce"):
            total = data[0].copy()
            for d in data[1:]:
                UFUNC[args[4]](total, d, out=total)
            if kind == "reducescatter":
                total = total[me * count:(me + 1) * count]
            if dst is not None:
                dst[...] = total
        elif kind == "allgather":
            dst[...] = np.concatenate(data)
        else:                                                   # broadcast
            dst[...] = data[args[4]]

    def _p2p(self, ops: list) -> None:
        w, me = self.world, self.rank
        recvs, sends = [], []
        with w.cv:
            for kind, (ptr, count, dt, peer) in ops:
                if kind == "recv":
                    recvs.append((peer, self.recvs[peer], self._mem(ptr, count, dt, "recv")))
                    self.recvs[peer] += 1
                    w.posted[(peer, me)] += 1
                else:
                    w.mail[(me, peer, self.sends[peer])] = self._mem(ptr, count, dt,
                                                                    "send").copy()
                    sends.append((peer, self.sends[peer]))
                    self.sends[peer] += 1
            w.cv.notify_all()
            for peer, seq in sends:
                w.wait_for(lambda: w.posted[(me, peer)] > seq,
                           f"send #{seq} from rank {me} to {peer}")
            for peer, seq, buf in recvs:
                w.wait_for(lambda: (peer, me, seq) in w.mail,
                           f"recv #{seq} on rank {me} from {peer}")
                data = w.mail.pop((peer, me, seq))
                assert data.nbytes == buf.nbytes, \
                    f"recv of {buf.nbytes} bytes matched a send of {data.nbytes}"
                buf.view(np.uint8)[...] = data.view(np.uint8)


# ---- thread ranks over MPI-like bootstrap ------------------------------------------------------
class _Group:
    """Rendezvous of one thread communicator: ``exchange`` gives every rank all values."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.cv = threading.Condition()
        self.rounds: dict[int, dict[int, Any]] = defaultdict(dict)
        self.taken: dict[int, int] = defaultdict(int)
        self.mail: dict[tuple[int, int, int], deque] = defaultdict(deque)  # (src, dst, tag)

    def exchange(self, rank: int, seq: int, value: Any) -> list:
        with self.cv:
            self.rounds[seq][rank] = value
            self.cv.notify_all()
            if not self.cv.wait_for(lambda: len(self.rounds[seq]) == self.size, TIMEOUT):
                raise TimeoutError(f"thread rank {rank} waited {TIMEOUT} s at exchange {seq}")
            out = [self.rounds[seq][r] for r in range(self.size)]
            self.taken[seq] += 1
            if self.taken[seq] == self.size:
                del self.rounds[seq], self.taken[seq]
            return out


class ThreadMPIComm:
    """The mpi4py calls ``NCCLCommunicator`` and the factory make, for thread ranks."""

    def __init__(self, group: _Group, rank: int) -> None:
        self.group, self.rank, self.seq = group, rank, 0

    def _x(self, value: Any) -> list:
        self.seq += 1
        return self.group.exchange(self.rank, self.seq, value)

    def Get_rank(self) -> int:  # noqa: N802 (mpi4py's names)
        return self.rank

    def Get_size(self) -> int:  # noqa: N802
        return self.group.size

    def bcast(self, obj: Any, root: int = 0) -> Any:
        return self._x(obj)[root]

    def allgather(self, obj: Any) -> list:
        return self._x(obj)

    def Barrier(self) -> None:  # noqa: N802
        self._x(None)

    def Dup(self) -> "ThreadMPIComm":  # noqa: N802
        return self.Split(0, self.rank)

    def Split(self, color: int, key: int) -> "ThreadMPIComm":  # noqa: N802
        made = _Group(0)
        all_ = self._x((color, key, made))
        mine = sorted((k, r) for r, (c, k, _) in enumerate(all_) if c == color)
        leader = mine[0][1]
        group = all_[leader][2]
        group.size = len(mine)
        return ThreadMPIComm(group, [r for _, r in mine].index(self.rank))

    def Free(self) -> None:  # noqa: N802
        pass


class _Done:
    def wait(self) -> None:
        pass

    def test(self) -> bool:
        return True


class _Recv:
    """A receive of a thread rank: messages between a pair and tag arrive in order."""

    def __init__(self, group: _Group, key: tuple, buf: np.ndarray) -> None:
        self.group, self.key, self.buf, self.done = group, key, buf, False

    def test(self) -> bool:
        with self.group.cv:
            if not self.done and self.group.mail[self.key]:
                self.buf[...] = self.group.mail[self.key].popleft()
                self.done = True
            return self.done

    def wait(self) -> None:
        with self.group.cv:
            if not self.group.cv.wait_for(lambda: self.done or self.group.mail[self.key],
                                          TIMEOUT):
                raise TimeoutError(f"thread receive {self.key} never matched")
        self.test()


class ThreadHostComm:
    """A host ``Communicator`` (NumPy buffers) for thread ranks; exact, in rank order."""

    is_device = False

    def __init__(self, comm: ThreadMPIComm, name: str = "world") -> None:
        self.comm, self.name = comm, name
        self.rank, self.size = comm.rank, comm.group.size
        self.stats, self.tracer = WireStats(), NULL
        self.chunk_bytes = self.ring_chunk_bytes = 1 << 20

    def allreduce(self, buf: np.ndarray, op: str = "sum") -> None:
        parts = self.comm._x(buf.copy())
        fn = {"sum": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}[op]
        total = parts[0].copy()
        for p in parts[1:]:
            fn(total, p, out=total)
        buf[...] = total
        self.stats.add("allreduce", buf.nbytes, buf.nbytes)

    def reduce_scatterv(self, sendbuf, recvbuf, counts, op="sum") -> None:
        full = sendbuf.copy()
        self.allreduce(full, op)
        start = displacements(counts)[self.rank]
        recvbuf[...] = full[start:start + counts[self.rank]]

    def allgatherv(self, sendbuf, recvbuf, counts) -> None:
        recvbuf[...] = np.concatenate(self.comm._x(sendbuf.copy()))

    def alltoallv(self, sendbuf, sendcounts, recvbuf, recvcounts) -> None:
        blocks = self.comm._x((sendbuf.copy(), list(sendcounts)))
        out = []
        for data, counts in blocks:
            start = displacements(counts)[self.rank]
            out.append(data[start:start + counts[self.rank]])
        recvbuf[...] = np.concatenate(out)

    def bcast(self, buf, root) -> None:
        buf[...] = self.comm._x(buf.copy())[root]

    def isend(self, buf, dest: int, tag: int = 0) -> "_Done":
        g = self.comm.group
        with g.cv:
            g.mail[(self.rank, dest, tag)].append(buf.copy())
            g.cv.notify_all()
        return _Done()

    def irecv(self, buf, source: int, tag: int = 0) -> "_Recv":
        return _Recv(self.comm.group, (source, self.rank, tag), buf)

    def barrier(self) -> None:
        self.comm.Barrier()

    def split(self, color: int, key: int, name: str) -> "ThreadHostComm":
        return ThreadHostComm(self.comm.Split(color, key), name)

    def free(self) -> None:
        pass


def thread_worlds(size: int) -> list[ThreadHostComm]:
    """One host world communicator per thread rank."""
    group = _Group(size)
    return [ThreadHostComm(ThreadMPIComm(group, r)) for r in range(size)]


def run_ranks(size: int, fn: Callable[[int], Any]) -> list:
    """``fn(rank)`` on ``size`` threads; re-raises the first failure."""
    out: list = [None] * size
    errors: list = []

    def body(r: int) -> None:
        try:
            out[r] = fn(r)
        except BaseException as exc:  # noqa: BLE001 - reported to the test below
            errors.append((r, exc))

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(4 * TIMEOUT)
    if errors:
        rank, exc = errors[0]
        raise AssertionError(f"thread rank {rank} failed: {exc!r}") from exc
    assert not any(t.is_alive() for t in threads), "a thread rank hung"
    return out
