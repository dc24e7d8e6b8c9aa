"""algorithms/adasum.py in one process: ranks as threads over an in-memory communicator, against
the recursive Adasum formula computed here in NumPy (float64), at 1-8 ranks and buffers smaller
than the number of ranks (empty halves); and the checks that refuse what it does not support."""
from __future__ import annotations

import math
import queue
import threading
from dataclasses import dataclass, field

import numpy as np
import pytest

from lightcc.common.algorithms import adasum
from lightcc.common.comm import WireStats
from lightcc.common.exceptions import InvalidArgumentError, UnsupportedDTypeError

TINY = math.sqrt(np.finfo(np.float64).tiny)


def ref_adasum(vectors: list[np.ndarray]) -> np.ndarray:
    if len(vectors) == 1:
        return vectors[0]
    h = len(vectors) // 2
    a, b = ref_adasum(vectors[:h]), ref_adasum(vectors[h:])
    dot, aa, bb = float(a @ b), float(a @ a), float(b @ b)
    return (1 - dot / (2 * aa) if aa >= TINY else 1.0) * a + \
        (1 - dot / (2 * bb) if bb >= TINY else 1.0) * b


class _Req:
    def __init__(self, fn=None):
        self._fn = fn

    def wait(self) -> None:
        if self._fn is not None:
            self._fn()

    def test(self) -> bool:
        return True


@dataclass
class ThreadComm:
    """Point-to-point between threads: a send is a copy put on the (src, dst, tag) queue."""

    rank: int
    size: int
    boxes: dict
    name: str = "world"
    stats: WireStats = field(default_factory=WireStats)
    is_device: bool = False
    progress: object = None

    def isend(self, buf, dest, tag=0):
        self.boxes[(self.rank, dest, tag)].put(np.array(buf, copy=True))
        return _Req()

    def irecv(self, buf, source, tag=0):
        def land():
            buf[...] = self.boxes[(source, self.rank, tag)].get(timeout=30)
        return _Req(land)


def run(vectors: list[np.ndarray], counts: list[int]) -> list[np.ndarray]:
    p = len(vectors)
    boxes = {(s, d, adasum.TAG): queue.Queue() for s in range(p) for d in range(p)}
    bufs = [v.copy() for v in vectors]
    errors = []

    def rank(r):
        try:
            adasum.allreduce(ThreadComm(r, p, boxes), bufs[r], counts)
        except Exception as exc:       # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(p)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return bufs


@pytest.mark.parametrize("p", [1, 2, 4, 8])
@pytest.mark.parametrize("counts", [[1], [3], [5, 0, 2], [7, 1003], [64, 1, 1, 300]])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_matches_recursive_formula_per_tensor(p, counts, dtype):
    rng = np.random.default_rng(p * 100 + len(counts))
    common = rng.standard_normal(sum(counts))
    vectors = [(common + 0.5 * rng.standard_normal(sum(counts))).astype(dtype)
               for _ in range(p)]
    got = run(vectors, counts)
    tol = 1e-13 if dtype == np.float64 else 5e-7
    start = 0
    for c in counts:
        want = ref_adasum([v[start:start + c].astype(np.float64) for v in vectors])
        for r in range(p):
            err = np.abs(got[r][start:start + c] - want).max(initial=0.0)
            assert err <= tol * max(np.abs(want).max(initial=0.0), 1e-30), (r, c, err)
        start += c
    for r in range(1, p):           # every rank holds the same bits
        assert got[r].tobytes() == got[0].tobytes()


def test_non_power_of_two_is_refused():
    with pytest.raises(ValueError, match="power-of-2"):
        adasum.allreduce(ThreadComm(0, 3, {}), np.ones(4), [4])


@pytest.mark.parametrize("kwargs,exc,needle", [
    (dict(size=4, dtype="int32", device=False, compression="none"), UnsupportedDTypeError,
     "floating-point"),
    (dict(size=4, dtype="bool", device=False, compression="none"), UnsupportedDTypeError,
     "floating-point"),
    (dict(size=4, dtype="float32", device=True, compression="none"), InvalidArgumentError,
     "host (CPU)"),
    (dict(size=4, dtype="float32", device=False, compression="fp16"), InvalidArgumentError,
     "compression"),
    (dict(size=6, dtype="float32", device=False, compression="none"), InvalidArgumentError,
     "power-of-2"),
])
def test_check_refuses(kwargs, exc, needle):
    with pytest.raises(exc, match=needle.replace("(", r"\(").replace(")", r"\)")):
        adasum.check(what="allreduce 'x'", **kwargs)


@pytest.mark.parametrize("size", [1, 2, 4, 64])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_check_accepts(size, dtype):
    adasum.check(size, dtype, False, "none", "allreduce 'x'")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_kernels_match_numpy_fallback(monkeypatch, dtype):
    """The numba kernels and the NumPy pieces compute the same float64 sums and scaled add."""
    from lightcc.common.kernels import adasum as k

    rng = np.random.default_rng(3)
    a, b = (rng.standard_normal(200_003).astype(dtype) for _ in range(2))
    want = (float(a.astype(np.float64) @ b), float(a.astype(np.float64) @ a),
            float(b.astype(np.float64) @ b))
    fast = k.dot_norms(a, b)
    x = a.copy()
    k.scaled_add(x, 0.3, b, -1.7)
    monkeypatch.setattr(k, "HAVE_NUMBA", False)
    slow = k.dot_norms(a, b)
    y = a.copy()
    k.scaled_add(y, 0.3, b, -1.7)
    np.testing.assert_allclose(fast, want, rtol=1e-12)
    np.testing.assert_allclose(slow, want, rtol=1e-12)
    exact = (0.3 * a.astype(np.float64) - 1.7 * b.astype(np.float64)).astype(dtype)
    assert np.array_equal(x, exact) and np.array_equal(y, exact)
