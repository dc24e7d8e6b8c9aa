"""The rendezvous store: torch's ``TCPStore`` when torch is installed, else a small one of
lightcc's own, so the NumPy core never needs torch.

Both offer what the rendezvous uses: ``set(key, bytes)``, ``get(key)`` (waits for the key),
``add(key, n)`` (atomic, returns the new value) and ``check(keys)``. lightcc's own store is a
thread per client on rank 0's ``MASTER_ADDR:MASTER_PORT``; a request is one pickled tuple
framed by its 4-byte length. Like torch's TCPStore it has no authentication: only the job's
rendezvous data lives there, and the job's secret (:mod:`.rendezvous`) is checked by every
listener that carries data.
"""
from __future__ import annotations

import importlib.util
import os
import pickle
import socket
import struct
import sys
import threading
import time
from datetime import timedelta
from typing import Any

from ..control.transport import _recv_exactly
from ..exceptions import LightCCError

_LEN = struct.Struct("<I")
RETRY_S = 0.2               # between connection attempts to a store not yet listening


def _send(sock: socket.socket, obj: Any) -> None:
    data = pickle.dumps(obj)
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv(sock: socket.socket) -> Any:
    (n,) = _LEN.unpack(_recv_exactly(sock, _LEN.size))
    return pickle.loads(_recv_exactly(sock, n))


class _Server:
    """lightcc's store server (rank 0): a dict, a condition, a thread per connection."""

    def __init__(self, port: int) -> None:
        self.data: dict[str, Any] = {}
        self.cond = threading.Condition()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("", port))
        self.sock.listen(128)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, name="lightcc-store", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while True:
                op, key, arg = _recv(conn)
                _send(conn, self._do(op, key, arg))
        except (OSError, EOFError, ValueError, pickle.UnpicklingError):
            conn.close()

    def _do(self, op: str, key: Any, arg: Any) -> Any:
        with self.cond:
            if op == "set":
                self.data[key] = arg
                self.cond.notify_all()
                return None
            if op == "add":
                self.data[key] = int(self.data.get(key, 0)) + int(arg)
                self.cond.notify_all()
                return self.data[key]
            if op == "check":
                return all(k in self.data for k in key)
            if op == "get":          # arg: seconds to wait for the key
                ok = self.cond.wait_for(lambda: key in self.data, timeout=arg)
                return ("ok", self.data[key]) if ok else ("timeout", None)
        raise ValueError(op)

    def close(self) -> None:
        self.sock.close()


class LightStore:
    """A client of lightcc's store (and the server, on rank 0); torch's ``TCPStore`` calls."""

    def __init__(self, host: str, port: int, is_master: bool, timeout: float) -> None:
        self.timeout = timeout
        self.server = _Server(port) if is_master else None
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.sock = socket.create_connection((host, port), timeout=max(0.1, timeout))
                break
            except OSError as exc:
                if time.monotonic() >= deadline:
                    raise LightCCError(f"cannot reach the rendezvous store at {host}:{port} "
                                       f"within {timeout:.0f} s: {exc}") from None
                time.sleep(RETRY_S)
        # a store that never answers (not lightcc's) is an error, not a hang
        self.sock.settimeout(timeout + 5.0)
        self.lock = threading.Lock()
        try:
            self.check(["lightcc"])
        except (OSError, EOFError, ValueError, pickle.UnpicklingError) as exc:
            self.sock.close()
            raise LightCCError(f"the rendezvous store at {host}:{port} does not answer as "
                               f"lightcc's store does ({exc}); without torch installed, no "
                               f"other process may serve MASTER_PORT") from None

    def _call(self, op: str, key: Any, arg: Any = None) -> Any:
        with self.lock:
            _send(self.sock, (op, key, arg))
            return _recv(self.sock)

    def set(self, key: str, value: bytes | str) -> None:
        self._call("set", key, value.encode() if isinstance(value, str) else bytes(value))

    def add(self, key: str, amount: int) -> int:
        return int(self._call("add", key, amount))

    def check(self, keys: list[str]) -> bool:
        return bool(self._call("check", list(keys)))

    def get(self, key: str) -> bytes:
        status, value = self._call("get", key, self.timeout)
        if status != "ok":
            raise TimeoutError(f"key {key!r} not set within {self.timeout:.0f} s")
        return value

    def close(self) -> None:
        self.sock.close()
        if self.server is not None:
            self.server.close()


def torch_available() -> bool:
    """Whether torch is installed (importing it is left to :func:`open_store`)."""
    if "torch" in sys.modules:
        return sys.modules["torch"] is not None
    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):
        return False


def open_store(host: str, port: int, rank: int, size: int, timeout: float) -> Any:
    """The job's rendezvous store at ``host:port``: rank 0 starts it (unless torchrun's agent
    already serves it there, ``TORCHELASTIC_USE_AGENT_STORE=True``), the others connect.
    Raises :class:`LightCCError` naming the address when it cannot be reached in ``timeout``
    seconds."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    is_master = rank == 0 and not agent
    if not torch_available():
        if agent:
            raise LightCCError("torchrun's agent serves the rendezvous store "
                               "(TORCHELASTIC_USE_AGENT_STORE=True), and talking to it needs "
                               "torch, which is not installed in this process")
        return LightStore(host, port, is_master, timeout)
    import torch.distributed as dist

    try:
        return dist.TCPStore(host, port, size, is_master, timeout=timedelta(seconds=timeout),
                             wait_for_workers=False)
    except Exception as exc:  # noqa: BLE001 - torch raises several kinds; name the address
        what = "start" if is_master else "reach"
        raise LightCCError(f"cannot {what} the rendezvous store at {host}:{port} (MASTER_ADDR, "
                           f"MASTER_PORT) within {timeout:.0f} s: {exc}") from None
