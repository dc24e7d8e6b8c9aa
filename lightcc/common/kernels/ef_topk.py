"""Error feedback fused with per-tensor top-k selection on the host (:func:`ef_topk`, used by the
TopK compressor): one pass over memory per tensor, numba kernels with the GIL released. The
selection itself is ``sparse.topk_indices``; this module adds the residual bookkeeping."""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from . import sparse
from .floatcast import HAVE_NUMBA

if HAVE_NUMBA:
    from numba import njit


def ef_topk(buf: Any, res: Any, ks: Any) -> tuple[np.ndarray, np.ndarray]:
    """Error feedback and top-k selection **per tensor**, in one pass over memory per tensor:
    ``res += buf``, ``buf`` zeroed, and each tensor's ``k`` largest ``|res|`` (NaN/Inf
    largest, ties to the lower index) taken out of its residual (zeroed there).

    ``res`` is a float32 host array, or a list of ``(start, array)`` covering ``buf`` in order
    (each tensor's residual in a fused bucket); ``buf`` is an array, or such a list part for
    part with ``res`` (the bucket's tensors, never packed). ``ks`` gives each part its ``k``
    (an int for a single array). Returns the chosen positions in the buffer (ascending, int64)
    and their values: part ``i`` contributes exactly ``sparse.topk_indices(buf_i + res_i, ks[i])``,
    whatever the other parts hold, so a tensor's selection does not depend on its bucket.

    A large part estimates its k-th magnitude from a stratified sample, then adds, zeroes and
    collects the ~1.25 k candidates above the estimate in one numba pass per 16 KB tile and
    finishes exactly on the candidates; a small one (or a missed estimate) sums first and
    selects exactly (``np.partition`` on the magnitudes).
    """
    parts = [(0, res)] if isinstance(res, np.ndarray) else list(res)
    if isinstance(buf, np.ndarray):
        bufs = [buf[lo:lo + r.size] for lo, r in parts]
    else:
        bufs = [b for _, b in buf]
        assert [lo for lo, _ in buf] == [lo for lo, _ in parts] and all(
            b.size == r.size for b, (_, r) in zip(bufs, parts)), "parts of buf and res differ"
    ks = [ks] if isinstance(ks, (int, np.integer)) else list(ks)
    assert len(ks) == len(parts), "one k per part"
    ks = [int(min(max(k, 0), r.size)) for k, (_, r) in zip(ks, parts)]
    idx = np.empty(sum(ks), np.int64)
    vals = np.empty(sum(ks), np.float32)
    at = 0
    for (lo, r), b, k in zip(parts, bufs, ks):
        _ef_topk_part(b, r, k, idx[at:at + k], vals[at:at + k])
        idx[at:at + k] += lo
        at += k
    return idx, vals


#: parts up to this many elements select exactly (no sample); larger ones sample
EXACT_MAX = 1 << 16
_NO_POSITIONS = np.empty(0, np.int64)    # _emit: every element is a candidate


