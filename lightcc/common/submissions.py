"""This rank's submissions until a batch claims them (:class:`Submissions`): the queue of what
is not yet reported to the control tree, the in-flight table, the ordered streams with their
sequence numbers, and the counters of generated names.

User threads add to it (``Engine.submit``); the thread that steps the engine takes what is new
(to report it) and claims the entries an agreed batch names (to execute them). It owns the one
lock those need; nothing else touches its tables.
"""
from __future__ import annotations

import itertools
import threading
from collections import deque
from typing import Any, Callable

from .control.messages import COLL_NAMES, ORDERED, SHARED_STREAM, Coll, OrderedItem, Request
from .exceptions import DuplicateNameError
from .execution.reduction import LocalEntry


def _stream_name(coll: Coll, stream: int, seq: int, label: str | None) -> str:
    """The name of an ordered request: its label, else Horovod's generated name for per-type
    streams (``allreduce.noname.7``) or ``ordered.7`` on the shared stream."""
    if label is not None:
        return label
    if stream == SHARED_STREAM:
        return f"ordered.{seq}"
    return f"{COLL_NAMES[Coll(stream)]}.noname.{seq}"


class Submissions:
    """See module docstring. ``queue``, ``urgent`` and ``queued_at`` may be peeked without the
    lock (a request queued right after a peek is seen at the next step)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.lock = threading.Lock()
        self.queue: list[LocalEntry] = []          # not yet reported
        self.inflight: dict[tuple, LocalEntry] = {}
        self.queued_at = 0.0                       # when the oldest queued entry was queued
        self.urgent = False                        # the queue holds work nobody may hold back
        self._streams: dict[tuple[int, int], deque] = {}   # (pset, stream) -> entries
        self._seq: dict[tuple[int, int], int] = {}          # (pset, stream) -> next seq
        self._counters: dict[tuple[int, int], itertools.count] = {}

    def auto_name(self, coll: Coll, pset: int) -> str:
        """Horovod-style generated name; counters are per collective type and process set."""
        with self.lock:
            counter = self._counters.setdefault((int(coll), pset), itertools.count())
            return f"{coll.name.lower()}.noname.{next(counter)}"

    def add(self, handle: Any, request: Request, array: Any, out: Any, now: float,
            stream: int | None, label: str | None,
            check: Callable[[], None]) -> tuple[bool, bool]:
        """Queue a request (``check`` first, under the lock: it raises when the engine stopped).
        An ordered one gets its stream position and name (``handle.request`` follows). Returns
        (the queue was empty, the queue just became urgent)."""
        with self.lock:
            check()
            if stream is None:
                key = request.key
                if key in self.inflight:
                    raise DuplicateNameError(f"{request.describe()} is already in flight on "
                                             f"rank {self.rank}; wait for it or use another "
                                             f"name")
            else:
                sk = (request.pset, stream)
                seq = self._seq.get(sk, 0)
                self._seq[sk] = seq + 1
                request = request._replace(name=_stream_name(request.coll, stream, seq, label))
                handle.request = request
                key = (ORDERED, request.pset, stream, seq)
            entry = LocalEntry(key, array, out, handle, now, request, stream)
            if stream is not None:
                self._streams.setdefault(sk, deque()).append(entry)
            self.inflight[key] = entry
            first = not self.queue
            if first:
                self.queued_at = now
            self.queue.append(entry)
            # the shared ordered stream (torch.distributed) is awaited through torch futures
            # lightcc cannot see, so it is never held (see Engine._step)
            newly_urgent = stream == SHARED_STREAM and not self.urgent
            if newly_urgent:
                self.urgent = True
        return first, newly_urgent

    def mark_urgent(self) -> bool:
        """Have what is queued sent at once (a thread polls it); True when that is news."""
        if not self.queue or self.urgent:      # unlocked peek, rechecked under the lock
            return False
        with self.lock:
            if not self.queue:
                return False
            self.urgent = True
        return True

    def take_new(self) -> list[LocalEntry]:
        """What was queued since the last call (to be reported), in submission order."""
        with self.lock:
            new, self.queue = self.queue, []
            self.urgent = False
        return new

    def claim(self, items: tuple, responses: list, member: Callable[[int], bool]) -> list:
        """This rank's entries for an agreed batch's items, in order (None where it submitted
        nothing: it has joined, or is not a member of the process set; a joined member skips
        the stream position). ``member(pset)``: this rank belongs to process set ``pset``."""
        entries: list = []
        with self.lock:          # one acquisition for the whole batch
            for item, resp in zip(items, responses):
                if isinstance(item, OrderedItem):
                    entries.append(self._take_ordered(item.pset, item.stream, member))
                else:
                    entries.append(self.inflight.pop(resp.request.key, None))
        return entries

    def _take_ordered(self, pset: int, stream: int,
                      member: Callable[[int], bool]) -> LocalEntry | None:
        queue = self._streams.get((pset, stream))
        if queue:
            entry = queue.popleft()
            self.inflight.pop(entry.response_key, None)
            return entry
        if member(pset):
            self._seq[(pset, stream)] = self._seq.get((pset, stream), 0) + 1
        return None

    def drain(self) -> list[LocalEntry]:
        """Take every entry not yet claimed (to fail their handles), leaving it empty."""
        with self.lock:
            entries = list(self.inflight.values())
            self.inflight.clear()
            self.queue.clear()
            self._streams.clear()
        return entries
