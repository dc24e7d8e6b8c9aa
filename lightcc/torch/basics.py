"""Lifecycle, topology queries and build flags, under horovod.torch's names.

``init``/``shutdown`` wrap the core's and also reset this layer's handle table. The ``*_built``
functions describe what this installation can do and work before ``init()``; ``mpi_enabled``
and ``mpi_threads_supported`` need ``init()`` (as in Horovod).
"""
from __future__ import annotations

import importlib.util
import logging
from typing import Any, Sequence

from ..common import api as _api
from ..common.backends import mpi as mpi_backend
from ..common.exceptions import NotInitializedError

log = logging.getLogger("lightcc")

is_initialized = _api.is_initialized
size = _api.size
rank = _api.rank
local_size = _api.local_size
local_rank = _api.local_rank
cross_size = _api.cross_size
cross_rank = _api.cross_rank
is_homogeneous = _api.is_homogeneous

_reset_hooks: list = []     # callables run by init()/shutdown() (the handle table's reset)


def init(comm: Any = None, process_sets: Sequence[Any] | str | None = None,
         **overrides: Any) -> None:
    """Start lightcc (Horovod: ``hvd.init(comm=None, process_sets=None)``).

    ``comm`` is an mpi4py communicator or a list of world ranks; ``process_sets`` a list of
    :class:`ProcessSet` to register now, or ``"dynamic"`` (accepted for Horovod scripts: process
    sets can always be added later). Extra keywords override ``LCC_*`` settings.
    """
    if isinstance(process_sets, str):
        if process_sets.lower() != "dynamic":
            raise ValueError(f"process_sets must be a list of ProcessSet or 'dynamic', "
                             f"got {process_sets!r}")
        process_sets = None
    if not _api.is_initialized():      # a repeated init() keeps pending handles
        for reset in _reset_hooks:
            reset()
    _api.init(comm, process_sets, **overrides)


def shutdown() -> None:
    """Stop lightcc on this process; pending handles fail with ``ShutdownError``."""
    _api.shutdown()
    for reset in _reset_hooks:
        reset()


def _require_init() -> None:
    if not _api.is_initialized():
        raise NotInitializedError("lightcc has not been initialized; use hvd.init().")


def mpi_threads_supported() -> bool:
    """True when MPI runs with MPI_THREAD_MULTIPLE (needs ``init()``; False without MPI, under
    torchrun)."""
    _require_init()
    return _api.transport() == "mpi" and mpi_backend.thread_multiple()


def mpi_enabled() -> bool:
    """True once lightcc runs over MPI (after ``init()`` under mpirun/lccrun; False under
    torchrun and srun, where it runs without MPI)."""
    _require_init()
    return _api.transport() == "mpi"


def mpi_built() -> bool:
    """True when mpi4py is installed (lightcc's control plane and CPU data path)."""
    return importlib.util.find_spec("mpi4py") is not None


def gloo_enabled() -> bool:
    return False


def gloo_built() -> bool:
    """lightcc has no Gloo controller; MPI is always used."""
    return False


def nccl_built() -> int:
    """The NCCL version code usable through CuPy (e.g. 21803), or 0 when there is none."""
    if importlib.util.find_spec("cupy") is None:
        return 0
    try:
        from cupy.cuda import nccl

        return int(nccl.get_version())
    except Exception:  # no CUDA driver, no NCCL in this CuPy build
        return 0


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    """True when the GPU path (CuPy with NCCL) is available."""
    return nccl_built() != 0


def rocm_built() -> bool:
    return False


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start writing a Chrome/Perfetto trace to ``file_path`` on rank 0 (needs ``init()``)."""
    _require_init()
    _api.start_timeline(file_path, mark_cycles=mark_cycles)


def stop_timeline() -> None:
    """Stop the timeline started by :func:`start_timeline` and close its file."""
    _require_init()
    _api.stop_timeline()
