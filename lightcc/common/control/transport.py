"""The engine's control plane: small messages along a tree of TCP connections rooted at rank 0.

Why not MPI for these: waiting for an MPI message means polling (``Iprobe``) or sitting in a
blocking call that spins inside MPI, and both burn the core that training needs. A socket lets
the waiting thread block in the kernel (``select``) until a message arrives, a local submission
wakes it (:meth:`ControlPlane.wake`) or a deadline passes, at no CPU cost. Data still moves over
MPI; only reports and batches (tens of bytes each in steady state) travel here.

Shape: the tree of tree.py (``LCC_CONTROL_FANOUT`` children per rank; a job of up to
fanout + 1 ranks is a star around rank 0). Every rank with children listens on an ephemeral
port; during ``init()`` one MPI allgather spreads every listener's port and candidate addresses,
one broadcast rank 0's random token, and each rank connects once to its parent. Ranks on their
parent's host use the loopback address; others try the parent's interface addresses in turn
(``LCC_CONTROL_ADDR`` names the address or interface to use instead: an interface name applies
on every host, an address or host name to rank 0's host). A frame is a 4-byte little-endian
length followed by the payload. Sockets are non-blocking; unsent bytes wait in a per-connection
outbox flushed whenever the plane is polled. Only the thread holding the engine's progress lock
polls or sends; :meth:`ControlPlane.wake` may be called from any thread.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import selectors
import socket
import struct
import time
from typing import Any, Sequence

from ..exceptions import LightCCError
from .tree import DEFAULT_FANOUT, layout

log = logging.getLogger("lightcc")

_HDR = struct.Struct("<I")
HELLO = struct.Struct("<8sI")
_SIOCGIFADDR = 0x8915
CONNECT_TIMEOUT_S = 5.0     # per address tried
ACCEPT_TIMEOUT_S = 60.0     # how long rank 0 waits for every rank to connect
PROGRESS_S = 5.0            # while it waits, a log line this often naming who is missing


def interface_addresses() -> dict[str, str]:
    """IPv4 address of every configured network interface (Linux), ``{name: address}``."""
    out: dict[str, str] = {}
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return out
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for name in names:
            try:
                req = struct.pack("256s", name.encode()[:15])
                res = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)
                out[name] = socket.inet_ntoa(res[20:24])
            except OSError:
                continue
    return out


def candidate_addresses(override: str = "") -> list[str]:
    """Addresses other hosts may reach this one at, best first (loopback excluded).

    ``override`` is an address, a host name or an interface name (``LCC_CONTROL_ADDR``).
    """
    ifaces = interface_addresses()
    if override:
        if override in ifaces:
            return [ifaces[override]]
        return [socket.gethostbyname(override)]
    addrs = [a for name, a in ifaces.items() if not a.startswith("127.")]
    if not addrs:
        try:
            addrs = [a for a in socket.gethostbyname_ex(socket.gethostname())[2]
                     if not a.startswith("127.")]
        except OSError:
            addrs = []
    return addrs


class _Conn:
    __slots__ = ("sock", "rank", "inbuf", "outbuf")

    def __init__(self, sock: socket.socket, rank: int) -> None:
        self.sock = sock
        self.rank = rank
        self.inbuf = bytearray()
        self.outbuf = bytearray()


class ControlPlane:
    """Framed messages between this rank and its parent and children in the control tree
    (see module docstring).

    Collective over ``comm`` (an mpi4py communicator): every rank constructs it at once.
    """

    def __init__(self, comm: Any, hostnames: Sequence[str], override: str = "",
                 fanout: int = DEFAULT_FANOUT) -> None:
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        parents, children, _ = layout(self.size, fanout)
        self._parents = parents
        self.parent: int | None = parents[self.rank] if parents[self.rank] >= 0 else None
        self.children: tuple[int, ...] = children[self.rank]
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._wake_pending = False
        self._conns: dict[int, _Conn] = {}
        self.closed: set[int] = set()      # peers whose connection ended
        self._writing: set[int] = set()   # connections registered for EVENT_WRITE
        if self.size > 1:
            self._bootstrap(comm, list(hostnames), override)

    # ---- setup ---------------------------------------------------------------------------------
    def _bootstrap(self, comm: Any, hostnames: list[str], override: str) -> None:
        listener = None
        info = None
        if self.children:
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("", 0))
            listener.listen(min(len(self.children) + 16, 4096))
            try:
                remote = advertised_addresses(override, hostnames[self.rank] == hostnames[0])
            except OSError as exc:
                remote = []
                log.warning("LCC_CONTROL_ADDR=%r: %s", override, exc)
            info = (listener.getsockname()[1], remote)
        token = comm.bcast(os.urandom(8) if self.rank == 0 else None, root=0)
        infos = comm.allgather(info)
        ok = True
        if self.parent is not None:          # the parent's backlog holds us until it accepts
            port, remote = infos[self.parent]
            same_host = hostnames[self.rank] == hostnames[self.parent]
            tried = (["127.0.0.1"] if same_host and not override else []) + list(remote)
            ok = self._connect(tried, port, token)
        if listener is not None:
            self._accept_all(listener, token, set(self.children))
            listener.close()
        unheard = [c for c in self.children if c not in self._conns]
        report = comm.allgather((ok, unheard))
        bad = sorted({r for r, (good, _) in enumerate(report) if not good} |
                     {c for _, missing in report for c in missing})
        if bad:
            self.close()
            parent = max(self._parents[bad[0]], 0)
            port, remote = infos[parent] or (0, [])
            raise LightCCError(
                f"lightcc's control connection to rank {parent} (port {port}, addresses "
                f"{remote or ['none found']}) failed on ranks {bad}; set LCC_CONTROL_ADDR to an "
                f"address or interface of that host that every rank can reach")

    def _connect(self, addrs: list[str], port: int, token: bytes) -> bool:
        sock = dial(addrs, port, HELLO.pack(token, self.rank))
        if sock is None:
            return False
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._add(sock, self.parent)
        return True

    def _accept_all(self, listener: socket.socket, token: bytes, expected: set[int]) -> None:
        """Accept every child's connection, or stop at the deadline."""
        for rank, sock in accept_hellos(listener, token, expected).items():
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._add(sock, rank)

    def _add(self, sock: socket.socket, rank: int) -> None:
        sock.setblocking(False)
        conn = _Conn(sock, rank)
        self._conns[rank] = conn
        self._sel.register(sock, selectors.EVENT_READ, conn)

    # ---- sending -------------------------------------------------------------------------------
    def send(self, dest: int, payload: bytes) -> None:
        """Queue one frame for ``dest`` (this rank's parent or a child) and send what the socket
        takes now; the rest goes out on later calls."""
        conn = self._conns.get(dest)
        if conn is None:
            return        # the peer is gone (closed); the engine learns it from ``closed``
        conn.outbuf += _HDR.pack(len(payload))
        conn.outbuf += payload
        self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        while conn.outbuf:
            try:
                sent = conn.sock.send(conn.outbuf)
            except BlockingIOError:
                break
            except OSError:
                self._drop(conn)
                return
            del conn.outbuf[:sent]
        want_write = bool(conn.outbuf)
        if want_write != (conn.rank in self._writing):
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if want_write else 0)
            self._sel.modify(conn.sock, events, conn)
            (self._writing.add if want_write else self._writing.discard)(conn.rank)

    def pending_output(self) -> bool:
        return bool(self._writing)

    # ---- receiving -----------------------------------------------------------------------------
    def poll(self, timeout: float) -> list[tuple[int, bytes]]:
        """Frames that arrived, as ``(source rank, payload)``; waits up to ``timeout`` seconds
        (0: do not wait) for the first one, a :meth:`wake`, or a peer closing."""
        frames: list[tuple[int, bytes]] = []
        for key, events in self._sel.select(max(timeout, 0.0)):
            conn = key.data
            if conn is None:
                self._drain_wake()
                continue
            if events & selectors.EVENT_WRITE:
                self._flush(conn)
            if events & selectors.EVENT_READ:
                self._read(conn, frames)
        return frames

    def wait(self, timeout: float) -> None:
        """Block up to ``timeout`` seconds until a frame can be read, output can be flushed, a
        peer closed or :meth:`wake` was called; reads nothing (the next :meth:`poll` does), so
        it may run while another thread polls."""
        for key, _ in self._sel.select(max(timeout, 0.0)):
            if key.data is None:
                self._drain_wake()

    def _read(self, conn: _Conn, frames: list[tuple[int, bytes]]) -> None:
        while True:
            try:
                data = conn.sock.recv(1 << 20)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
                    break
                data = b""
            if not data:
                self._drop(conn)
                break
            conn.inbuf += data
            if len(data) < (1 << 20):
                break
        buf = conn.inbuf
        at = 0
        while len(buf) - at >= 4:
            (n,) = _HDR.unpack_from(buf, at)
            if len(buf) - at - 4 < n:
                break
            frames.append((conn.rank, bytes(buf[at + 4:at + 4 + n])))
            at += 4 + n
        if at:
            del buf[:at]

    def _drop(self, conn: _Conn) -> None:
        if self._conns.pop(conn.rank, None) is None:
            return
        self.closed.add(conn.rank)
        self._writing.discard(conn.rank)
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    # ---- waking ---------------------------------------------------------------------------------
    def wake(self) -> None:
        """Make a thread blocked in :meth:`poll` return now (any thread; cheap when repeated)."""
        if self._wake_pending:
            return
        self._wake_pending = True
        try:
            self._wake_w.send(b"w")
        except (BlockingIOError, OSError):
            pass

    def _drain_wake(self) -> None:
        # read first, then clear the flag: a wake() racing with this either finds the flag
        # still set (the polling thread is awake anyway and re-checks its work before it
        # blocks again) or sends a fresh byte that the next poll() sees
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass
        self._wake_pending = False

    def close(self) -> None:
        """Flush what is queued (briefly), then close every connection."""
        deadline = time.monotonic() + 1.0
        while self._writing and time.monotonic() < deadline:
            self.poll(0.01)
        for conn in list(self._conns.values()):
            self._drop(conn)
        for s in (self._wake_r, self._wake_w):
            try:
                self._sel.unregister(s)
            except (KeyError, ValueError):
                pass
            s.close()
        self._sel.close()


