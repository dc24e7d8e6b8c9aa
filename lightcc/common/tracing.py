"""The tracing seam between the runtime and the timeline.

The engine, executor and backends report what they do through a :class:`Tracer`; the
default :data:`NULL` tracer does nothing and costs one attribute check (``enabled``) per
event site. ``lightcc.common.observability.timeline`` provides the real one. Times are
``time.perf_counter()`` seconds; ``track`` is a tensor name or bucket label.
"""
from __future__ import annotations

from typing import Any


class Tracer:
    """Receives timed phases; subclasses write them somewhere."""

    enabled = False

    def span(self, track: str, phase: str, start: float, end: float, **args: Any) -> None:
        """A phase of ``track`` that ran from ``start`` to ``end``."""

    def instant(self, track: str, name: str, when: float, **args: Any) -> None:
        """A point event (cycle markers, stalls, errors)."""

    def close(self) -> None:
        """Flush and stop."""


NULL = Tracer()
