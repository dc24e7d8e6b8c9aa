"""Point-to-point ``send`` / ``recv`` of the lightcc process group, beside the engine.

Point-to-point messages cannot be negotiated (only two ranks take part), so they bypass the
engine: each group owns a communicator of its own (``backends.mpi.p2p_communicator``, made
collectively when the group is created, see :func:`make_comm`) and a send/recv is one
nonblocking ``isend`` / ``irecv`` on it, from the calling thread; this needs
``MPI_THREAD_MULTIPLE`` beside the engine's thread. MPI matches messages by (source, tag) in
posting order, which is torch's contract for send/recv.
A wait polls the request with a short back-off and gives up after the group's timeout with an
error naming the peer and tag (a pending receive is cancelled), so a recv whose sender never
comes fails instead of hanging silently.
"""
from __future__ import annotations

import threading
import time
from typing import Any

import torch

from ...common.backends import mpi as mpi_backend
from ...common.exceptions import InvalidArgumentError, LightCCError
from .._tensor import host_stage
from .untraced import untraced
from .work import CollectiveTimeout, FutureWork, seconds

MAX_BACKOFF_S = 0.001


def make_comm(world_ranks: list[int] | None) -> Any:
    """A communicator for the group's point-to-point traffic (collective over its members).

    ``None``: the whole world; else the members only, so non-members need not take part.
    Returns None when MPI lacks ``MPI_THREAD_MULTIPLE``.
    """
    return mpi_backend.p2p_communicator(world_ranks, "c10d.p2p")


def free_comm(comm: Any) -> None:
    if comm is not None:
        comm.free()


@untraced
class P2PWork(FutureWork):
    """One send or receive; ``wait()`` polls its request until done or timed out."""

    def __init__(self, request: Any, what: str, key: str, timeout: float,
                 staged: Any = None, nbytes: int = 0) -> None:
        super().__init__(what, key, timeout)
        self._req = request
        self._staged = staged                  # set for receives: copy back, check size
        self._nbytes = nbytes
        self._state: Any = None

    def _test(self) -> bool:
        with self._lock:
            if self._state is not None:
                return True
            try:
                if not self._req.test():
                    return False
                self._state = self._check()
            except Exception as exc:  # noqa: BLE001 - MPI errors (e.g. truncation) -> ours
                self._state = LightCCError(f"{self._what} failed: {exc}")
            return True

    def _check(self) -> Any:
        if self._staged is None:
            return True
        got = self._req.nbytes
        if got != self._nbytes:
            return LightCCError(f"{self._what}: rank {self._req.source} sent {got} "
                                f"bytes, the receive tensor holds {self._nbytes}")
        self._staged.finish()
        return True

    def wait(self, timeout: Any = None) -> bool:
        limit = seconds(timeout, self._timeout)
        deadline = time.monotonic() + limit
        pause = 1e-5
        while not self._test():
            if time.monotonic() > deadline:
                self._give_up(limit)
            time.sleep(pause)
            pause = min(pause * 2, MAX_BACKOFF_S)
        if self._state is not True:
            raise self._state
        return True

    def _give_up(self, limit: float) -> None:
        with self._lock:
            if self._staged is not None and self._state is None:   # a receive: cancel it
                self._req.cancel()
                self._state = CollectiveTimeout(f"{self._what} did not complete within "
                                                f"{limit:g} s: Timed out (no matching send "
                                                f"arrived)")
        raise CollectiveTimeout(f"{self._what} did not complete within {limit:g} s: "
                                f"Timed out (the peer never posted the matching "
                                f"receive/send)")

    def _future_value(self) -> list[torch.Tensor]:
        return [] if self._staged is None else [self._staged.tensor]

    def is_completed(self) -> bool:
        return self._test()

    def is_success(self) -> bool:
        return self._test() and self._state is True

    def exception(self) -> Any:
        return None if not self._test() or self._state is True else self._state

    def _source_rank(self) -> int:
        self.wait()
        return self._req.source

    def source_rank(self) -> int:
        return self._source_rank()

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._future_value()


class PointToPoint:
    """The send/recv half of one process group."""

    def __init__(self, comm: Any, group_desc: str, timeout: float) -> None:
        self.comm = comm
        self.desc = group_desc
        self.timeout = timeout
        self._counts: dict[tuple[str, int], int] = {}
        self._lock = threading.Lock()

    def _key(self, kind: str, peer: int) -> str:
        with self._lock:
            n = self._counts.get((kind, peer), 0)
            self._counts[(kind, peer)] = n + 1
        return f"{self.desc}.{kind}{peer}.{n}"

    def _ready(self, what: str, tensors: list[torch.Tensor], tag: int) -> torch.Tensor:
        if self.comm is None:
            raise LightCCError(f"{what}: point-to-point needs MPI_THREAD_MULTIPLE (MPI was "
                               f"initialized with a lower thread level)")
        if len(tensors) != 1:
            raise InvalidArgumentError(f"{what}: expected one tensor, got {len(tensors)}")
        limit = getattr(self.comm, "max_tag", None)      # MPI-free transport: its own range
        if not 0 <= int(tag) <= (mpi_backend.max_tag() if limit is None else limit):
            raise InvalidArgumentError(f"{what}: tag {tag} is outside the transport's tag "
                                       f"range")
        return tensors[0]

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> P2PWork:
        what = f"send to rank {dst} (tag {tag}) on group {self.desc}"
        t = self._ready(what, tensors, tag)
        st = host_stage(t, what)
        req = self.comm.isend(st.array, int(dst), int(tag))
        work = P2PWork(req, what, self._key("send", dst), self.timeout)
        work._keep = st                      # the buffer must live until the send completes
        return work

    def recv(self, tensors: list[torch.Tensor], src: int | None, tag: int) -> P2PWork:
        peer = "any rank" if src is None else f"rank {src}"
        what = f"recv from {peer} (tag {tag}) on group {self.desc}"
        t = self._ready(what, tensors, tag)
        st = host_stage(t, what)
        req = self.comm.irecv(st.array, None if src is None else int(src), int(tag))
        return P2PWork(req, what, self._key("recv", -1 if src is None else src),
                       self.timeout, staged=st, nbytes=st.array.nbytes)