def advertised_addresses(override: str, on_rank0_host: bool) -> list[str]:
    """What a listening rank advertises: ``LCC_CONTROL_ADDR`` when it names rank 0's host (an
    address or host name, on that host) or an interface this host has; else every address."""
    if override and (on_rank0_host or override in interface_addresses()):
        return candidate_addresses(override)
    return candidate_addresses()


def dial(addrs: list[str], port: int, hello: bytes,
         reply: bytes | None = None) -> socket.socket | None:
    """A connection to ``port`` at the first of ``addrs`` that answers, after sending
    ``hello``; with ``reply``, only one whose listener sends back exactly those bytes (a stray
    listener on the same port of another host is skipped). None when no address works."""
    for addr in addrs:
        try:
            sock = socket.create_connection((addr, port), timeout=CONNECT_TIMEOUT_S)
        except OSError as exc:
            log.debug("connection to %s:%d failed: %s", addr, port, exc)
            continue
        try:
            sock.sendall(hello)
            if reply is None:
                return sock
            sock.settimeout(ACCEPT_TIMEOUT_S)
            if _recv_exactly(sock, len(reply)) == reply:
                return sock
        except (OSError, ValueError) as exc:
            log.debug("connection to %s:%d: no handshake: %s", addr, port, exc)
        sock.close()
    return None


