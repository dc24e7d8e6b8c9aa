"""``Work`` objects of the lightcc process group.

A :class:`LightCCWork` wraps the core handles of one torch collective plus a ``finish``
function that turns their results into torch's outputs (copying staged tensors back, slicing
gathered data). ``finish`` runs exactly once, on whichever thread first needs it: ``wait()``
(the blocking path, no thread hop) or the pool job that completes the future. ``wait()``
raises the collective's error; the future (created on the first ``get_future()``) holds the
output tensors, or the error. See c10d-notes: a ``None`` future value or a missing Work
crashes DDP, and only a Work subclass can make ``wait()`` raise.
"""
from __future__ import annotations

import heapq
import itertools
import threading
import time
import weakref
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch.distributed as dist

from ...common.exceptions import LightCCError
from .futures import POOL, LightCCFuture


class CollectiveTimeout(LightCCError):
    """A torch collective on the lightcc backend did not complete within the group's timeout."""


def seconds(timeout: Any, default: float) -> float:
    """``timeout`` (timedelta, seconds or None/0 for "the group's") in seconds."""
    if isinstance(timeout, timedelta):
        timeout = timeout.total_seconds()
    if timeout is None or timeout <= 0:
        return default
    return float(timeout)


def on_all_done(handles: Sequence[Any], fn: Callable[[], None]) -> None:
    """Call ``fn()`` once, on the completing thread, when every core handle is done.

    Uses the handles' completion callbacks (run by the engine's thread: keep ``fn`` cheap).
    A handle may complete before its callback is added, so each is checked again after.
    """
    lock = threading.Lock()
    left = [len(handles)]
    seen: set[int] = set()

    def one(h: Any) -> None:
        with lock:
            if id(h) in seen:
                return
            seen.add(id(h))
            left[0] -= 1
            last = left[0] == 0
        if last:
            fn()

    if not handles:
        fn()
        return
    for h in handles:
        h._callbacks.append(one)
        if h.done():
            one(h)


class FutureWork(dist.Work):
    """A Work whose future (made on the first ``get_future()``) is completed by a pool job.

    Subclasses set ``_key``, ``_lock`` and ``_fut = None``, and define ``wait()`` and
    ``_future_value()``; by default the job blocks in ``wait()``, LightCCWork instead starts
    it when its core handles complete. ``devices`` lists the CUDA devices of the future's
    tensors (torch requires them on the future).
    """

    _key: str
    _lock: threading.Lock
    _fut: LightCCFuture | None
    _fut_done = False
    devices: list = []

    def get_future(self) -> LightCCFuture:
        with self._lock:
            if self._fut is not None:
                return self._fut
            fut = self._fut = LightCCFuture(self._key, self.devices)
        self._schedule_future()
        return fut

    def _schedule_future(self) -> None:
        POOL.submit(self._key, self._complete_future)

    def _outcome(self) -> BaseException | None:
        """None on success, else the error (blocks until the work is done)."""
        try:
            self.wait()
        except BaseException as exc:  # noqa: BLE001 - the future carries it
            return exc
        return None

    def _complete_future(self) -> None:
        error = self._outcome()
        with self._lock:
            if self._fut_done:           # already failed by the watchdog
                return
            self._fut_done = True
        if error is None:
            self._fut.set_result(self._future_value())
        else:
            self._fut.set_exception(error)

    def _future_value(self) -> Any:
        raise NotImplementedError


