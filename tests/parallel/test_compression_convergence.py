"""Accuracy of compressed training on scikit-learn's digits (2 ranks), each compressor against
none, with margins measured over seeds (one test image is 0.28 point of the 360).

Bars (mean accuracy drop vs uncompressed with the same seed, points): fp16/bf16/fp8 0.5,
TopK 1 % + EF 1.5, PowerSGD r=2 1.0; fp8 E4M3 through DistributedOptimizer 0.3.
"""
from pathlib import Path

import pytest

from tests.mpi_harness import run_mpi

WORKERS = Path(__file__).resolve().parent / "workers_compression"
ENV = {"NUMBA_NUM_THREADS": "1"}


@pytest.mark.timeout(500)
def test_convergence_within_bars():
    """64-128-10 MLP in NumPy, 300 steps, 12 seeds; each compressor sums the bucket of the
    tensors of 4096 bytes or more (the two weight matrices; the biases go exact, as in the
    engine) through compressor.allreduce (workers_compression/convergence_worker.py).
    Measured drop, mean ± standard deviation over the 12 seeds (standard error = sd / 3.5):
    fp16 0.00 ± 0.12, bf16 -0.09 ± 0.14, fp8 -0.02 ± 0.32, fp8 block 64 -0.05 ± 0.20,
    fp8 E5M2 -0.02 ± 0.30 (bar 0.5); TopK 1 % + EF 0.14 ± 1.00 (bar 1.5; without EF
    2.34 ± 1.56, reported only); PowerSGD r=2 0.02 ± 0.48 (bar 1.0). Before compressors
    worked per tensor, the old test (64-32-10, every tensor in the bucket, 2 seeds) failed
    with TopK + EF at 2.22."""
    pytest.importorskip("sklearn")
    out = run_mpi(2, [str(WORKERS / "convergence_worker.py")], env=ENV, timeout=490).stdout
    assert "OK convergence" in out, out[-3000:]


@pytest.mark.timeout(400)
def test_fp8_through_distributed_optimizer_within_0_3_points():
    """lightcc.torch.DistributedOptimizer(compression=fp8) (E4M3, a scale per tensor) on a
    64-128-10 MLP, 300 steps, 12 seeds (workers_compression/optimizer_convergence.py):
    drop 0.02 ± 0.14 points (mean ± sd over seeds; bar 0.3); bf16 0.05 ± 0.11 (bar 0.5)."""
    pytest.importorskip("sklearn")
    pytest.importorskip("torch")
    out = run_mpi(2, [str(WORKERS / "optimizer_convergence.py"), "fp8=0.3", "bf16=0.5"],
                  env=ENV, timeout=390).stdout
    assert out.count("OK optimizer convergence") == 2, out[-3000:]
