"""Open MPI settings lightcc's traffic needs, for jobs started without ``lccrun``.

``lccrun`` passes them to ``mpirun`` on the command line. Under a plain ``mpirun`` they can only
reach Open MPI as ``OMPI_MCA_*`` environment variables set before MPI starts (``MPI_Init``
reads them once), so they are set as early as possible: when lightcc is imported in a process
mpirun started, and again in ``init()`` (whose keyword arguments may change them). A value given to ``mpirun --mca`` (it
reaches the ranks as the same variable) or exported by the user wins.

The setting: ``btl_tcp_links`` = ``LCC_NUM_LINKS`` (default 2). Over one TCP connection per
pair of ranks a rank's rendezvous replies queue behind its own outgoing data, and back-to-back
messages of an exchange stalled for 40-60 ms each at 1 Gbit (docs/topology.md, "Slow links");
on 2 simulated hosts at 1 Gbit, lightcc trained at 0.92x the speed of DDP instead of 0.98x
uncompressed, and with fp16 at 0.87x the speed of DDP's fp16 hook instead of 1.01x.

The setting: how a rank waits (``LCC_MPI_IDLE_SLEEP_US``, default auto: 20 us when mpirun placed
the ranks on several hosts with several ranks on this one, else 0). Open MPI waits for a
request or a blocking collective by calling ``opal_progress`` in a loop; over TCP every turn is
an ``epoll_wait(…, 0)``, and with ``mpi_yield_when_idle`` a ``sched_yield``: a waiting rank kept
a core busy, ~45 % of it in the kernel (docs/profile-1gbit.md), taken from backward and from the
other ranks of the host. With a value above 0 lightcc sets ``mpi_yield_when_idle=1``,
``threads_pthreads_yield_strategy=nanosleep`` and ``threads_pthreads_nanosleep_time`` to it:
a turn of the loop that found nothing to do sleeps that long in the kernel, a turn that moved
data does not, so a transfer in progress runs at full speed and only idle waiting (a peer
still in backward, a wire that is busy) gives the core back. This covers every MPI wait,
blocking collectives included (a pause between ``MPI_Test`` calls in Python, branch ``prof``,
covered only point-to-point waits and slept up to 0.5 ms at a time, which cost 12-25 % of fp16
training at 1 Gbit). 0 leaves Open MPI's spinning wait. The price is latency: every idle turn
of a small message's exchange sleeps, so a 4-byte allreduce on one host took ~10x longer
(docs/profile-1gbit.md); on one host, where messages take microseconds, auto keeps the spin.

When the script started MPI first (``from mpi4py import MPI`` before ``import lightcc``, or a
framework that initializes MPI) and the variable was unset, it is too late: ``init()`` then
says so once, with the fix, if the job spans several hosts (one host never uses TCP between
its ranks).
"""
from __future__ import annotations

import logging
import os
import sys
from typing import Any

from .backends.launch import MPI_VARS

log = logging.getLogger("lightcc")

LINKS_VAR = "OMPI_MCA_btl_tcp_links"
_state: dict[str, Any] = {"set": {}, "too_late": False, "warned": False}


def _mpi_initialized() -> bool:
    mpi = sys.modules.get("mpi4py.MPI")
    return mpi is not None and bool(mpi.Is_initialized())


#: LCC_MPI_IDLE_SLEEP_US=auto on a job that spans several hosts (us)
AUTO_IDLE_SLEEP_US = 20


def idle_sleep(value: int | str, env: dict | os._Environ = os.environ) -> int:
    """The idle sleep in us for the knob's value: ``auto`` is :data:`AUTO_IDLE_SLEEP_US` when
    mpirun's variables say the job spans several hosts and this rank shares its host with
    other ranks (they compete for its cores while one waits for the wire), else 0 (one host:
    microsecond messages; one rank per host: the spin takes a core no other rank wants; or
    not started by Open MPI's mpirun)."""
    if value != "auto":
        return int(value)
    try:
        world = int(env["OMPI_COMM_WORLD_SIZE"])
        local = int(env["OMPI_COMM_WORLD_LOCAL_SIZE"])
    except (KeyError, ValueError):
        return 0
    return AUTO_IDLE_SLEEP_US if 1 < local < world else 0


