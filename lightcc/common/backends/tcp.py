"""Point-to-point messages between hosts over lightcc's own TCP connections, waited for in the
kernel (``LCC_CROSS_TRANSPORT``).

Why: Open MPI's TCP transport moves data only while some thread is inside an MPI call, and a
thread waiting in one spins (``epoll_wait(…, 0)`` and ``sched_yield`` in a loop): a rank that
waits for the wire keeps a core busy, ~half of it in the kernel, and that core is taken from
backward, from the data loader and from the other ranks of the host (docs/profile-1gbit.md).
Pausing between ``MPI_Test`` calls gives the core back but leaves the next piece unsent for the
pause (10-25 % slower fp16 training at 1 Gbit, measured). Here a sender thread and a receiver
thread per peer block in ``send``/``recv`` in the kernel, so the wire is fed as fast as it
drains and waiting costs nothing: measured on 2 simulated hosts at 1 Gbit, a 4-64 MB exchange
ran at the same 114-117 MB/s as ``MPI_Allreduce`` with 11-13 % of a core instead of 100 %.

Scope: :class:`Links` carries the ``isend``/``irecv`` of one host communicator whose members
are all on different hosts (a topology's ``cross`` communicator, and ``world`` when every
host has one rank); that is the traffic of the ``ring`` algorithm, of ``hierarchical``'s
cross-host phase and of the compressors' pipelined exchange. Collectives on the same
communicator stay MPI's. A message is a 16-byte header (tag, length) and the bytes; messages
from one peer are matched to receives by tag in the order they were sent, as MPI matches them.
A message that arrives before its receive is posted is kept in a temporary buffer.

Setup is collective over the communicator: every member listens on an ephemeral port; one
MPI allgather spreads ports, addresses (``transport.candidate_addresses``, the interface
``LCC_CONTROL_ADDR`` names where it names one) and host names; each member connects to every
lower member (the loopback address on its own host) and accepts every higher one.
"""
from __future__ import annotations

import os
import queue
import socket
import struct
import threading
from collections import deque
from typing import Any

import numpy as np

from ..control.transport import (
    HELLO,
    accept_hellos,
    candidate_addresses,
    dial,
    interface_addresses,
)
from ..exceptions import LightCCError

_HDR = struct.Struct("<qq")            # tag, payload bytes
#: Largest single ``recv``/``send`` call (bytes): one GIL round trip per piece this size.
PIECE_BYTES = 8 << 20


def _bytes(buf: np.ndarray) -> memoryview:
    return memoryview(buf.reshape(-1).view(np.uint8))


class Request:
    """A send or receive on a :class:`Links` (the ``comm.Request`` protocol); a completed
    receive tells ``source`` and ``nbytes``."""

    __slots__ = ("_buf", "_done", "_peer", "_tag", "error", "nbytes", "source")

    def __init__(self, buf: memoryview | None, peer: _Peer, tag: int) -> None:
        self._done = threading.Event()
        self.error: BaseException | None = None
        self.source = peer.rank
        self.nbytes = 0
        self._buf, self._peer, self._tag = buf, peer, tag

    def _finish(self, error: BaseException | None = None) -> None:
        self.error = error
        self._done.set()

    def test(self) -> bool:
        if not self._done.is_set():
            return False
        if self.error is not None:
            raise self.error
        return True

    def wait(self) -> None:
        self._done.wait()
        if self.error is not None:
            raise self.error

    def cancel(self) -> None:
        """Withdraw a receive nobody has started filling; otherwise wait for it to finish."""
        if not self._peer.withdraw(self):
            self._done.wait()


