"""Pins each MPI rank of a job to cores of its own, as ``taskset -c`` would (the same
``sched_setaffinity`` call), for benchmarks/device_run.sh's "cores of their own" runs.

Python imports ``sitecustomize`` at start-up from the first directory of ``sys.path`` that has
one, so putting this folder on ``PYTHONPATH`` reaches every rank that ``benchmarks/training.py``
starts, through any launcher (its simulated hosts included), without changing its command line.
Active only where ``DEVICE_RUN_CORES_PER_RANK`` is set and the process is an MPI rank
(``OMPI_COMM_WORLD_RANK`` or ``PMIX_RANK``): rank r gets cores ``[offset + r k, offset +
(r + 1) k)`` of the cores this process may use (``DEVICE_RUN_CORE_OFFSET``, default 0), and every
thread it starts later inherits them. ``DEVICE_RUN_PIN_LOG`` names a file that gets one line per
rank (what it was pinned to). A rank that would get no core is left as it is, and says so there.
"""
from __future__ import annotations

import os


def cores_for(rank: int, per_rank: int, available: list[int], offset: int = 0) -> list[int]:
    """The cores of ``rank``: ``per_rank`` of ``available`` (sorted), after ``offset`` of them
    and those of the ranks before it; empty when there are not enough."""
    ordered = sorted(available)
    first = offset + rank * per_rank
    if per_rank < 1 or first + per_rank > len(ordered):
        return []
    return ordered[first:first + per_rank]


def _pin() -> None:
    per_rank = os.environ.get("DEVICE_RUN_CORES_PER_RANK")
    rank = os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMIX_RANK"))
    if not per_rank or rank is None or not hasattr(os, "sched_setaffinity"):
        return
    available = sorted(os.sched_getaffinity(0))
    cores = cores_for(int(rank), int(per_rank), available,
                      int(os.environ.get("DEVICE_RUN_CORE_OFFSET", "0")))
    if cores:
        os.sched_setaffinity(0, cores)
    log = os.environ.get("DEVICE_RUN_PIN_LOG")
    if log:
        what = ",".join(map(str, cores)) if cores else f"not pinned ({len(available)} cores)"
        with open(log, "a", encoding="utf-8") as fh:
            fh.write(f"rank {rank} pid {os.getpid()}: cores {what}\n")


try:
    _pin()
except Exception as exc:  # noqa: BLE001 - never stop a rank from starting; say why instead
    import sys

    print(f"device_pin: not pinned: {exc}", file=sys.stderr)
