"""Flight recorder: each rank remembers its last ``LCC_FLIGHT_RECORDS`` collectives and, when
something goes wrong, writes them out with the Python stack of every thread.

What is recorded (one small :class:`Record` per submission): sequence number, the request
(collective type, name or ordered-stream position, dtype, shape, process set), submitting
thread, submit time and completion time / error. Nothing is formatted until a dump. A record
never holds the handle: a handle keeps its result (a gradient, a reduced array) alive, and a
ring of 256 handles kept the last ~40 steps' gradients of a model alive, so every step's
gradients came from new memory that the kernel had to fault in (a 7 M-parameter MLP's step
went from 0 to ~7,200 page faults and trained 30-50 % slower; a 25 M one held ~4 GB more).

When a rank writes its record (``LCC_FLIGHT_DIR`` set; lccrun sets it to a directory of its
own): on ``SIGUSR1``; when a collective fails with :class:`StallError` or
:class:`ShutdownError` (stall timeout, lost rank, remote shutdown); and when the lccrun rank
wrapper sees the script end on an uncaught exception. The file is
``<dir>/rank<N>.json``; ``<dir>/rank<N>.pid`` lets lccrun signal the rank processes (and only
them). As a fallback for a thread stuck inside C code, where no Python signal handler can run,
:mod:`faulthandler` appends every thread's stack to ``<dir>/rank<N>.stacks`` on the same
signal. lccrun reads the files with :mod:`lightcc.runner.flight_summary`.

Blocking unnamed small allreduces on the direct path (see docs/architecture.md) never reach the
engine's queue and are not recorded.
"""
from __future__ import annotations

import faulthandler
import glob
import itertools
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections import deque
from typing import Any

from ..exceptions import ShutdownError, StallError

log = logging.getLogger("lightcc")

RECORDS_ENV = "LCC_FLIGHT_RECORDS"
DIR_ENV = "LCC_FLIGHT_DIR"
LOCK_WAIT_S = 1.0             # see dump()
PEER_WAIT_S = 3.0             # see dump_on_exit()
MIN_DUMP_INTERVAL_S = 1.0     # a burst of failing handles writes one file, not hundreds

_active: FlightRecorder | None = None


class Record:
    """One submission as the recorder keeps it: the request's metadata and how it ended."""

    __slots__ = ("seq", "request", "thread", "wall", "finished", "error")

    def __init__(self, seq: int, request: Any, thread: int, wall: float) -> None:
        self.seq, self.request, self.thread, self.wall = seq, request, thread, wall
        self.finished: float | None = None
        self.error: BaseException | None = None

    def finish(self, handle: Any) -> None:
        """The handle's completion callback: note the time and the error (not the result)."""
        self.error = handle._error
        self.finished = time.time()


