"""Futures of the lightcc process group, and where their callbacks run.

torch's comm hooks chain work on futures (``fut.then(cb)``) and some issue new collectives
inside those callbacks (PowerSGD waits on an allreduce inside one). Two rules keep that from
deadlocking or mismatching across ranks:

* **No user code on the engine's thread.** A :class:`LightCCFuture` never runs a callback
  inline: neither on the thread that completes it nor on the thread that attaches a callback
  to an already-completed future. Every callback runs as a job on :data:`POOL`, a pool that
  starts a thread whenever none is idle, so a callback blocked on another collective never
  keeps that collective's completion (another job) from running.
* **Callbacks have deterministic names.** Which thread runs a callback, and when, differs
  between ranks, so collectives issued inside callbacks cannot be matched by position on the
  group's ordered stream. Each job runs under a :class:`Chain` context whose key is derived
  from the collective the future belongs to (``<work key>.t<i>`` for the i-th callback
  attached); collectives issued under it are named ``<chain key>.<j>`` and matched by name.
  The same program issues the same names on every rank, whatever the timing.
"""
from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Callable

import torch

from .untraced import untraced

log = logging.getLogger("lightcc")

_tls = threading.local()
MAX_THREADS = 256


class Chain:
    """The naming context of a running callback: collectives it issues get ``key.<j>``."""

    __slots__ = ("key", "_count")

    def __init__(self, key: str) -> None:
        self.key = key
        self._count = 0

    def next_name(self) -> str:
        name = f"{self.key}.{self._count}"
        self._count += 1
        return name


def current_chain() -> Chain | None:
    """The chain of the callback running on this thread, or None outside callbacks."""
    return getattr(_tls, "chain", None)


class _Pool:
    """Runs jobs on daemon threads; every job gets an idle thread or a new one at once."""

    def __init__(self, max_threads: int = MAX_THREADS) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._threads = 0
        self._max = max_threads
        self._warned = False

    def submit(self, key: str, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` under ``Chain(key)`` on a pool thread."""
        self._jobs.put((key, fn, args))
        with self._lock:
            if self._idle:
                self._idle -= 1          # that thread is reserved for this job
                return
            if self._threads >= self._max:
                if not self._warned:
                    self._warned = True
                    log.warning("lightcc c10d: %d callback threads are busy; further future "
                                "callbacks wait for one to finish", self._max)
                return
            self._threads += 1
        threading.Thread(target=self._worker, name=f"lightcc-c10d-{self._threads}",
                         daemon=True).start()

    def _worker(self) -> None:
        while True:
            key, fn, args = self._jobs.get()
            _tls.chain = Chain(key)
            try:
                fn(*args)
            except BaseException:  # noqa: BLE001 - a job must never kill its thread
                log.exception("lightcc c10d: future callback failed")
            finally:
                _tls.chain = None
            with self._lock:
                self._idle += 1

    @property
    def threads(self) -> int:
        return self._threads


POOL = _Pool()


@untraced
class LightCCFuture(torch.futures.Future):
    """A ``torch.futures.Future`` whose callbacks always run on :data:`POOL` (see module doc).

    ``key`` names the chain of callbacks attached to it. C++ callers (DDP's reducer) only
    wait on it; Python callers (comm hooks) also chain ``then`` callbacks.
    """

    def __init__(self, key: str, devices: list | None = None) -> None:
        super().__init__(devices=devices or None)
        self._key = key
        self._devices = devices
        self._cb_lock = threading.Lock()
        self._finished = False
        self._pending: list[tuple[Callable, "LightCCFuture | None", str]] = []
        self._attached = 0

    def then(self, callback: Callable[["LightCCFuture"], Any]) -> "LightCCFuture":
        child = LightCCFuture("", self._devices)
        child._key = self._attach(callback, child)
        return child

    def add_done_callback(self, callback: Callable[["LightCCFuture"], None]) -> None:
        self._attach(callback, None)

    def _attach(self, callback: Callable, child: "LightCCFuture | None") -> str:
        with self._cb_lock:
            key = f"{self._key}.t{self._attached}"
            self._attached += 1
            if not self._finished:
                self._pending.append((callback, child, key))
                return key
        POOL.submit(key, _run_callback, self, callback, child)
        return key

    def set_result(self, result: Any) -> None:
        super().set_result(result)
        self._dispatch()

    def set_exception(self, result: BaseException) -> None:
        super().set_exception(result)
        self._dispatch()

    def _dispatch(self) -> None:
        with self._cb_lock:
            self._finished = True
            jobs, self._pending = self._pending, []
        for callback, child, key in jobs:
            POOL.submit(key, _run_callback, self, callback, child)


def _run_callback(parent: LightCCFuture, callback: Callable,
                  child: LightCCFuture | None) -> None:
    """Run one ``then``/``add_done_callback`` callback and settle its child future."""
    try:
        value = callback(parent)
    except BaseException as exc:  # noqa: BLE001 - torch's contract: the child gets the error
        if child is None:
            log.exception("lightcc c10d: done-callback failed")
        else:
            child.set_exception(exc)
        return
    if child is not None:
        child.set_result(value)
