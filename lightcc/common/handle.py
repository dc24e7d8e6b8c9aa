"""The future of one submitted collective (:class:`Handle`), returned by every ``*_async`` call."""
from __future__ import annotations

import logging
import threading
from typing import Any

from .control.messages import Request

log = logging.getLogger("lightcc")


class Handle:
    """The future of one submitted collective; see ``lightcc.poll`` / ``synchronize``.

    A handle is made for every collective, so it owns no lock: completion sets a flag, and a
    thread that waits without driving the engine gets an event made on demand.
    """

    __slots__ = ("_done", "_waiter", "_result", "_error", "request", "_callbacks", "_engine",
                 "device_done")

    def __init__(self, request: Request | None, engine: Any = None) -> None:
        self._done = False
        self._waiter: threading.Event | None = None
        self._result: Any = None
        self._error: BaseException | None = None
        self.request = request
        self._callbacks: list = []
        self._engine = engine
        self.device_done: Any = None     # GPU results: gpu_arrays.Completion, set by execution/gpu.py

    def done(self) -> bool:
        """True once complete; never blocks (in lazy mode it also has the background thread
        start queued work, see Engine.expedite)."""
        if not self._done and self._engine is not None and self._engine.lazy:
            self._engine.expedite()
        return self._done

    @property
    def is_done(self) -> bool:
        """True once complete, with no side effect (``done()`` may start queued work)."""
        return self._done

    @property
    def failure(self) -> BaseException | None:
        """The collective's error once it completed with one, else None (never waits)."""
        return self._error if self._done else None

    def wait_passive(self) -> bool:
        """Wait for completion without driving an eager engine (its background thread
        executes the buckets; this thread wakes when this handle is done, or the engine stops).
        False, without waiting, when only a driving wait can complete it (no engine, or lazy
        mode: use :meth:`wait`)."""
        if self._done:
            return True
        engine = self._engine
        if engine is None or engine.lazy:
            return False
        waiter = self._waiter
        if waiter is None:
            waiter = self._waiter = threading.Event()
        status = engine.status
        while not self._done and not status.stopped():
            waiter.wait(1.0)             # _set() publishes the flag, then sets the event
        return True

    def wait(self, timeout: float | None = None) -> Any:
        """Block until complete; return the result or raise the collective's error.

        GPU results are complete once the calling thread's current CuPy stream reaches them:
        this makes that stream wait on the engine's done event (no host sync).

        The waiting thread drives the engine itself while nobody else does (no thread
        hand-off on the latency-critical path); otherwise it sleeps on an event.
        """
        if not self._done and self._engine is not None:
            self._engine.drive(self, timeout)
        if not self._done:
            waiter = self._waiter
            if waiter is None:
                waiter = self._waiter = threading.Event()
            if not self._done:     # _set() runs flag-then-event: checked after publishing
                waiter.wait(timeout)
        if not self._done:
            raise TimeoutError(f"{self.request.describe() if self.request else 'handle'} "
                               f"did not complete within {timeout} s")
        if self._error is not None:
            raise self._error
        if self.device_done is not None:   # the caller's stream waits for the GPU work
            self.device_done.consume()
        return self._result

    def add_done_callback(self, fn: Any) -> None:
        """Call ``fn(handle)`` once the handle completes, on the completing thread (at once,
        on this thread, if it already has). ``fn`` must not block or wait for collectives."""
        self._callbacks.append(fn)
        if self._done and fn in self._callbacks:
            self._callbacks.remove(fn)
            fn(self)

    def _set(self, result: Any = None, error: BaseException | None = None) -> None:
        self._result, self._error = result, error
        self._done = True
        waiter = self._waiter
        if waiter is not None:
            waiter.set()
        for cb in self._callbacks:
            try:
                cb(self)
            except Exception:  # a user callback must not kill the engine
                log.exception("handle callback failed")

    def __repr__(self) -> str:
        state = "done" if self._done else "pending"
        return f"<Handle {self.request.describe() if self.request else ''} {state}>"
