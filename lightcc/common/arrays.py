"""Array helpers shared by algorithms, compressors, backends and execution: how a buffer of
consecutive blocks is cut (counts in elements), element-wise reduction and scratch buffers.

Only calls that exist on both NumPy and CuPy arrays are used, so the same code runs on host and
device buffers; the array module is the buffer's own (this module never imports CuPy).
"""
from __future__ import annotations

import sys
from typing import Any, Sequence

import numpy as np

from .comm import REDUCE_OPS


def even_counts(total: int, parts: int) -> list[int]:
    """Split ``total`` elements into ``parts`` blocks, the first ``total % parts`` one larger."""
    base, extra = divmod(int(total), int(parts))
    return [base + (1 if i < extra else 0) for i in range(parts)]


def displacements(counts: Sequence[int]) -> list[int]:
    """Start offsets of consecutive blocks of the given sizes."""
    out, acc = [], 0
    for c in counts:
        out.append(acc)
        acc += int(c)
    return out


def num_pieces(nbytes: int, piece_bytes: int, max_pieces: int | None = None) -> int:
    """``ceil(nbytes / piece_bytes)``, at least 1 and at most ``max_pieces`` (None: no cap)."""
    n = -(-int(nbytes) // max(1, int(piece_bytes)))
    return max(1, n if max_pieces is None else min(int(max_pieces), n))


def sub_blocks(counts: Sequence[int], k: int) -> tuple[list[list[int]], list[list[int]]]:
    """Cut each block of a buffer of consecutive blocks (``counts``) into ``k`` sub-blocks.

    Returns ``(sizes, starts)``: sub-block ``j`` of block ``r`` is ``sizes[r][j]`` elements
    starting at offset ``starts[r][j]`` of the whole buffer (the same split on every rank).
    """
    sizes = [even_counts(c, k) for c in counts]
    starts = [[base + off for off in displacements(sz)]
              for base, sz in zip(displacements(counts), sizes)]
    return sizes, starts


def array_module(buf: Any) -> Any:
    """The array module ``buf`` belongs to: ``cupy`` for CuPy arrays (already imported by
    whoever made the array; nothing is imported here), ``numpy`` otherwise."""
    top = type(buf).__module__.split(".")[0]
    return sys.modules[top] if top == "cupy" else np


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