class LightCCWork(FutureWork):
    """One torch collective over lightcc (see module docstring)."""

    def __init__(self, handles: Sequence[Any], finish: Callable[[list], Any], what: str,
                 key: str, timeout: float, devices: list | None = None) -> None:
        super().__init__()
        self.devices = devices or []
        self._handles = list(handles)
        self._finish = finish
        self._what = what
        self._key = key
        self._timeout = timeout
        self._lock = threading.Lock()
        self._state: Any = None          # None: not settled; True: ok; else the exception
        self._value: Any = None
        self._fut: LightCCFuture | None = None

    # ---- settling --------------------------------------------------------------------------
    def _settle(self) -> Any:
        """Run ``finish`` once all handles are done (or return the error the watchdog set);
        returns True or the exception."""
        with self._lock:
            if self._state is None:
                try:
                    results = [h.wait(0) for h in self._handles]
                    self._value = self._finish(results)
                    self._state = True
                except BaseException as exc:  # noqa: BLE001 - kept and re-raised by wait()
                    self._state = exc
            return self._state

    def wait(self, timeout: Any = None) -> bool:
        limit = seconds(timeout, self._timeout)
        deadline = time.monotonic() + limit
        for h in self._handles:
            left = deadline - time.monotonic()
            try:
                h.wait(max(left, 0.0))
            except TimeoutError:
                raise CollectiveTimeout(f"{self._what} did not complete within {limit:g} s "
                                        f"(a rank of the group never called it, or called "
                                        f"collectives in a different order)") from None
            except BaseException:  # noqa: BLE001 - the error is reported by _settle
                pass
        state = self._settle()
        if state is not True:
            raise state
        return True

    # ---- torch's Work interface ------------------------------------------------------------
    def _schedule_future(self) -> None:
        on_all_done(self._handles, lambda: POOL.submit(self._key, self._complete_future))
        WATCHDOG.add(time.monotonic() + self._timeout, self)

    def _outcome(self) -> BaseException | None:
        state = self._settle()
        return None if state is True else state

    def _expire(self) -> None:
        """Called by the watchdog at the deadline: fail the future if still pending."""
        if self.is_completed():
            return
        with self._lock:
            if self._state is None:
                self._state = CollectiveTimeout(
                    f"{self._what} did not complete within {self._timeout:g} s (a rank of "
                    f"the group never called it, or called collectives in a different order)")
        POOL.submit(self._key, self._complete_future)

    def _future_value(self) -> Any:
        return self._value

    def is_completed(self) -> bool:
        return all(h.done() for h in self._handles)

    def is_success(self) -> bool:
        return self.is_completed() and self._settle() is True

    def exception(self) -> Any:
        if not self.is_completed():
            return None
        state = self._settle()
        return None if state is True else state

    def result(self) -> Any:
        self.wait()
        value = self._value
        return value if isinstance(value, list) else [value]

    def __repr__(self) -> str:
        return f"<LightCCWork {self._what} {'done' if self.is_completed() else 'pending'}>"


class GroupWork(FutureWork):
    """Several Works as one (coalesced collectives, ``batch_isend_irecv``)."""

    def __init__(self, works: Sequence[Any], value: Callable[[], list], what: str, key: str,
                 timeout: float) -> None:
        super().__init__()
        self._works = list(works)
        self._value = value
        self._what = what
        self._key = key
        self._timeout = timeout
        self._lock = threading.Lock()
        self._fut: LightCCFuture | None = None

    def wait(self, timeout: Any = None) -> bool:
        deadline = time.monotonic() + seconds(timeout, self._timeout)
        for w in self._works:
            w.wait(max(deadline - time.monotonic(), 1e-3))
        return True

    def _future_value(self) -> Any:
        return self._value()

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def is_success(self) -> bool:
        return all(w.is_success() for w in self._works)

    def exception(self) -> Any:
        for w in self._works:
            exc = w.exception()
            if exc is not None:
                return exc
        return None

    def result(self) -> list:
        self.wait()
        return self._value()


PRUNE_AT = 4096


class _Watchdog:
    """Fails the futures of collectives still pending at their group's timeout.

    C++ callers (DDP's reducer) wait on futures without a deadline; this makes a collective
    that some rank never issues end in a ``CollectiveTimeout`` instead of a silent hang.
    One thread, a heap of (deadline, work); works are held weakly.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Any]] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._count = itertools.count()
        self._thread: threading.Thread | None = None
        self._prune_at = PRUNE_AT

    def add(self, deadline: float, work: LightCCWork) -> None:
        with self._lock:
            if len(self._heap) > self._prune_at:     # drop finished works now and then
                self._heap = [e for e in self._heap
                              if (w := e[2]()) is not None and not w.is_completed()]
                heapq.heapify(self._heap)
                self._prune_at = max(PRUNE_AT, 2 * len(self._heap))
            first = not self._heap or deadline < self._heap[0][0]
            heapq.heappush(self._heap, (deadline, next(self._count), weakref.ref(work)))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="lightcc-c10d-watchdog",
                                                daemon=True)
                self._thread.start()
        if first:
            self._wake.set()

    def _run(self) -> None:
        while True:
            with self._lock:
                wait = self._heap[0][0] - time.monotonic() if self._heap else None
            if wait is None or wait > 0:
                self._wake.wait(wait)
                self._wake.clear()
            now = time.monotonic()
            expired = []
            with self._lock:
                while self._heap and self._heap[0][0] <= now:
                    expired.append(heapq.heappop(self._heap)[2]())
            for work in expired:
                if work is not None:
                    work._expire()


WATCHDOG = _Watchdog()
