"""Chrome trace-event / Perfetto timeline of everything the engine does.

:class:`Timeline` is a :class:`~.tracing.Tracer`: the engine, executor and communicators call
``span`` / ``instant`` on the engine thread; each call appends one tuple to a bounded deque
(about a microsecond, never blocks: when the deque holds ``max_pending`` events the event is
dropped and counted). A background writer thread turns tuples into trace-event JSON and
appends them to the file.

File layout (docs/timeline.md): a JSON array of events, one per line, each followed by a
comma, closed by ``]`` on :meth:`Timeline.close`. A process that dies mid-run leaves a file
without the ``]``, which chrome://tracing and Perfetto both accept. ``pid`` is the rank, and
every track (a tensor, a fusion bucket, a communicator link ``link:world`` / ``link:local``
/ ``link:cross``, the ``engine`` with its ``CYCLE`` markers) is one ``tid`` named by a
``thread_name`` metadata event. Timestamps are microseconds since midnight UTC of the day
the timeline started, so the files of several ranks line up as well as the hosts' clocks do.
"""
from __future__ import annotations

import collections
import json
import logging
import os
import threading
import time
from typing import Any

from ..tracing import NULL, Tracer

log = logging.getLogger("lightcc")

DEFAULT_MAX_PENDING = 200_000   # events held in memory before new ones are dropped
FLUSH_INTERVAL_S = 0.05         # how often the writer wakes up to drain the queue
WRITE_CHUNK = 64                # events encoded between two GIL hand-backs

# tracks sort in this order in the viewer: engine and step, links, buckets, tensors
_SORT_ENGINE, _SORT_LINK, _SORT_BUCKET, _SORT_TENSOR = 0, 1, 2, 3


def _sort_key(track: str) -> int:
    if track in ("engine", "step"):
        return _SORT_ENGINE
    if track.startswith("link:"):
        return _SORT_LINK
    if track.startswith("bucket["):
        return _SORT_BUCKET
    return _SORT_TENSOR