class FlightRecorder:
    """Ring buffer of this rank's last ``capacity`` submissions (see module docstring)."""

    def __init__(self, rank: int, size: int, capacity: int, directory: str) -> None:
        self.rank, self.size, self.directory = rank, size, directory
        self._ring: deque = deque(maxlen=capacity)
        self._seq = itertools.count()
        self._dump_lock = threading.Lock()
        self._last_dump = 0.0
        self._final = False           # a failure's record was written: later ones keep it
        self._stacks_file: Any = None

    # ---- recording (user threads, cheap) ------------------------------------------------------
    def record(self, handle: Any, submitted: float) -> None:
        """Remember ``handle``'s request and follow its completion (called by Engine.submit,
        already outside any engine lock); the handle itself is not kept."""
        rec = Record(next(self._seq), handle.request, threading.get_ident(), time.time())
        self._ring.append(rec)
        handle.add_done_callback(rec.finish if not self.directory else
                                 lambda h, r=rec: self._done(h, r))

    def _done(self, handle: Any, rec: "Record") -> None:
        rec.finish(handle)
        error = rec.error
        if isinstance(error, (StallError, ShutdownError)):
            self.dump(f"{type(error).__name__}: {error}", throttle=True)

    # ---- output -------------------------------------------------------------------------------
    def snapshot(self) -> list[dict]:
        """The records, oldest first, as plain dicts (state: pending, done or error)."""
        now = time.time()
        rows = []
        for rec in list(self._ring):
            req, error = rec.request, rec.error
            state = ("pending" if rec.finished is None else "done" if error is None else
                     "stalled" if isinstance(error, StallError) else "error")
            rows.append({
                "seq": rec.seq, "coll": req.coll.name.lower(), "name": req.name,
                "dtype": req.dtype, "shape": list(req.shape), "pset": req.pset,
                "state": state, "error": None if error is None else str(error)[:500],
                "thread": rec.thread, "submitted": rec.wall, "finished": rec.finished,
                "age_s": round(now - rec.wall, 3),
            })
        return rows

    def dump(self, reason: str, throttle: bool = False, keep: bool = False) -> str | None:
        """Write ``<dir>/rank<N>.json`` (replaced atomically); returns its path or None.
        ``keep``: leave a record already written by this process (it shows the waiting
        thread where it waited, not where the exception ended up)."""
        if not self.directory:
            return None
        # a SIGUSR1 handler can run on a thread that is itself inside dump(): never block
        # for long on the lock (the dump in progress serves that request too)
        if not self._dump_lock.acquire(timeout=LOCK_WAIT_S):
            return None
        try:
            now = time.monotonic()
            if throttle and now - self._last_dump < MIN_DUMP_INTERVAL_S:
                return None
            path = os.path.join(self.directory, f"rank{self.rank}.json")
            if self._final or (keep and self._last_dump):
                return path       # the record of the failure itself stays (its stacks)
            self._final = throttle or keep
            self._last_dump = now
            try:
                names = {t.ident: t.name for t in threading.enumerate()}
                stacks = {str(ident): {"name": names.get(ident, "?"),
                                       "stack": traceback.format_stack(frame)}
                          for ident, frame in sys._current_frames().items()}
                doc = {"rank": self.rank, "size": self.size, "pid": os.getpid(),
                       "reason": reason, "time": time.time(), "records": self.snapshot(),
                       "threads": stacks}
                tmp = f"{path}.tmp{os.getpid()}"
                with open(tmp, "w") as f:
                    json.dump(doc, f)
                os.replace(tmp, path)
                return path
            except Exception as exc:  # noqa: BLE001 - a diagnostic must never break training
                log.warning("flight recorder: could not write its record: %s", exc)
                return None
        finally:
            self._dump_lock.release()

    # ---- signals ------------------------------------------------------------------------------
    def install_signal(self) -> None:
        """SIGUSR1 writes the record (main thread only; a no-op elsewhere) and then calls the
        handler the program had installed, if any; faulthandler appends C-level stacks to
        ``rank<N>.stacks`` for threads Python cannot interrupt."""
        if not self.directory or threading.current_thread() is not threading.main_thread():
            return
        try:
            os.makedirs(self.directory, exist_ok=True)
            with open(os.path.join(self.directory, f"rank{self.rank}.pid"), "w") as f:
                f.write(str(os.getpid()))
            previous = signal.getsignal(signal.SIGUSR1)
            if getattr(previous, "_lightcc_flight", False):
                previous = getattr(previous, "_chained", None)  # a re-init: not ours again

            def on_usr1(signum: int, frame: Any) -> None:
                self.dump("SIGUSR1")
                if callable(previous):        # the program's own handler runs too
                    previous(signum, frame)

            on_usr1._lightcc_flight = True          # type: ignore[attr-defined]
            on_usr1._chained = previous             # type: ignore[attr-defined]
            signal.signal(signal.SIGUSR1, on_usr1)
            self._stacks_file = open(  # noqa: SIM115 - stays open for faulthandler
                os.path.join(self.directory, f"rank{self.rank}.stacks"), "w")
            faulthandler.register(signal.SIGUSR1, file=self._stacks_file, all_threads=True,
                                  chain=True)
        except (OSError, ValueError) as exc:
            log.warning("flight recorder: SIGUSR1 not installed: %s", exc)


def attach(rank: int, size: int, capacity: int, directory: str) -> FlightRecorder | None:
    """The process's recorder (None when ``capacity`` is 0); made current for :func:`dump`."""
    global _active
    if capacity <= 0:
        _active = None
        return None
    _active = FlightRecorder(rank, size, capacity, directory)
    _active.install_signal()
    return _active


def dump(reason: str, keep: bool = False) -> str | None:
    """Write the current recorder's record (the lccrun rank wrapper calls this on an uncaught
    exception, ``keep=True``); None when there is no recorder or no directory."""
    recorder = _active
    return recorder.dump(reason, keep=keep) if recorder is not None else None


def dump_on_exit(reason: str, wait_s: float = PEER_WAIT_S) -> None:
    """A rank is ending on an uncaught exception (lccrun's rank wrapper, or init()'s exit hook
    under plain mpirun): write its record, then have the other ranks of this host write theirs
    (SIGUSR1 to the pids in ``rank<N>.pid``) before MPI_Abort takes them down, waiting up to
    ``wait_s``. Asked twice: the first answers may come from peers still finishing the
    previous collective; the second shows where they block (it replaces the first)."""
    path = dump(reason, keep=True)
    if not path:
        return
    directory = os.path.dirname(path)
    for wait in (wait_s / 3, wait_s * 2 / 3):
        start = time.time()
        asked = []
        for pid_file in glob.glob(os.path.join(directory, "rank*.pid")):
            try:
                with open(pid_file) as f:
                    pid = int(f.read().strip())
                if pid != os.getpid():
                    os.kill(pid, signal.SIGUSR1)
                    asked.append(pid_file[:-4] + ".json")
            except (OSError, ValueError):
                continue
        while asked and time.time() - start < wait:
            asked = [p for p in asked
                     if not (os.path.exists(p) and os.path.getmtime(p) >= start)]
            time.sleep(0.05)
        if wait == wait_s / 3:
            time.sleep(max(0.0, wait - (time.time() - start)))   # let peers reach their wait
