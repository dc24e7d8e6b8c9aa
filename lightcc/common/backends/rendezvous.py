"""The MPI-free start: ranks find each other through a store and connect lightcc's TCP links
between every pair (the data plane of :mod:`.tcpcomm`).

Steps, each bounded by the rendezvous timeout (``LCC_RENDEZVOUS_TIMEOUT``):

1. every rank claims its rank (``add``: a second claim names the rank claimed twice), and
   publishes its world size, host name, listening port and addresses;
2. rank 0 publishes the job's secret (8 random bytes); every listener accepts a connection
   only when its hello carries that secret and a rank it expects, and logs and drops any other
   (a stranger, a port scanner, a process of another job);
3. each rank connects to every lower rank (loopback on its own host) and accepts every higher
   one, then publishes whether it got all its peers; a failed pair is an error on every rank
   naming the ranks that could not connect.

Keys live under ``lightcc/<torchrun restart>/<init number>/`` so restarts and a second
``init()`` after ``shutdown()`` never read stale entries.
"""
from __future__ import annotations

import logging
import os
import pickle
import socket
import time
from typing import Any

from ..control.transport import HELLO, accept_hellos, dial
from ..exceptions import LightCCError
from .tcp import Links, _Peer, listen

log = logging.getLogger("lightcc")
_inits = [0]


def next_prefix() -> str:
    """The keys of this process's next ``init()`` (see module docstring)."""
    _inits[0] += 1
    return f"lightcc/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{_inits[0]}/"


def _get(store: Any, key: str, timeout: float, failed_key: str = "") -> bytes | None:
    """``store``'s value of ``key``, or None when it is not set within ``timeout`` seconds; a
    :class:`LightCCError` when another rank published why the rendezvous failed
    (``failed_key``) or the store itself is gone (its host, rank 0, exited)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if store.check([key]):
                return store.get(key)
            if failed_key and store.check([failed_key]):
                raise LightCCError(store.get(failed_key).decode())
        except LightCCError:
            raise
        except Exception as exc:  # noqa: BLE001 - torch's and lightcc's stores raise several
            raise LightCCError(f"the rendezvous store stopped answering ({exc}); rank 0, "
                               f"which serves it, may have exited") from None
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.02)


#: how long a rank that found the rendezvous failed keeps the store up (rank 0 serves it) so
#: the others read why, instead of only seeing the store vanish
LINGER_S = 1.0


#: seconds between rank 0's lines naming the ranks a rendezvous still waits for (the MPI-free
#: start's counterpart of lccrun's "6/8 ranks up" line)
PROGRESS_S = 5.0


def _gather(store: Any, prefix: str, what: str, size: int, timeout: float,
            where: str, report: bool = False) -> list[Any]:
    """Every rank's published ``what``; a :class:`LightCCError` naming the ranks missing, the
    same on every rank (the first to time out publishes it). ``report`` (rank 0): every
    :data:`PROGRESS_S` seconds of waiting, a log line saying how many ranks arrived and which
    are missing."""
    out: list[Any] = []
    start = time.monotonic()
    deadline, next_line = start + timeout, start + PROGRESS_S
    for r in range(size):
        while True:
            until = min(deadline, next_line) if report else deadline
            raw = _get(store, f"{prefix}{what}/{r}", max(0.0, until - time.monotonic()),
                       prefix + "failed")
            if raw is not None or time.monotonic() >= deadline:
                break
            if time.monotonic() >= next_line:
                late = [q for q in range(size) if not store.check([f"{prefix}{what}/{q}"])]
                log.warning("lightcc: rendezvous at %s: %d/%d ranks arrived after %.0f s; "
                            "waiting for ranks %s", where, size - len(late), size,
                            time.monotonic() - start, late)
                next_line += PROGRESS_S
        if raw is None:
            missing = [q for q in range(size) if not store.check([f"{prefix}{what}/{q}"])]
            dup = _get(store, prefix + "duplicate", 0.0)
            extra = f"; two processes claimed RANK={dup.decode()}" if dup else ""
            message = (f"rendezvous at {where}: ranks {missing} of world size {size} did not "
                       f"arrive within {timeout:.0f} s (started with a smaller world, or "
                       f"failed before init?){extra}")
            store.set(prefix + "failed", message)
            time.sleep(LINGER_S)
            raise LightCCError(message)
        out.append(pickle.loads(raw))
    return out


def connect(store: Any, rank: int, size: int, timeout: float, control_addr: str = "",
            where: str = "the store", prefix: str = "") -> tuple[Links, list[str], bytes]:
    """This rank's TCP links to every other rank, every rank's host name and the job's secret
    (collective over the ``size`` ranks that share ``store``; see module docstring).
    ``prefix``: the keys' prefix, the same on every rank (default :func:`next_prefix`)."""
    prefix = prefix or next_prefix()
    if store.add(f"{prefix}claim/{rank}", 1) > 1:
        store.set(prefix + "duplicate", str(rank))
        raise LightCCError(f"rendezvous at {where}: two processes claim RANK={rank}; each "
                           f"process of the job needs its own rank")
    listener, addrs = listen(size, control_addr)
    host = socket.gethostname()
    if rank == 0:
        store.set(prefix + "secret", os.urandom(8))
    store.set(f"{prefix}addr/{rank}", pickle.dumps((listener.getsockname()[1], addrs, host,
                                                    size)))
    try:
        infos = _gather(store, prefix, "addr", size, timeout, where, report=rank == 0)
        dup = _get(store, prefix + "duplicate", 0.0)
        if dup:
            raise LightCCError(f"rendezvous at {where}: two processes claim "
                               f"RANK={dup.decode()}")
        sizes = {r: info[3] for r, info in enumerate(infos) if info[3] != size}
        if sizes:
            raise LightCCError(f"rendezvous at {where}: this rank has WORLD_SIZE={size}, but "
                               f"ranks {sorted(sizes)} have {sorted(set(sizes.values()))}")
        secret = _get(store, prefix + "secret", timeout)
        if secret is None:
            raise LightCCError(f"rendezvous at {where}: rank 0 never published the job's secret")
        socks: dict[int, socket.socket] = {}
        for peer in range(rank):
            port, remote, peer_host, _ = infos[peer]
            tried = (["127.0.0.1"] if peer_host == host else []) + list(remote)
            sock = dial(tried, port, HELLO.pack(secret, rank), reply=HELLO.pack(secret, peer))
            if sock is not None:
                socks[peer] = sock
        socks.update(accept_hellos(listener, secret, set(range(rank + 1, size)),
                                   reply=HELLO.pack(secret, rank), timeout=timeout))
    finally:
        listener.close()
    missing = [p for p in range(size) if p != rank and p not in socks]
    store.set(f"{prefix}links/{rank}", pickle.dumps(missing))
    report = _gather(store, prefix, "links", size, timeout, where)
    bad = sorted({(min(r, p), max(r, p)) for r, miss in enumerate(report) for p in miss})
    if bad:
        for sock in socks.values():
            sock.close()
        raise LightCCError(f"rendezvous at {where}: lightcc's TCP links could not connect the "
                           f"pairs of ranks {bad}; set LCC_CONTROL_ADDR to an interface every "
                           f"host has")
    links = Links("mesh", rank, size)
    for peer, sock in sorted(socks.items()):
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        links.peers[peer] = _Peer(links, peer, sock)
    return links, [info[2] for info in infos], secret