def _json_value(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if hasattr(value, "item"):          # numpy scalars
        return value.item()
    return str(value)


def _encode_value(value: Any) -> str:
    """JSON text of one argument value (ints and plain strings without the json module)."""
    if type(value) is int:
        return str(value)
    if type(value) is str and value.isidentifier():
        return f'"{value}"'
    return json.dumps(_json_value(value))


class Timeline(Tracer):
    """Writes trace events of one rank to ``path`` (see module docstring).

    ``mark_cycles`` keeps the engine's ``CYCLE`` instants (one per executed batch); without
    it they are dropped at the source. ``max_pending`` bounds the memory held for the writer.
    """

    enabled = True

    def __init__(self, path: str, rank: int = 0, mark_cycles: bool = True,
                 max_pending: int = DEFAULT_MAX_PENDING) -> None:
        self.path = path
        self.rank = rank
        self.mark_cycles = mark_cycles
        self.max_pending = max_pending
        self.dropped = 0
        self.written = 0
        self._pending: collections.deque = collections.deque()
        self._tids: dict[str, int] = {}
        wall, perf = time.time(), time.perf_counter()
        # seconds since midnight UTC = perf_counter + offset; kept small so that adding it
        # keeps sub-microsecond precision (an epoch-sized offset would round to 0.24 us)
        self._offset = (wall - (wall // 86400) * 86400) - perf
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        self._file = open(path, "w", encoding="utf-8")
        self._file.write("[\n")
        self._write_lines([self._meta("process_name", 0, name=f"rank {rank}"),
                           self._meta("process_sort_index", 0, sort_index=rank)])
        self._file.flush()
        self._step_end: float | None = None     # previous training step's end (mark_step)
        self._stop = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._writer, name="lightcc-timeline",
                                        daemon=True)
        self._thread.start()

    # ---- Tracer (engine thread; must stay cheap) ----------------------------------------------
    def span(self, track: str, phase: str, start: float, end: float, **args: Any) -> None:
        if len(self._pending) >= self.max_pending:
            self.dropped += 1
            return
        self._pending.append(("X", track, phase, start, end, args))

    def instant(self, track: str, name: str, when: float, **args: Any) -> None:
        if name == "CYCLE" and not self.mark_cycles:
            return
        if len(self._pending) >= self.max_pending:
            self.dropped += 1
            return
        self._pending.append(("i", track, name, when, when, args))

    def step(self, step: int, waited_from: float, end: float) -> None:
        """A training step ended at ``end`` after waiting for its reductions since
        ``waited_from`` (perf_counter seconds): a ``SYNCHRONIZE`` span on the ``step`` track and,
        from the second step on, a ``STEP`` span from the previous step's end (the first step
        has no start boundary). Both carry ``step`` (the framework layer's count)."""
        if self._step_end is not None:
            self.span("step", "STEP", self._step_end, end, step=step)
        self.span("step", "SYNCHRONIZE", waited_from, end, step=step)
        self._step_end = end

    def close(self) -> None:
        """Write what is queued, close the JSON array and the file (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.enabled = False
        self._stop.set()
        self._thread.join()
        self._drain()
        if self.dropped:
            log.warning("timeline %s: dropped %d events (writer fell behind; %d queued max)",
                        self.path, self.dropped, self.max_pending)
        self._file.write(json.dumps(self._meta("lightcc_summary", 0, written=self.written,
                                               dropped=self.dropped)) + "\n]\n")
        self._file.close()

    # ---- writer thread ------------------------------------------------------------------------
    def _writer(self) -> None:
        try:
            while not self._stop.wait(FLUSH_INTERVAL_S):
                self._drain()
        except Exception:   # a broken disk must not take the engine down
            log.exception("timeline writer for %s failed; tracing stops", self.path)
            self.enabled = False

    def _drain(self) -> None:
        items = []
        pending = self._pending
        while pending:
            items.append(pending.popleft())
        if not items:
            return
        # viewers nest slices of one track by start time; at equal starts the longer one must
        # come first (an EXECUTE span and the PACK it begins with share their start time)
        items.sort(key=lambda e: (e[3], e[3] - e[4]))
        for first in range(0, len(items), WRITE_CHUNK):
            self._file.write("".join(self._encode(e) for e in items[first:first + WRITE_CHUNK]))
            time.sleep(0)   # hand the GIL back: the engine thread must not wait on the writer
        self.written += len(items)
        self._file.flush()

    def _encode(self, item: tuple) -> str:
        kind, track, name, start, end, args = item
        tid = self._tids.get(track)
        head = ""
        if tid is None:
            tid = self._tids[track] = len(self._tids) + 1
            head = (json.dumps(self._meta("thread_name", tid, name=track)) + ",\n"
                    + json.dumps(self._meta("thread_sort_index", tid,
                                            sort_index=_sort_key(track) * 100000 + tid)) + ",\n")
        ts = self._us(start)
        if kind == "X":
            tail = f',"dur":{round(self._us(end) - ts, 3)}'
        else:
            tail = ',"s":"p"' if name == "CYCLE" else ',"s":"t"'
        if args:
            tail += ',"args":{' + ",".join(f'"{k}":{_encode_value(v)}'
                                           for k, v in args.items()) + "}"
        return (f'{head}{{"name":{_encode_value(name)},"ph":"{kind}","ts":{ts},"pid":{self.rank},'
                f'"tid":{tid}{tail}}},\n')

    def _write_lines(self, events: list[dict]) -> None:
        self._file.write("".join(json.dumps(e, separators=(",", ":")) + ",\n" for e in events))

    def _us(self, t: float) -> float:
        return round((t + self._offset) * 1e6, 3)

    def _meta(self, kind: str, tid: int, **args: Any) -> dict:
        return {"name": kind, "ph": "M", "pid": self.rank, "tid": tid, "args": args}


# ---- process-wide timeline of the running engine --------------------------------------------
_lock = threading.Lock()
_active: Timeline | None = None


def rank_path(path: str, rank: int) -> str:
    """The file rank ``rank`` writes: ``path`` on rank 0, ``path.rank<N>`` elsewhere."""
    return path if rank == 0 else f"{path}.rank{rank}"


def start(engine: Any, path: str, mark_cycles: bool = True, all_ranks: bool = False) -> bool:
    """Start tracing ``engine`` into ``path``; returns True when this rank writes a file.

    Rank 0 writes ``path``; other ranks write ``path.rank<N>`` only with ``all_ranks`` (and
    otherwise keep the free :data:`~.tracing.NULL` tracer). A running timeline is stopped first.
    """
    global _active
    if not path:
        raise ValueError("timeline file path is empty")
    stop(engine)
    if engine.rank != 0 and not all_ranks:
        return False
    with _lock:
        _active = Timeline(rank_path(path, engine.rank), engine.rank, mark_cycles)
        engine.set_tracer(_active)
    log.info("timeline: writing %s", _active.path)
    return True


def stop(engine: Any | None = None) -> None:
    """Detach the timeline from ``engine`` (if given) and close its file."""
    global _active
    with _lock:
        tl, _active = _active, None
        if engine is not None:
            engine.set_tracer(NULL)
    if tl is not None:
        tl.close()


def mark_step(step: int, waited_s: float) -> None:
    """The framework layer finished training step ``step``, which waited ``waited_s`` seconds
    for its reductions after backward: marked in this rank's timeline (the per-step table of
    ``lccrun --timeline-filename``); one global read when no timeline is written."""
    tl = _active
    if tl is not None:
        end = time.perf_counter()
        tl.step(step, end - waited_s, end)


def active() -> Timeline | None:
    """The timeline now being written on this rank, if any."""
    return _active
