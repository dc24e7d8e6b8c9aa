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

log = logging.getLogger("lightcc")

LINKS_VAR = "OMPI_MCA_btl_tcp_links"
_state: dict[str, Any] = {"set": None, "too_late": False, "warned": False}


def _mpi_initialized() -> bool:
    mpi = sys.modules.get("mpi4py.MPI")
    return mpi is not None and bool(mpi.Is_initialized())


def apply(num_links: int) -> None:
    """Put ``btl_tcp_links`` into the environment if MPI has not started yet and nobody else
    set it (a value lightcc set earlier is updated); else note whether it came too late."""
    if _mpi_initialized():
        if LINKS_VAR not in os.environ and _state["set"] is None:
            _state["too_late"] = True
        return
    current = os.environ.get(LINKS_VAR)
    if current is None or current == _state["set"]:
        _state["set"] = os.environ[LINKS_VAR] = str(num_links)


#: Set by mpirun / PMIx in the processes it starts (a launcher's own process has none).
RANK_VARS = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE")


def apply_from_environment() -> None:
    """:func:`apply` with ``LCC_NUM_LINKS``, at import, in processes mpirun started (not in a
    launcher such as lccrun or a test runner, whose environment its own children inherit). A
    bad value is left to ``init()``, which reports it on every rank."""
    if not any(name in os.environ for name in RANK_VARS):
        return
    from .config import KNOBS

    knob = next(k for k in KNOBS if k.field == "num_links")
    try:
        value = knob.parse(os.environ[knob.env]) if knob.env in os.environ else knob.default
    except (ValueError, TypeError):
        return
    if not knob.check(value):
        apply(value)


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