def settings(num_links: int, idle_sleep_us: int | str) -> dict[str, str]:
    """The ``OMPI_MCA_*`` variables lightcc wants for these knob values."""
    idle_sleep_us = idle_sleep(idle_sleep_us)
    out = {LINKS_VAR: str(num_links)}
    if idle_sleep_us > 0:
        out.update({"OMPI_MCA_mpi_yield_when_idle": "1",
                    "OMPI_MCA_threads_pthreads_yield_strategy": "nanosleep",
                    "OMPI_MCA_threads_pthreads_nanosleep_time": str(int(idle_sleep_us) * 1000)})
    return out


def apply(num_links: int, idle_sleep_us: int | str = 0) -> None:
    """Put lightcc's Open MPI settings into the environment if MPI has not started yet and
    nobody else set them (a value lightcc set earlier is updated); else note whether
    ``btl_tcp_links`` came too late."""
    if _mpi_initialized():
        if LINKS_VAR not in os.environ and LINKS_VAR not in _state["set"]:
            _state["too_late"] = True
        return
    for var, value in settings(num_links, idle_sleep_us).items():
        current = os.environ.get(var)
        if current is None or current == _state["set"].get(var):
            _state["set"][var] = os.environ[var] = value
    if idle_sleep(idle_sleep_us) > 0:
        set_timer_slack(max(1000, idle_sleep(idle_sleep_us) * 100))


def set_timer_slack(ns: int) -> bool:
    """Let this thread's (and the threads it starts later) sleeps overrun by at most ``ns``.

    Linux lets a sleep of a normal thread end up to 50 us late (timer slack), which would turn
    every idle turn of Open MPI's progress loop into >= 50 us whatever nanosleep_time says; the
    slack is set to a tenth of the sleep. Linux only (``prctl(PR_SET_TIMERSLACK)``); returns
    whether it was set."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(29, ctypes.c_ulong(int(ns)), 0, 0, 0) == 0   # PR_SET_TIMERSLACK
    except (OSError, AttributeError):
        return False


#: Set by mpirun / PMIx in the processes it starts (a launcher's own process has none).
RANK_VARS = MPI_VARS


def apply_from_environment() -> None:
    """:func:`apply` with ``LCC_NUM_LINKS``, at import, in processes mpirun started (not in a
    launcher such as lccrun or a test runner, whose environment its own children inherit). A
    bad value is left to ``init()``, which reports it on every rank."""
    if not any(name in os.environ for name in RANK_VARS):
        return
    from .config import KNOBS

    values = []
    for field in ("num_links", "mpi_idle_sleep_us"):
        knob = next(k for k in KNOBS if k.field == field)
        try:
            value = knob.parse(os.environ[knob.env]) if knob.env in os.environ else knob.default
        except (ValueError, TypeError):
            return
        if knob.check(value):
            return
        values.append(value)
    apply(*values)


def warn_if_too_late(num_links: int, num_nodes: int, rank: int) -> None:
    """Rank 0, once per process: MPI started before lightcc could set ``btl_tcp_links``."""
    if not _state["too_late"] or _state["warned"] or num_links <= 1 or num_nodes <= 1 \
            or rank != 0:
        return
    from .backends.mpi import library_version

    if "Open MPI" not in library_version():
        return
    _state["warned"] = True
    log.warning("MPI was started before lightcc could configure it (mpi4py.MPI imported, or "
                "MPI initialized by another library, before lightcc): Open MPI uses one TCP "
                "connection per pair of ranks instead of LCC_NUM_LINKS=%d (at 1 Gbit, fp16 "
                "training ran at 0.87x DDP's fp16 hook instead of 1.01x; docs/topology.md). Fix: "
                "import lightcc before mpi4py, or launch with lccrun, or pass "
                "'mpirun --mca btl_tcp_links %d' (or export %s=%d before MPI starts).",
                num_links, num_links, LINKS_VAR, num_links)
