"""Adasum's two element loops (algorithms/adasum.py), in float64 as Horovod computes them.

:func:`dot_norms` returns ``(a.b, |a|^2, |b|^2)`` accumulated in float64 in one pass;
:func:`scaled_add` sets ``a = ca * a + cb * b`` computed in float64 and rounded once into ``a``.
The numba kernels release the GIL (the training thread keeps running) and sum in index order
(no fastmath, so the result does not depend on the vector width). Without numba, NumPy does the
same in float64 pieces of 64 K elements (an extra copy per piece; sums in another order).
On the 2-core development machine under load, NumPy's float64 pieces took 0.8-2 s for 2.5 M
float32 elements (``np.dot`` through BLAS per piece); the kernel is a single pass.
"""
from __future__ import annotations

import numpy as np

try:
    from numba import njit

    HAVE_NUMBA = True
except ImportError:  # pragma: no cover - numba is a dependency
    HAVE_NUMBA = False

_PIECE = 1 << 16

if HAVE_NUMBA:
    @njit(nogil=True, cache=True)
    def _dot_norms(a, b):  # pragma: no cover - compiled
        ab = 0.0
        aa = 0.0
        bb = 0.0
        for i in range(a.size):
            x = np.float64(a[i])
            y = np.float64(b[i])
            ab += x * y
            aa += x * x
            bb += y * y
        return ab, aa, bb

    @njit(nogil=True, cache=True)
    def _scaled_add(a, ca, b, cb):  # pragma: no cover - compiled
        for i in range(a.size):
            a[i] = ca * np.float64(a[i]) + cb * np.float64(b[i])


def dot_norms(a: np.ndarray, b: np.ndarray) -> tuple[float, float, float]:
    """``(a.b, |a|^2, |b|^2)`` of two 1-D float32/float64 arrays, accumulated in float64."""
    if HAVE_NUMBA:
        return _dot_norms(a, b)
    ab = aa = bb = 0.0
    for lo in range(0, a.size, _PIECE):
        x = a[lo:lo + _PIECE].astype(np.float64)
        y = b[lo:lo + _PIECE].astype(np.float64)
        ab += float(x @ y)
        aa += float(x @ x)
        bb += float(y @ y)
    return ab, aa, bb


def scaled_add(a: np.ndarray, ca: float, b: np.ndarray, cb: float) -> None:
    """``a = ca * a + cb * b`` in float64, rounded once into ``a`` (in place)."""
    if HAVE_NUMBA:
        _scaled_add(a, float(ca), b, float(cb))
        return
    for lo in range(0, a.size, _PIECE):
        wide = a[lo:lo + _PIECE].astype(np.float64)
        wide *= ca
        wide += cb * b[lo:lo + _PIECE].astype(np.float64)
        a[lo:lo + _PIECE] = wide
