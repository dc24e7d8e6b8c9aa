"""Array helpers shared by the algorithms: element-wise reduction and scratch buffers.

Only calls that exist on both NumPy and CuPy arrays are used, so the same algorithm code runs
on host and device buffers; the array module is picked from the buffer's type.
"""
from __future__ import annotations

from typing import Any

from ..backends.base import REDUCE_OPS


def array_module(buf: Any) -> Any:
    """``cupy`` for CuPy arrays, ``numpy`` otherwise."""
    if type(buf).__module__.split(".")[0] == "cupy":
        import cupy

        return cupy
    import numpy

    return numpy


def like(arr: Any, ref: Any) -> Any:
    """``arr`` in the memory ``ref`` lives in (host or GPU); copied only when it differs."""
    xp = array_module(ref)
    if array_module(arr) is xp:
        return arr
    return arr.get() if hasattr(arr, "get") and xp.__name__ == "numpy" else xp.asarray(arr)


def host_copy(arr: Any) -> Any:
    """A NumPy copy of a host or device array (for state dicts)."""
    return arr.get() if array_module(arr).__name__ != "numpy" else arr.copy()


def reduce_into(dst: Any, src: Any, op: str) -> None:
    """``dst = dst <op> src`` element-wise, in place (``op`` in :data:`REDUCE_OPS`)."""
    if op == "sum":
        dst += src
    elif op == "prod":
        dst *= src
    elif op == "min":
        array_module(dst).minimum(dst, src, out=dst)
    elif op == "max":
        array_module(dst).maximum(dst, src, out=dst)
    elif op == "band":
        dst &= src
    elif op == "bor":
        dst |= src
    elif op == "bxor":
        dst ^= src
    else:
        raise ValueError(f"unknown reduction op {op!r}; known: {', '.join(REDUCE_OPS)}")


def empty(n: int, like: Any) -> Any:
    """A new uninitialised 1-D array of ``n`` elements with ``like``'s dtype and module."""
    return array_module(like).empty(int(n), dtype=like.dtype)


def uses_compressor(compressor: Any, op: str) -> bool:
    """Compressors only carry sums (the engine never passes one for min/max/prod)."""
    return compressor is not None and op == "sum"
