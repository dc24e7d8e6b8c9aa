"""Adasum (adaptive summation): Horovod's ``op=Adasum`` over the ``Communicator`` protocol.

Reference: Maleki et al., "Scaling Distributed Training with Adaptive Summation" (MLSys 2021),
and Horovod's ``horovod/common/ops/adasum/`` (the semantics matched here, not its code).

Two vectors ``a`` and ``b`` are combined as::

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

a sum for orthogonal vectors, an average for parallel ones. A coefficient stays 1 when its
vector's squared norm is below ``sqrt(DBL_MIN)`` (a zero vector adds nothing, and the other is
kept unchanged). Over ``p = 2^k`` ranks the pairs form a binary tree over consecutive ranks:
``adasum(adasum(g0, g1), adasum(g2, g3))`` for 4. Every tensor of a fused buffer is its own
vector (its own dot product and norms); fusion does not change the result.

Execution, as in Horovod: vector halving, distance doubling. At level ``d = 1, 2, 4, ...`` a
rank and its partner ``rank ^ d`` own the same slice; each keeps one half (the lower rank the
first) and receives the partner's copy of it, so that after ``log2 p`` levels every rank owns
``1/p`` of the result. The per-tensor dot products and norms of a slice are partial sums: they
are summed in float64 over the ``2d`` ranks that share the subtree (recursive doubling inside
it) before the coefficients are applied. The slices then travel back in the reverse order
(an allgather). Dot products, norms and the scaled sum are computed in float64 and rounded once
into the buffer (float32 or float64; 16-bit floats arrive here as float32).

Sizes that are not a power of two are refused (:func:`check`), as in Horovod, whose documented
definition needs ``2^n`` ranks.
"""
from __future__ import annotations

import math
import sys
from typing import Any, Sequence

import numpy as np

from ..arrays import displacements
from ..comm import Communicator
from ..exceptions import InvalidArgumentError, UnsupportedDTypeError

TAG = 113
FLOATING = ("float16", "bfloat16", "float32", "float64")
#: Horovod's threshold under which a squared norm counts as zero (its coefficient stays 1).
TINY = math.sqrt(sys.float_info.min)


def _kernels():
    """kernels/adasum.py, imported at first use (numba's start-up is paid only by Adasum)."""
    from ..kernels import adasum

    return adasum


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def check(size: int, dtype: str, device: bool, compression: str, what: str) -> None:
    """Raise unless an Adasum allreduce can run: it needs a floating-point host tensor, no
    engine compression and a process set of ``2^k`` ranks. Depends only on values every rank
    sees alike, so every rank refuses the same call before anything is sent."""
    if dtype not in FLOATING:
        raise UnsupportedDTypeError(f"{what}: Adasum needs a floating-point tensor (float16, "
                                    f"bfloat16, float32 or float64), got {dtype}")
    if device:
        raise InvalidArgumentError(f"{what}: Adasum runs on host (CPU) tensors only; copy the "
                                   f"GPU tensor to the host first")
    if compression not in ("", "none"):
        raise InvalidArgumentError(
            f"{what}: Adasum reduces the tensor as given, engine compression ({compression!r}) "
            f"is not applied to it: cast the tensor (e.g. to float16) or use a per-tensor "
            f"Horovod-style compressor instead")
    if not is_power_of_two(size):
        raise InvalidArgumentError(f"{what}: Adasum needs a power-of-2 number of ranks (as in "
                                   f"Horovod); the process set has {size}")


def pair(a: np.ndarray, b: np.ndarray, dot: float, anorm2: float, bnorm2: float) -> None:
    """``a = adasum(a, b)`` in place, given the (full-vector) dot product and squared norms;
    ``a`` and ``b`` may be slices of the vectors the sums were taken over."""
    ca = 1.0 - dot / (2.0 * anorm2) if anorm2 >= TINY else 1.0
    cb = 1.0 - dot / (2.0 * bnorm2) if bnorm2 >= TINY else 1.0
    _kernels().scaled_add(a, ca, b, cb)


def _segments(starts: Sequence[int], counts: Sequence[int], lo: int, hi: int) -> list:
    """``(tensor index, start, end)`` of every tensor's part inside ``[lo, hi)``."""
    out = []
    for i, (s, c) in enumerate(zip(starts, counts)):
        a, b = max(s, lo), min(s + c, hi)
        if a < b:
            out.append((i, a, b))
    return out


def _exchange(comm: Communicator, send: Any, recv: Any, partner: int) -> None:
    rreq = comm.irecv(recv, partner, TAG)
    sreq = comm.isend(send, partner, TAG)
    rreq.wait()
    sreq.wait()


def _subtree_sum(comm: Communicator, vec: np.ndarray, level: int) -> None:
    """Sum ``vec`` (float64) over the ``2 * level`` ranks of this rank's subtree, in place, by
    recursive doubling; every member ends with bitwise the same sums (each step adds two
    values, and addition is commutative)."""
    tmp = np.empty_like(vec)
    mask = 1
    while mask <= level:
        _exchange(comm, vec, tmp, comm.rank ^ mask)
        vec += tmp
        mask <<= 1


def allreduce(comm: Communicator, buf: np.ndarray, counts: Sequence[int]) -> None:
    """Replace ``buf`` (1-D float32/float64, ``counts[i]`` elements of tensor ``i`` back to
    back) on every rank of ``comm`` by the per-tensor Adasum over the ranks, in place."""
    p, r = comm.size, comm.rank
    if p == 1 or buf.size == 0:
        return
    if not is_power_of_two(p):
        raise ValueError(f"Adasum needs a power-of-2 number of ranks, got {p}")
    if sum(counts) != buf.size:
        raise ValueError(f"Adasum: tensor sizes add up to {sum(counts)}, buffer has {buf.size}")
    starts = displacements(counts)
    lo, hi = 0, buf.size
    ranges = []                        # what this rank owned before each level (for the way back)
    recv = np.empty(buf.size - buf.size // 2, dtype=buf.dtype)
    level = 1
    while level < p:
        partner = r ^ level
        mid = lo + (hi - lo) // 2
        ranges.append((lo, hi))
        if r & level:                  # the right child: keep the second half
            keep, give = (mid, hi), (lo, mid)
        else:
            keep, give = (lo, mid), (mid, hi)
        theirs = recv[:keep[1] - keep[0]]
        _exchange(comm, buf[give[0]:give[1]], theirs, partner)
        lo, hi = keep
        mine = buf[lo:hi]
        segs = _segments(starts, counts, lo, hi)
        sums = np.zeros(3 * len(counts))       # per tensor: dot, |left|^2, |right|^2
        for i, s, e in segs:
            ab, aa, bb = _kernels().dot_norms(mine[s - lo:e - lo], theirs[s - lo:e - lo])
            left, right = (bb, aa) if r & level else (aa, bb)
            sums[3 * i:3 * i + 3] = (ab, left, right)
        _subtree_sum(comm, sums, level)
        for i, s, e in segs:
            ab, left, right = sums[3 * i:3 * i + 3]
            mine_n2, theirs_n2 = (right, left) if r & level else (left, right)
            pair(mine[s - lo:e - lo], theirs[s - lo:e - lo], ab, mine_n2, theirs_n2)
        if comm.progress is not None:
            comm.progress()
        level <<= 1
    level >>= 1
    while level >= 1:                  # allgather: give back the halves in reverse order
        partner = r ^ level
        plo, phi = ranges.pop()
        other = (plo, lo) if lo > plo else (hi, phi)
        _exchange(comm, buf[lo:hi], buf[other[0]:other[1]], partner)
        lo, hi = plo, phi
        level >>= 1
