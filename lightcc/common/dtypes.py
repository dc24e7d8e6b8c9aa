"""Supported element types and how each is reduced.

MPI has no float16/bfloat16 arithmetic, so those are reduced in a float32 buffer (fp32
accumulation) and cast back; bool is reduced as uint8 with max (or) / min (and). The bitwise
ops (band, bor, bxor) apply to integer and bool tensors only.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .exceptions import InvalidArgumentError, UnsupportedDTypeError

try:  # bfloat16 / fp8 NumPy types
    import ml_dtypes

    BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is a hard dependency, but stay importable
    ml_dtypes = None
    BFLOAT16 = None

_NAMES = ["uint8", "int8", "uint16", "int16", "int32", "int64", "float16", "float32", "float64",
          "bool"]
SUPPORTED: dict[str, np.dtype] = {n: np.dtype(n) for n in _NAMES}
if BFLOAT16 is not None:
    SUPPORTED["bfloat16"] = BFLOAT16

FLOATING = {"float16", "bfloat16", "float32", "float64"}
INTEGER = {"uint8", "int8", "uint16", "int16", "int32", "int64"}
OPS = ("sum", "average", "min", "max", "prod", "band", "bor", "bxor")
BITWISE = ("band", "bor", "bxor")   # bitwise and / or / xor: integer and bool tensors only


_NAME_CACHE: dict[np.dtype, str] = {}


def name_of(dtype: np.dtype) -> str:
    """The canonical name of a supported dtype; UnsupportedDTypeError otherwise."""
    cached = _NAME_CACHE.get(dtype)
    if cached is not None:
        return cached
    dt = np.dtype(dtype)
    name = "bfloat16" if BFLOAT16 is not None and dt == BFLOAT16 else dt.name
    if name not in SUPPORTED:
        raise UnsupportedDTypeError(
            f"dtype {dt} is not supported; supported: {', '.join(sorted(SUPPORTED))}")
    if isinstance(dtype, np.dtype):
        _NAME_CACHE[dtype] = name
    return name


def itemsize(name: str) -> int:
    return SUPPORTED[name].itemsize


def reduce_dtype(name: str) -> np.dtype:
    """The dtype the reduction runs in (float32 for 16-bit floats, uint8 for bool)."""
    if name in ("float16", "bfloat16"):
        return np.dtype(np.float32)
    if name == "bool":
        return np.dtype(np.uint8)
    return SUPPORTED[name]


def backend_op(op: str, name: str) -> str:
    """The backend op for a user op ('average' is reduced as 'sum' then scaled)."""
    if name == "bool":
        return {"sum": "max", "max": "max", "min": "min", "prod": "min", "band": "band",
                "bor": "bor", "bxor": "bxor"}[op]
    return "sum" if op == "average" else op


def check_op(op: str, name: str, what: str) -> None:
    """Raise at submit time when ``op`` cannot be applied to dtype ``name``."""
    if op not in OPS:
        raise InvalidArgumentError(f"{what}: unknown op {op!r}; use one of {', '.join(OPS)}")
    if name == "bool" and op == "average":
        raise UnsupportedDTypeError(f"{what}: Average is not defined for bool tensors")
    if op in BITWISE and name not in INTEGER and name != "bool":
        raise UnsupportedDTypeError(f"{what}: bitwise op {op!r} needs an integer or bool "
                                    f"tensor, got {name}")


def scale_integers(values: np.ndarray, factor: float, out: np.ndarray | None = None,
                   xp: Any = np) -> np.ndarray:
    """``values * factor`` for an integer array, the way Horovod scales integer tensors.

    Horovod multiplies each element by the float64 factor and converts back to the element
    type, which truncates toward zero (C's float-to-integer conversion); an Average's
    ``1/size`` is folded into that factor. lightcc computes the same float64 product and
    truncation; a result outside the element type's range wraps like an integer overflow
    (Horovod leaves that case undefined). Writes into ``out`` (default: ``values``, in place)
    and returns it. ``xp``: the array module (NumPy, or CuPy for device arrays).
    """
    target = values if out is None else out
    product = xp.trunc(values.astype(np.float64) * np.float64(factor))
    xp.copyto(target, product.astype(np.int64), casting="unsafe")
    return target


def check_scaling(pre: float, post: float, name: str, what: str) -> None:
    """Scale factors apply to floating-point and integer dtypes, not to bool."""
    if (pre != 1.0 or post != 1.0) and name not in FLOATING and name not in INTEGER:
        raise InvalidArgumentError(f"{what}: prescale/postscale factors need a numeric tensor, "
                                   f"got {name}")
