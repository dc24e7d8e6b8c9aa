"""Counters and recent rates of what the engine did, for ``lightcc.metrics()`` (docs/timeline.md,
"Metrics").

:class:`Metrics` listens to the engine's bucket events (``bucket_start``, ``bucket_done``,
``bucket_error``, sent by ``execution/run.py`` on the engine thread) and adds to a few
integers and floats: a handful of additions per bucket, never per byte. :func:`collect` turns
them, with the communicators' own byte counters (``lightcc.stats()``), into a plain dict that
is cheap enough to build every step (a few microseconds).

Rates are over the last ``WINDOW_S`` seconds: a sample of the counters is kept at most every
``SAMPLE_EVERY_S`` on the engine thread, and a rate is the difference between now and the
oldest sample inside the window.
"""
from __future__ import annotations

import collections
import threading
import time
import weakref
from typing import Any

from .timeline import mark_step

WINDOW_S = 10.0         # rates are averaged over about this many seconds
SAMPLE_EVERY_S = 0.5    # the engine thread keeps one sample of the counters this often

_COUNTERS = ("collectives", "buckets", "fused_buckets", "payload_bytes", "stalls", "errors")


class Steps:
    """Training steps as the framework layer reports them (``DistributedOptimizer``): how
    many, and how long each waited for its gradients' reductions after backward (exposed
    communication)."""

    def __init__(self) -> None:
        self.count = 0
        self.exposed_s = 0.0
        self.history: collections.deque = collections.deque()   # (time, count, exposed_s)

    def note(self, waited_s: float) -> None:
        now = time.monotonic()
        self.count += 1
        self.exposed_s += waited_s
        h = self.history
        if not h or now - h[-1][0] >= SAMPLE_EVERY_S:
            h.append((now, self.count, self.exposed_s))
            while len(h) > 2 and now - h[0][0] > WINDOW_S:
                h.popleft()

    def rates(self, now: float) -> dict[str, float]:
        """``steps_per_s`` and ``exposed_share`` (waiting ÷ wall time) over the window."""
        h = self.history
        if not h:
            return {}
        t0, c0, e0 = h[0]
        dt = now - t0
        if dt < 1e-3 or self.count == c0:
            return {}
        return {"steps_per_s": (self.count - c0) / dt,
                "exposed_share": min(1.0, (self.exposed_s - e0) / dt)}


STEPS = Steps()


def note_step(waited_s: float) -> None:
    """A training step finished waiting for its reductions after ``waited_s`` seconds (also
    marked in the timeline when one is written)."""
    STEPS.note(waited_s)
    mark_step(STEPS.count, waited_s)


