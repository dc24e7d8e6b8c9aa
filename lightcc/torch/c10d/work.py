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

import threading
import time
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch.distributed as dist

from ...common.exceptions import LightCCError
from .._tensor import torch_stream
from .futures import POOL, LightCCFuture
from .untraced import untraced


class CollectiveTimeout(LightCCError):
    """A torch collective on the lightcc backend did not complete within the group's timeout."""


def seconds(timeout: Any, default: float) -> float:
    """``timeout`` (timedelta, seconds or None/0 for "the group's") in seconds."""
    if isinstance(timeout, timedelta):
        timeout = timeout.total_seconds()
    if timeout is None or timeout <= 0:
        return default
    return float(timeout)


@untraced
class FutureWork(dist.Work):
    """A Work whose future (made on the first ``get_future()``) is completed by a pool job.

    The job blocks in ``wait()``: for collectives that makes a pool thread drive the engine
    (lightcc's waiting threads make progress themselves, and its lazy mode starts collectives
    when a thread waits for them), and it bounds the wait by the group's timeout, so a future
    that C++ waits on without a deadline (DDP's reducer) still ends in an error. Subclasses
    define ``wait()`` and ``_future_value()``; ``devices`` lists the CUDA devices of the
    future's tensors (torch requires them).
    """

    _fut_done = False
    devices: list = []

    def __init__(self, what: str, key: str, timeout: float) -> None:
        super().__init__()
        self._what = what                # names the call in errors
        self._key = key                  # orders its future's job in the pool
        self._timeout = timeout          # seconds, when wait() is given none
        self._lock = threading.Lock()
        self._fut: LightCCFuture | None = None

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
            if self._fut_done:
                return
            self._fut_done = True
        if error is None:
            self._fut.set_result(self._future_value())
        else:
            self._fut.set_exception(error)

    def _future_value(self) -> Any:
        raise NotImplementedError


@untraced
class LightCCWork(FutureWork):
    """One torch collective over lightcc (see module docstring)."""

    def __init__(self, handles: Sequence[Any], finish: Callable[[list], Any], what: str,
                 key: str, timeout: float, devices: list | None = None,
                 stream_device: Any = None) -> None:
        super().__init__(what, key, timeout)
        self.devices = devices or []
        self._stream = stream_device     # CUDA results: the waiter's torch stream waits on them
        self._handles = list(handles)
        self._finish = finish
        self._state: Any = None          # None: not settled; True: ok; else the exception
        self._value: Any = None

    # ---- settling --------------------------------------------------------------------------
    def _settle(self) -> Any:
        """Run ``finish`` once all handles are done; returns True or the exception."""
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
        """Blocks until done; with CUDA results on the device path, the waiting thread's
        current torch stream then waits on the engine's done event (no host round trip)."""
        with torch_stream(self._stream):
            return self._wait(timeout)

    def _wait(self, timeout: Any) -> bool:
        limit = seconds(timeout, self._timeout)
        deadline = time.monotonic() + limit
        for h in self._handles:
            left = deadline - time.monotonic()
            try:
                h.wait(max(left, 0.0))
            except TimeoutError:
                raise CollectiveTimeout(f"{self._what} did not complete within {limit:g} s: "
                                        f"Timed out (a rank of the group never called it, "
                                        f"or called collectives in a different order)") \
                    from None
            except BaseException:  # noqa: BLE001 - the error is reported by _settle
                pass
        state = self._settle()
        if state is not True:
            raise state
        return True

    # ---- torch's Work interface ------------------------------------------------------------
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


@untraced
class GroupWork(FutureWork):
    """Several Works as one (coalesced collectives, ``batch_isend_irecv``)."""

    def __init__(self, works: Sequence[Any], value: Callable[[], list], what: str, key: str,
                 timeout: float) -> None:
        super().__init__(what, key, timeout)
        self._works = list(works)
        self._value = value

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