def accept_hellos(listener: socket.socket, token: bytes, expected: set[int],
                  reply: bytes | None = None,
                  timeout: float | None = None) -> dict[int, socket.socket]:
    """Connections whose hello carries ``token`` and a rank of ``expected`` (one each), until
    all came or ``timeout`` seconds (default :data:`ACCEPT_TIMEOUT_S`) passed; ``reply`` is sent back on each. Any other
    connection (a stranger without the job's secret, a rank claimed twice) is logged and
    closed before a byte of it is read as data."""
    got: dict[int, socket.socket] = {}
    deadline = time.monotonic() + (ACCEPT_TIMEOUT_S if timeout is None else timeout)
    note = time.monotonic() + PROGRESS_S       # start-up progress, as lccrun prints it
    while not expected <= got.keys():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        listener.settimeout(max(0.01, min(remaining, note - time.monotonic())))
        try:
            sock, peer = listener.accept()
        except TimeoutError:
            if time.monotonic() >= note and time.monotonic() < deadline:
                note += PROGRESS_S
                log.warning("%d/%d connected; waiting for %s to connect (the rest of "
                            "%.0f s)", len(got), len(expected),
                            _ranks_text(sorted(expected - got.keys())),
                            deadline - time.monotonic())
            continue
        except OSError:
            break
        try:
            sock.settimeout(min(max(1.0, remaining), 10.0))
            theirs, rank = HELLO.unpack(_recv_exactly(sock, HELLO.size))
            if theirs != token or rank not in expected or rank in got:
                raise ValueError("its hello does not carry this job's secret and an expected "
                                 "rank")
            if reply is not None:
                sock.sendall(reply)
        except (OSError, ValueError, struct.error) as exc:
            log.warning("dropped a connection from %s on lightcc's listener port %d: %s",
                        peer, listener.getsockname()[1], exc)
            sock.close()
            continue
        got[rank] = sock
    return got


def _ranks_text(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise ValueError("connection closed during the handshake")
        buf += part
    return buf