class _Peer:
    """One connection: a sender thread fed by a queue, a receiver thread matching by tag."""

    def __init__(self, links: Links, rank: int, sock: socket.socket) -> None:
        self.links, self.rank, self.sock = links, rank, sock
        self.lock = threading.Lock()
        self.posted: dict[int, deque] = {}       # tag -> receives waiting for a message
        self.early: dict[int, deque] = {}        # tag -> messages that came before a receive
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.error: BaseException | None = None
        name = f"lightcc-tcp-{links.name}-{rank}"
        self.threads = [threading.Thread(target=self._send_loop, name=name + "-send", daemon=True),
                        threading.Thread(target=self._recv_loop, name=name + "-recv", daemon=True)]
        for t in self.threads:
            t.start()

    # -- sending -------------------------------------------------------------------------------
    def send(self, buf: np.ndarray, tag: int) -> Request:
        req = Request(None, self, tag)
        if self.error is not None:
            req._finish(self.error)
            return req
        self.outbox.put((tag, _bytes(buf), req))
        return req

    def _send_loop(self) -> None:
        while True:
            item = self.outbox.get()
            if item is None:
                return
            tag, data, req = item
            if self.error is not None:
                req._finish(self.error)
                continue
            try:
                self.sock.sendall(_HDR.pack(tag, len(data)))
                for start in range(0, len(data), PIECE_BYTES):
                    self.sock.sendall(data[start:start + PIECE_BYTES])
            except OSError as exc:
                self._fail(exc)
                req._finish(self.error)
                continue
            req._finish()

    # -- receiving -----------------------------------------------------------------------------
    def recv(self, buf: np.ndarray, tag: int) -> Request:
        req = Request(_bytes(buf), self, tag)
        with self.lock:
            early = self.early.get(tag)
            if early:
                data = early.popleft()
            elif self.error is not None:
                req._finish(self.error)
                return req
            else:
                self.posted.setdefault(tag, deque()).append(req)
                return req
        self._deliver(req, data)
        return req

    def withdraw(self, req: Request) -> bool:
        with self.lock:
            waiting = self.posted.get(req._tag)
            if waiting and req in waiting:
                waiting.remove(req)
                req._finish()
                return True
        return req._done.is_set()

    def _deliver(self, req: Request, data: memoryview) -> None:
        if len(data) > len(req._buf):
            req._finish(LightCCError(
                f"message of {len(data)} bytes from rank {self.rank} (tag {req._tag}) on "
                f"{self.links.name} does not fit the {len(req._buf)}-byte receive buffer"))
            return
        req._buf[:len(data)] = data
        req.nbytes = len(data)
        req._finish()

    def _read_into(self, view: memoryview) -> None:
        got = 0
        while got < len(view):
            n = self.sock.recv_into(view[got:got + PIECE_BYTES], 0, socket.MSG_WAITALL)
            if n == 0:
                raise ConnectionResetError("end of stream")
            got += n

    def _recv_loop(self) -> None:
        hdr = bytearray(_HDR.size)
        try:
            while True:
                self._read_into(memoryview(hdr))
                tag, size = _HDR.unpack(hdr)
                with self.lock:
                    waiting = self.posted.get(tag)
                    req = waiting.popleft() if waiting else None
                if req is not None and size <= len(req._buf):
                    self._read_into(req._buf[:size])
                    req.nbytes = size
                    req._finish()
                    continue
                data = memoryview(np.empty(size, np.uint8))
                self._read_into(data)
                if req is not None:
                    self._deliver(req, data)
                    continue
                with self.lock:
                    waiting = self.posted.get(tag)
                    req = waiting.popleft() if waiting else None
                    if req is None:
                        self.early.setdefault(tag, deque()).append(data)
                if req is not None:
                    self._deliver(req, data)
        except (OSError, ValueError) as exc:
            self._fail(exc)

    # -- failure and closing -------------------------------------------------------------------
    def _fail(self, exc: BaseException) -> None:
        with self.lock:
            if self.error is not None:
                return
            if self.links.closing:
                self.error = LightCCError(f"lightcc's TCP links of {self.links.name} are closed")
            else:
                self.error = LightCCError(
                    f"rank {self.rank} of communicator {self.links.name} closed its connection "
                    f"(lightcc's TCP data link: {exc}); it exited, or its host is unreachable")
            waiting = [r for reqs in self.posted.values() for r in reqs]
            self.posted.clear()
        for req in waiting:
            req._finish(self.error)

    def close(self) -> None:
        self.outbox.put(None)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        for t in self.threads:
            t.join(timeout=2.0)
        self.sock.close()


class Links:
    """TCP connections from this member of a communicator to every other member (see module
    docstring). Build with :func:`connect` (collective)."""

    def __init__(self, name: str, rank: int, size: int) -> None:
        self.name, self.rank, self.size = name, rank, size
        self.peers: dict[int, _Peer] = {}
        self.closing = False

    def isend(self, buf: np.ndarray, dest: int, tag: int) -> Request:
        return self.peers[dest].send(buf, tag)

    def irecv(self, buf: np.ndarray, source: int, tag: int) -> Request:
        return self.peers[source].recv(buf, tag)

    def close(self) -> None:
        self.closing = True
        for peer in self.peers.values():
            peer.close()
        self.peers.clear()


def listen(size: int, override: str = "") -> tuple[socket.socket, list[str]]:
    """A listener on an ephemeral port for the other ``size - 1`` members, and the addresses
    other hosts may reach it at (``override``: ``LCC_CONTROL_ADDR``, used when it names an
    interface of this host)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("", 0))
    listener.listen(max(size, 16))
    try:
        addrs = candidate_addresses(override if override in interface_addresses() else "")
    except OSError:
        addrs = []
    return listener, addrs


def connect(comm: Any, name: str, override: str = "") -> Links | None:
    """Connect every pair of members of ``comm`` (an :class:`MPICommunicator`; collective).

    ``override`` is ``LCC_CONTROL_ADDR`` (used when it names an interface of this host).
    Returns None on every member when any pair could not connect (the caller then keeps MPI).
    """
    rank, size = comm.rank, comm.size
    listener, addrs = listen(size, override)
    token = os.urandom(8)
    infos = comm.allgather_object((listener.getsockname()[1], addrs, token,
                                   socket.gethostname()))
    token = infos[0][2]
    links = Links(name, rank, size)
    socks: dict[int, socket.socket] = {}
    for peer in range(rank):               # connect down, then accept from above
        port, remote, _, host = infos[peer]
        tried = (["127.0.0.1"] if host == infos[rank][3] else []) + list(remote)
        sock = dial(tried, port, HELLO.pack(token, rank), reply=HELLO.pack(token, peer))
        if sock is not None:
            socks[peer] = sock
    socks.update(accept_hellos(listener, token, set(range(rank + 1, size)),
                               reply=HELLO.pack(token, rank)))
    listener.close()
    ok = len(socks) == size - 1
    if not all(comm.allgather_object(ok)):
        for sock in socks.values():
            sock.close()
        return None
    for peer, sock in sorted(socks.items()):
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        links.peers[peer] = _Peer(links, peer, sock)
    return links
