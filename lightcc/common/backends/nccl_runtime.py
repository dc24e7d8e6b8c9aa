"""What the NCCL backend needs before a communicator exists: CuPy's NCCL module (checked),
whether NCCL is usable here, mpi4py (the unique id travels over MPI), and NCCL's names for ops
and dtypes. backends/nccl.py re-exports ``nccl_available``."""
from __future__ import annotations

from typing import Any

from ..exceptions import LightCCError
from ..kernels import cuda as kc

_OPS = {"sum": "NCCL_SUM", "prod": "NCCL_PROD", "max": "NCCL_MAX", "min": "NCCL_MIN"}
_TYPES = {"int8": "NCCL_INT8", "uint8": "NCCL_UINT8", "int32": "NCCL_INT32",
          "uint32": "NCCL_UINT32", "int64": "NCCL_INT64", "uint64": "NCCL_UINT64",
          "float16": "NCCL_FLOAT16", "float32": "NCCL_FLOAT32", "float64": "NCCL_FLOAT64",
          "bfloat16": "NCCL_BFLOAT16"}


def _nccl() -> Any:
    kc.cupy_or_raise()
    from cupy.cuda import nccl

    if not getattr(nccl, "available", True) or not hasattr(nccl, "NcclCommunicator"):
        raise LightCCError("CuPy was built without NCCL or libnccl is missing "
                           "(pip install nvidia-nccl-cu13)")
    return nccl


def nccl_available() -> bool:
    """True when CuPy, NCCL and at least one GPU are usable (for ``LCC_BACKEND=auto``)."""
    try:
        _nccl()
    except LightCCError:
        return False
    return kc.gpu_available()


def _mpi() -> Any:
    from mpi4py import MPI

    return MPI