def _ef_topk_part(buf: np.ndarray, res: np.ndarray, k: int, idx: np.ndarray,
                  vals: np.ndarray) -> None:
    """:func:`ef_topk` of one part: ``idx`` (positions in the part) and ``vals`` get its k."""
    n = res.size
    if not sparse.HAVE_NUMBA:
        np.add(buf, res, out=res)
        buf.fill(0.0)
        _take(res, sparse.topk_indices(res, k), idx, vals)
        return
    if k == 0:
        _ef_add(buf, res)
        return
    if n > EXACT_MAX and k < n // 8:
        # one sample point per ~64 elements (a quarter of the cache lines; up to sparse.SAMPLE): the
        # threshold sits ``m`` points from the top, with ``m - 4 sqrt(m)`` points for the k
        # wanted, so that fewer than k candidates is a 4-sigma miss
        nsample = min(sparse.SAMPLE, max(1024, n // 64))
        m = (2.0 + math.sqrt(4.0 + k * nsample / n)) ** 2
        want = max(1.25 * k, m * n / nsample)
        pos = nsample - int(math.ceil(want * nsample / n)) - 1
        if pos > 0 and want < n // 4:
            sample = np.empty(nsample, np.float32)
            _sample_keys(buf, res, sample)
            sample.partition(pos)
            cap = 2 * int(want) + 64
            cidx = np.empty(cap, np.int64)
            cval = np.empty(cap, np.float32)
            got = sparse._ef_gather(buf, res, sample[pos], cidx, cval)
            if k <= got <= cap:
                keys = _keys(cval[:got])
                if got > k:
                    keys.partition(got - k)
                _emit(cidx[:got], cval[:got], keys[got - k], k, res, idx, vals)
                return
            _exact_part(res, k, idx, vals, add=None)   # the estimate missed: from the sums
            return
    _exact_part(res, k, idx, vals, add=buf)


def _exact_part(res: np.ndarray, k: int, idx: np.ndarray, vals: np.ndarray, add: Any) -> None:
    """Exactly the ``k`` largest ``|res (+ add)|`` out of ``res`` (``add`` zeroed first)."""
    keys = np.empty(res.size, np.float32)
    if add is None:
        _sum_keys(res, res, keys, False)
    else:
        _sum_keys(add, res, keys, True)
    keys.partition(res.size - k)
    _emit(_NO_POSITIONS, res, keys[res.size - k], k, res, idx, vals)


def _take(res: np.ndarray, chosen: np.ndarray, idx: np.ndarray, vals: np.ndarray) -> None:
    idx[:] = chosen
    vals[:] = res[chosen]
    res[chosen] = 0.0


def _keys(v: np.ndarray) -> np.ndarray:
    """Selection keys: ``|v|`` as float32, NaN as +Inf."""
    keys = np.abs(v)
    keys[np.isnan(keys)] = np.inf
    return keys


if HAVE_NUMBA:
    @njit(nogil=True, cache=True)
    def _ef_add(buf, res):  # pragma: no cover - compiled
        for j in range(res.size):
            res[j] = buf[j] + res[j]
            buf[j] = 0.0

    @njit(nogil=True, cache=True)
    def _sum_keys(buf, res, keys, add):  # pragma: no cover - compiled
        """``res += buf`` and ``buf = 0`` when ``add``; ``keys = |res|`` (NaN as +Inf)."""
        inf = np.float32(np.inf)
        for j in range(res.size):
            if add:
                res[j] = buf[j] + res[j]
                buf[j] = 0.0
            a = abs(res[j])
            keys[j] = inf if a != a else a

    @njit(nogil=True, cache=True)
    def _sample_keys(buf, res, out):  # pragma: no cover - compiled
        """``|buf + res|`` (NaN as +Inf) at one position per stratum of about ``n / out.size``
        elements, picked by a fixed hash: a sample without a random state, a sort or a
        division per point (fixed point in 20 fractional bits)."""
        n, m = res.size, out.size
        inf = np.float32(np.inf)
        step = (n << 20) // m
        width = step >> 20
        for i in range(m):
            h = (i * 2654435761) & 0xFFFFF
            p = ((i * step) >> 20) + ((h * width) >> 20)
            a = abs(buf[p] + res[p])
            out[i] = inf if a != a else a

    @njit(nogil=True, cache=True)
    def _emit(cidx, cval, kth, k, res, idx, vals):  # pragma: no cover - compiled
        """The ``k`` candidates with the largest keys (ties: the earlier ones) into
        ``idx``/``vals`` in order, their residual entries zeroed; ``kth`` is the k-th key.
        Candidate ``j`` is at ``cidx[j]`` with value ``cval[j]``; with an empty ``cidx`` every
        element of ``res`` (= ``cval``) is a candidate."""
        inf = np.float32(np.inf)
        every = cidx.size == 0
        above = 0
        for j in range(cval.size):
            a = abs(cval[j])
            if (inf if a != a else a) > kth:
                above += 1
        need = k - above
        o = 0
        for j in range(cval.size):
            a = abs(cval[j])
            a = inf if a != a else a
            if a > kth or (a == kth and need > 0):
                if not a > kth:
                    need -= 1
                at = j if every else cidx[j]
                idx[o] = at
                vals[o] = cval[j]
                res[at] = 0.0
                o += 1
