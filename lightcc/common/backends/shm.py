"""Same-host shared memory for :class:`~.tcpcomm.TCPCommunicator`'s large allreduces, when every
member of the communicator runs on this host (the MPI-free plane's data path on one machine).

Why: over loopback every byte of an allreduce is copied by the kernel twice per link (into the
sender's socket buffer, out into the receiver's buffer) by the links' threads. Through a segment
all ranks map, each byte is copied in once, reduced once by one rank, and copied out once.

Setup (collective, on the communicator's first large allreduce): its rank 0 creates a file in
``/dev/shm`` with ``O_CREAT | O_EXCL`` and mode 0600 under a random 128-bit name, and sends the
name to the others over the job's authenticated TCP links (so only the job's ranks learn it);
every member maps it and says whether it could; rank 0 then unlinks it, whatever the answers,
so the name is gone from ``/dev/shm`` before any data moves and a rank that crashes later
leaks nothing (the memory is freed when the last process unmaps it). A member that cannot open
the name (another host, another ``/dev/shm``) makes the whole communicator keep the TCP path.
Members on hosts of different names never use it, even when they share ``/dev/shm`` (the
simulated hosts of tests/netns, one network namespace and UTS name each, must cross their
simulated links). ``multiprocessing.shared_memory`` is not used: its resource tracker unlinks a segment when any
attached process exits.

Allreduce, in chunks of :data:`CHUNK_BYTES`, two sets of slots used alternately: every rank
copies its chunk ``k`` into its input slot; one barrier; each rank reduces its 1/n slice of the
chunk across the n inputs, in rank order (the same bits on every rank), into the set's output
slot, and copies its next chunk in; one barrier; every rank copies chunk ``k``'s output out.
So a chunk costs one barrier; a rank rewrites a set's input slot only after a barrier that every
reader of that slot has passed. Barriers (:data:`FLAG_BARRIER`): on x86 a flag word per rank in
the segment, polled with sleeps that grow with the wait (measured in a 2-rank training run:
0.92x the MPI path's images/s with them, 0.80-0.88x with link messages, whose every barrier
wakes two threads per rank); elsewhere one-byte messages over the links.
"""
from __future__ import annotations

import logging
import mmap
import os
import platform
import secrets
import socket
import time
from typing import Any, Callable

import numpy as np

log = logging.getLogger("lightcc")

#: bytes of the buffer each step moves through the segment (the segment holds 2 (n + 1) of them)
CHUNK_BYTES = 4 << 20
DIRECTORY = "/dev/shm"
FLAG_BYTES = 4096
#: barriers on flag words in the segment where stores are seen in program order (x86's TSO);
#: elsewhere one-byte messages over the links, whose syscalls order the memory accesses
FLAG_BARRIER = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def _create(size: int) -> tuple[str, int] | None:
    """A new 0600 file of ``size`` bytes under a random name: (path, fd), or None."""
    for _ in range(4):
        path = os.path.join(DIRECTORY, f"lightcc-{secrets.token_hex(16)}")
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except FileExistsError:
            continue
        except OSError as exc:
            log.debug("shared memory: cannot create a segment in %s (%s)", DIRECTORY, exc)
            return None
        try:
            os.ftruncate(fd, size)
        except OSError:
            os.close(fd)
            os.unlink(path)
            return None
        return path, fd
    return None


def _map(path: str, size: int) -> mmap.mmap | None:
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return None
    try:
        if os.fstat(fd).st_size != size:
            return None
        return mmap.mmap(fd, size)
    except OSError:
        return None
    finally:
        os.close(fd)


class Segment:
    """The shared slots of one communicator (see module docstring)."""

    def __init__(self, buf: mmap.mmap, rank: int, size: int, path: str) -> None:
        self._mmap, self.rank, self.size, self.path = buf, rank, size, path
        raw = np.frombuffer(buf, np.uint8)
        self.slots = raw[:-FLAG_BYTES].reshape(2, size + 1, CHUNK_BYTES)  # [set, input / output]
        self._flags = raw[-FLAG_BYTES:].view(np.int64)[:size * 8:8]     # a cache line each
        self._epoch = 0

    @classmethod
    def open(cls, rank: int, size: int, gather: Callable[[Any], list]) -> "Segment | None":
        """The communicator's segment, or None when some member cannot map it (collective:
        ``gather`` is the communicator's ``allgather_object`` over its TCP links)."""
        nbytes = 2 * (size + 1) * CHUNK_BYTES + FLAG_BYTES
        made = _create(nbytes) if rank == 0 else None
        try:
            every = gather((made[0] if made else None, socket.gethostname()))
            path = every[0][0] if len({host for _, host in every}) == 1 else None
            mapped = _map(path, nbytes) if path else None
            every = gather(mapped is not None)
        finally:
            if made:
                os.close(made[1])
                os.unlink(made[0])
        if not all(every):
            if mapped is not None:
                mapped.close()
            return None
        (log.info if rank == 0 else log.debug)("shared memory: %d ranks of this host reduce through %s (%d MB, unlinked)",
                 size, path, nbytes >> 20)
        return cls(mapped, rank, size, path)

    def allreduce(self, flat: np.ndarray, ufunc: Any, barrier: Callable[[], None]) -> None:
        """Reduce ``flat`` (contiguous, the same length on every member) in place."""
        n, me = self.size, self.rank
        per = CHUNK_BYTES // flat.itemsize
        starts = list(range(0, flat.size, per))

        def slot(k: int, i: int) -> np.ndarray:
            count = min(per, flat.size - starts[k])
            return self.slots[k % 2, i, :count * flat.itemsize].view(flat.dtype)

        def reduce(k: int) -> None:
            count = min(per, flat.size - starts[k])
            lo, hi = count * me // n, count * (me + 1) // n
            out = slot(k, n)[lo:hi]
            ufunc(slot(k, 0)[lo:hi], slot(k, 1)[lo:hi], out=out)
            for r in range(2, n):
                ufunc(out, slot(k, r)[lo:hi], out=out)

        def put(k: int) -> None:
            slot(k, me)[...] = flat[starts[k]:starts[k] + per]

        put(0)
        barrier()
        for k in range(len(starts)):
            reduce(k)
            if k + 1 < len(starts):
                put(k + 1)
            barrier()
            flat[starts[k]:starts[k] + per] = slot(k, n)

    def barrier(self, check: Callable[[], None]) -> None:
        """Every member's flag word set to this barrier's number. A wait polls them, sleeping a
        quarter of the time waited so far (20 us .. 1 ms) between polls, so a long wait costs
        few wake-ups and a short one little latency; ``check`` raises when a member's link
        failed (it exited), so a wait never outlives its peer."""
        self._epoch += 1
        self._flags[self.rank] = self._epoch
        start = time.perf_counter()
        while self._flags.min() < self._epoch:
            waited = time.perf_counter() - start
            if waited > 0.01:
                check()
            time.sleep(min(max(waited / 4, 20e-6), 1e-3))

    def close(self) -> None:
        self.slots = None
        try:
            self._mmap.close()
        except BufferError:          # a view still alive: the mapping goes with the process
            pass
