"""Per-event cost of the timeline on the engine thread: off (one attribute check on the null
tracer) and on (one deque append), in nanoseconds. One process, no MPI.

    python benchmarks/timeline_cost.py [--events 200000] [--rounds 5]

Prints the median and the range over the rounds. (This measurement used to be a unit test with
a time limit; a speed belongs here, where a loaded machine makes a number noisy, not a failure.)
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from lightcc.common.observability.timeline import Timeline  # noqa: E402
from lightcc.common.tracing import NULL  # noqa: E402


def per_event_ns(tracer, events: int) -> float:
    """Nanoseconds per event site, as the engine writes them (``if tracer.enabled: span``)."""
    t0 = time.perf_counter()
    for _ in range(events):
        if tracer.enabled:
            tracer.span("a", "QUEUE", 0.0, 1.0, bytes=4)
    return (time.perf_counter() - t0) / events * 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    off, on = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            off.append(per_event_ns(NULL, args.events))
            tl = Timeline(str(Path(tmp) / f"t{i}.json"), max_pending=args.events + 1)
            on.append(per_event_ns(tl, args.events))
            tl.close()
    for label, values in (("off", off), ("on", on)):
        print(f"timeline {label}: median {statistics.median(values):.0f} ns/event "
              f"(range {min(values):.0f}-{max(values):.0f}, {args.rounds} x {args.events})")


if __name__ == "__main__":
    main()
