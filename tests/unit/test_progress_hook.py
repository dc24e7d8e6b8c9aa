"""``Communicator.progress``: long point-to-point exchanges call it between their pieces (the
engine passes new submissions on to the coordinator there), and their results do not change.

Thread ranks over ``tests.doubles.fake_nccl``'s host communicator; references in NumPy.
"""
from __future__ import annotations

import numpy as np
import pytest

from lightcc.common.algorithms import ring
from lightcc.common.arrays import even_counts
from lightcc.common.compression import make, twophase
from tests.doubles.fake_nccl import run_ranks, thread_worlds


def _inputs(size: int, n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(11)
    return [rng.standard_normal(n).astype(np.float32) for _ in range(size)]


@pytest.mark.parametrize("size", [2, 3])
def test_pipelined_fp16_calls_progress_between_pieces(monkeypatch, size):
    monkeypatch.setattr(twophase, "PIECE_BYTES", 4096)         # 1024 floats per piece
    n = 10_000
    xs = _inputs(size, n)
    worlds = thread_worlds(size)
    calls = [0] * size
    for r, comm in enumerate(worlds):
        def hook(r=r):
            calls[r] += 1
        comm.progress = hook

    def body(r: int) -> np.ndarray:
        buf = xs[r].copy()
        make("fp16").allreduce(worlds[r], buf, None)
        return buf

    out = run_ranks(size, body)
    # reference: every rank's fp16 copy, summed in fp32 in rank order, rounded to fp16 once
    ref = np.zeros(n, np.float32)
    for x in xs:
        ref += x.astype(np.float16).astype(np.float32)
    ref = ref.astype(np.float16).astype(np.float32)
    pieces = twophase.num_pieces(-(-n // size), 4096)
    assert pieces > 1
    for r in range(size):
        np.testing.assert_array_equal(out[r], ref)
        assert calls[r] >= pieces, (r, calls[r], pieces)


def test_ring_calls_progress_per_chunk_and_step():
    size, n = 3, 30_000
    xs = _inputs(size, n)
    worlds = thread_worlds(size)
    calls = [0] * size
    for r, comm in enumerate(worlds):
        comm.ring_chunk_bytes = 4096
        def hook(r=r):
            calls[r] += 1
        comm.progress = hook

    def body(r: int) -> np.ndarray:
        buf = xs[r].copy()
        ring.ring_allreduce(worlds[r], buf, "sum")
        return buf

    out = run_ranks(size, body)
    ref = np.sum(np.stack(xs).astype(np.float64), axis=0)
    for r in range(size):
        np.testing.assert_allclose(out[r], ref, rtol=1e-5, atol=1e-5)
        # one call per chunk and step, in both passes
        k = ring.num_chunks(even_counts(n, size), 4, 4096)
        assert calls[r] == 2 * (size - 1) * k, (r, calls[r], k)


def test_communicators_without_a_hook_still_work():
    """Communicators made outside the engine (no ``progress`` attribute) run as before."""
    size, n = 2, 5000
    xs = _inputs(size, n)
    worlds = thread_worlds(size)
    assert not hasattr(worlds[0], "progress")

    def body(r: int) -> np.ndarray:
        buf = xs[r].copy()
        ring.ring_allreduce(worlds[r], buf, "sum")
        return buf

    out = run_ranks(size, body)
    for r in range(size):
        np.testing.assert_allclose(out[r], xs[0] + xs[1], rtol=1e-6, atol=1e-6)
