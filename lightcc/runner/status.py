"""``lccrun --status [SECONDS]``: one line about the running job, from the ranks' reports.

Every rank sends a few numbers every SECONDS (``lightcc.common.observability.reporter``:
steps, steps/s, wire bytes/s, compression ratio, the share of wall time a step waited for its
reductions after backward); lccrun prints::

    lccrun: status: 12.3 steps/s | wire 45.6 MB/s | compression 2.00x | exposed comm 23% | slowest rank 1, 3 steps behind

Steps/s is the slowest rank's, wire MB/s the sum over ranks (bytes each rank sent), the
compression ratio and the exposed share their means. The line is rewritten in place on a
terminal and appended as a new line otherwise. Steps are counted by ``DistributedOptimizer``
(each ``synchronize()``); a job that does not use it shows ``-`` for them.
"""
from __future__ import annotations

import sys
import time
from typing import Any

DEFAULT_PERIOD_S = 5.0
STATUS_ENV = "LCC_RUNNER_STATUS"


def status_line(reports: dict[int, dict[str, Any]], ages: dict[int, float] | None = None) -> str:
    """The status text (without ``lccrun: status: ``) for rank -> latest report; ``ages``
    (rank -> seconds since that report) brings every rank's step count to the same moment
    (steps + steps/s x age), since the ranks report at different times."""
    if not reports:
        return "no rank has reported yet"
    vals = list(reports.values())

    def got(key: str) -> list[float]:
        return [float(v[key]) for v in vals if isinstance(v.get(key), (int, float))]

    rates = got("steps_per_s")
    wire = sum(got("bytes_sent_per_s")) / 1e6
    ratio = got("compression_ratio")
    exposed = got("exposed_share")
    parts = [f"{min(rates):.1f} steps/s" if rates else "- steps/s",
             f"wire {wire:.1f} MB/s",
             f"compression {sum(ratio) / len(ratio):.2f}x" if ratio else "compression -",
             f"exposed comm {100 * sum(exposed) / len(exposed):.0f}%" if exposed
             else "exposed comm -"]
    steps = {r: v["steps"] + float(v.get("steps_per_s") or 0.0) * (ages or {}).get(r, 0.0)
             for r, v in reports.items() if isinstance(v.get("steps"), int)}
    if len(steps) > 1:
        slow = min(steps, key=lambda r: (steps[r], r))
        behind = int(round(max(steps.values()) - steps[slow]))
        parts.append(f"slowest rank {slow}, {behind} step{'s' if behind != 1 else ''} behind"
                     if behind else "ranks in step")
    return " | ".join(parts)


class StatusWatch:
    """Prints the status line every ``period`` seconds while the job runs."""

    def __init__(self, registry: Any, period: float, stream: Any = None,
                 now: float | None = None) -> None:
        self.registry, self.period = registry, period
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.next = (time.monotonic() if now is None else now) + period
        self.shown = False
        self.last_report: float | None = None

    def poll(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if now < self.next:
            return
        self.next = now + self.period
        got = self.registry.reports()
        newest = max((when for when, _ in got.values()), default=None)
        if newest is None or newest == self.last_report:
            return                      # nothing new since the last line (the job ends)
        self.last_report = newest
        reports = {r: rep for r, (_, rep) in got.items()}
        ages = {r: max(0.0, now - when) for r, (when, _) in got.items()}
        text = f"lccrun: status: {status_line(reports, ages)}"
        if self.tty:
            self.stream.write("\r\x1b[K" + text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()
        self.shown = True

    def finish(self) -> None:
        """End the rewritten line (a terminal) so what follows starts on its own line."""
        if self.tty and self.shown:
            self.stream.write("\n")
            self.stream.flush()