class Metrics:
    """The engine listener that counts; read it through :func:`collect`."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = dict.fromkeys(_COUNTERS, 0)
        self.by_type: dict[str, int] = {}
        self.queue_s = 0.0          # submitted -> reported to the coordinator, summed
        self.negotiate_s = 0.0      # reported -> its bucket starts (waiting for the others)
        self.execute_s = 0.0        # bucket start -> done (pack, compress, wire, unpack)
        self.wire_plain = 0         # bytes an uncompressed float32 reduction would send
        self.wire_model = 0         # bytes the chosen compressors send (their wire model)
        self.started = time.monotonic()
        self._samples: collections.deque = collections.deque()
        self._next_sample = 0.0
        self._lock = threading.Lock()

    def on_event(self, event: str, **info: Any) -> None:
        if event == "bucket_start":
            self._waits(info.get("entries") or (), info.get("start"))
        elif event == "bucket_done":
            self._done(info)
        elif event == "bucket_error":
            key = "stalls" if info.get("kind") == "stall" else "errors"
            self.counts[key] += 1

    def _waits(self, entries, start: float | None) -> None:
        if start is None:
            return
        queued = sent = 0.0
        n = 0
        for e in entries:
            if e is not None and e.sent_at:
                queued += e.sent_at - e.submitted_at
                sent += e.sent_at
                n += 1
        self.queue_s += queued
        self.negotiate_s += n * start - sent       # sum of (start - sent_at)

    def _done(self, info: dict) -> None:
        resps = info.get("responses") or ()
        counts = self.counts
        counts["buckets"] += 1
        counts["collectives"] += len(resps)
        if len(resps) > 1:
            counts["fused_buckets"] += 1
        name = resps[0].request.coll.name.lower() if resps else "unknown"
        self.by_type[name] = self.by_type.get(name, 0) + len(resps)
        nbytes = sum([r.request.nbytes for r in resps])
        counts["payload_bytes"] += nbytes
        self.execute_s += float(info.get("seconds") or 0.0)
        self._compression(info.get("plan"), nbytes, int(info.get("nranks") or 1))
        now = time.monotonic()
        if now >= self._next_sample:
            self._next_sample = now + SAMPLE_EVERY_S
            with self._lock:
                self._samples.append((now, dict(counts)))
                while self._samples and now - self._samples[0][0] > WINDOW_S:
                    self._samples.popleft()

    def _compression(self, plan: Any, nbytes: int, nranks: int) -> None:
        """Wire bytes with and without the bucket's compressor, from the compressors' own wire
        model (``wire_bytes``); an uncompressed bucket counts the same on both sides."""
        comp = getattr(plan, "compressor", None)
        if comp is None or nranks < 2 or not hasattr(comp, "wire_bytes"):
            self.wire_plain += nbytes
            self.wire_model += nbytes
            return
        numel = nbytes // 4
        plain = 2 * (nranks - 1) * nbytes // nranks      # a float32 ring allreduce
        try:
            model = int(comp.wire_bytes(numel, nranks))
        except Exception:  # noqa: BLE001 - a model that cannot say counts as uncompressed
            model = plain
        self.wire_plain += plain
        self.wire_model += max(1, model)

    def rates(self, now: float, counts: dict[str, int]) -> dict[str, float]:
        """Per-second rates of the counters over the window (empty before two samples)."""
        with self._lock:
            old = next(((t, c) for t, c in self._samples if now - t <= WINDOW_S), None)
        if old is None or now - old[0] < 1e-3:
            return {}
        dt = now - old[0]
        return {f"{k}_per_s": (counts[k] - old[1].get(k, 0)) / dt
                for k in ("collectives", "buckets", "payload_bytes")} | {"window_s": dt}


_ATTACHED: "weakref.WeakKeyDictionary[Any, Metrics]" = weakref.WeakKeyDictionary()


def attach(engine: Any) -> Metrics:
    """The engine's :class:`Metrics`, listening from now on (once per engine)."""
    m = _ATTACHED.get(engine)
    if m is None:
        m = _ATTACHED[engine] = Metrics()
        engine.listeners.append(m.on_event)
    return m


def collect(engine: Any, wire: dict[str, Any]) -> dict[str, Any]:
    """``lightcc.metrics()``: the counters, the wire bytes per communicator (``wire``, as
    ``lightcc.stats()`` returns them) and rates over the last ~10 s (docs/timeline.md)."""
    m = attach(engine)
    now = time.monotonic()
    counts = dict(m.counts)
    per_comm = {k: {"bytes_sent": v["bytes_sent"], "bytes_received": v["bytes_received"]}
                for k, v in wire.items() if isinstance(v, dict)}
    out: dict[str, Any] = {
        **counts,
        "collectives_by_type": dict(m.by_type),
        "bytes_sent": int(wire.get("bytes_sent", 0)),
        "bytes_received": int(wire.get("bytes_received", 0)),
        "wire": per_comm,
        "compression_ratio": (m.wire_plain / m.wire_model) if m.wire_model else 1.0,
        "queue_s": m.queue_s,
        "negotiation_s": m.negotiate_s,
        "execute_s": m.execute_s,
        "uptime_s": now - m.started,
        "steps": STEPS.count,
        "exposed_comm_s": STEPS.exposed_s,
    }
    out["rates"] = {**m.rates(now, counts), **STEPS.rates(now),
                    "bytes_sent_per_s": _bytes_rate(engine, wire, now)}
    return out


_LAST_WIRE: "weakref.WeakKeyDictionary[Any, collections.deque]" = weakref.WeakKeyDictionary()


def _bytes_rate(engine: Any, wire: dict[str, Any], now: float) -> float:
    """Wire bytes sent per second over the window, from the readings of earlier calls of
    :func:`collect` (0 at the first call)."""
    history = _LAST_WIRE.setdefault(engine, collections.deque())
    history.append((now, int(wire.get("bytes_sent", 0))))
    while len(history) > 1 and now - history[0][0] > WINDOW_S:
        history.popleft()
    t0, b0 = history[0]
    return (history[-1][1] - b0) / (now - t0) if now - t0 > 1e-3 else 0.0


def flatten(metrics: dict[str, Any], prefix: str = "lightcc") -> dict[str, float]:
    """Numeric leaves as ``prefix/a/b`` -> value (TensorBoard scalar tags)."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        tag = f"{prefix}/{key}"
        if isinstance(value, dict):
            out.update(flatten(value, tag))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[tag] = float(value)
    return out
