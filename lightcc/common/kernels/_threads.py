"""Keep numba's parallel kernels from changing the caller's OpenMP thread count.

numba's ``omp`` threading layer (the default where libgomp is present, as with torch's CPU
wheels) sets the calling thread's OpenMP thread count to numba's when a parallel kernel
launches. torch reads the same setting, so a training script that had called
``torch.set_num_threads(1)`` found torch running 2 threads after its first compressed
allreduce, and its reductions stopped being reproducible. Every kernel launch that may use
threads runs inside :func:`threaded_launch`, which restores torch's thread count afterwards.
Launches on arrays under two tiles run the serial kernels (no thread pool, nothing to restore).

The same context sizes numba's thread pool. By default numba starts one thread per core in
*every* process, so with several ranks on one machine each rank's kernels ran as many threads
as there are cores, on top of the other ranks' communication: on a 2-core machine the pipelined
fp16 allreduce took 2.06 s for 64 MB instead of 0.29 s. ``init()`` calls :func:`configure`
with ``LCC_CODEC_THREADS`` (default 1: the serial kernels; 0 = the usable cores divided by the
ranks on this host), and every
kernel launch uses that many threads (numba's setting is per calling thread, so it is applied
at each launch; a cheap comparison when it is already right).
"""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Iterator

#: Threads each kernel launch uses (0 = leave numba's own setting); see :func:`configure`.
CODEC_THREADS = 0


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:   # pragma: no cover - not Linux
        return os.cpu_count() or 1


def configure(threads: int, ranks_on_host: int = 1) -> int:
    """Set :data:`CODEC_THREADS`: ``threads``, or for 0 the usable cores / ``ranks_on_host``.

    Capped by numba's pool size (``NUMBA_NUM_THREADS``). Returns the number chosen.
    """
    global CODEC_THREADS
    if threads <= 0:
        threads = max(1, usable_cores() // max(1, int(ranks_on_host)))
    numba = _numba()
    if numba is not None:
        threads = min(int(threads), int(numba.config.NUMBA_NUM_THREADS))
    CODEC_THREADS = int(threads)
    return CODEC_THREADS


def codec_threads() -> int:
    """Threads a kernel launch may use: :data:`CODEC_THREADS`, or numba's count when unset.

    Kernels run their serial build (no thread pool at all) when this is 1.
    """
    if CODEC_THREADS > 0:
        return CODEC_THREADS
    numba = sys.modules.get("numba")
    return int(numba.get_num_threads()) if numba is not None else 1


def _numba() -> Any:
    try:
        import numba
    except ImportError:   # pragma: no cover - numba is a dependency
        return None
    return numba


def _size_pool() -> None:
    if CODEC_THREADS > 0:
        numba = sys.modules.get("numba")
        if numba is not None and numba.get_num_threads() != CODEC_THREADS:
            numba.set_num_threads(CODEC_THREADS)


@contextlib.contextmanager
def threaded_launch() -> Iterator[int]:
    """Around a kernel launch that may use threads: gives the codec thread count (numba's pool
    sized to it), afterwards restores torch's thread count if numba changed it. torch's count
    is read first: merely asking numba for its thread count starts its pool, which already
    resets OpenMP's setting. With one codec thread numba's pool is never started; serial
    launches of small arrays skip this altogether (~3 µs)."""
    if CODEC_THREADS == 1:
        yield 1
        return
    torch = sys.modules.get("torch")
    before = torch.get_num_threads() if torch is not None else 0
    try:
        _size_pool()
        yield codec_threads()
    finally:
        if torch is not None and torch.get_num_threads() != before:
            torch.set_num_threads(before)
