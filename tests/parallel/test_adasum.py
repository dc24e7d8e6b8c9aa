"""``op=Adasum`` on real ``mpirun`` jobs: the allreduce against the formula in NumPy at 2, 3 and 4
ranks, fused and unfused (workers_adasum/check_adasum.py; 3 ranks: refused on every rank, as in
Horovod), and ``DistributedOptimizer(op=Adasum)`` at 2 ranks against Horovod's documented step
simulated in one process (workers_adasum/optimizer.py)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.mpi_harness import Cases, run_mpi

W = Path(__file__).parent / "workers_adasum"


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> Cases:
    """One mpirun job per rank count runs both modes (workers_core/cases.py), 2 ranks also
    the optimizer: 3 launches instead of 7."""
    c = Cases(tmp_path_factory.mktemp("adasum_cases"), timeout=540)
    for np_ in (2, 3, 4):
        for mode in ("fused", "unfused"):
            c.add(np_, f"adasum-{np_}-{mode}", str(W / "check_adasum.py"), args=[mode],
                  env={"LCC_FUSION_THRESHOLD": "0"} if mode == "unfused" else None)
    if importlib.util.find_spec("torch") is not None:
        c.add(2, "optimizer", str(W / "optimizer.py"))
    return c


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["fused", "unfused"])
@pytest.mark.parametrize("np_", [2, 3, 4])
def test_adasum_allreduce_matches_numpy(jobs, np_: int, mode: str) -> None:
    out = jobs.output(np_, f"adasum-{np_}-{mode}")
    assert out.count(f"OK p={np_} {mode}") == np_, out[-3000:]


@pytest.mark.timeout(600)
def test_adasum_optimizer_matches_reference(jobs) -> None:
    pytest.importorskip("torch")
    out = jobs.output(2, "optimizer")
    assert out.count("OK adasum optimizer") == 2, out[-3000:]


@pytest.mark.timeout(200)
def test_synthetic_benchmark_runs_with_use_adasum() -> None:
    """examples/synthetic_benchmark.py --use-adasum (Horovod's flag) trains at 2 ranks."""
    pytest.importorskip("torch")
    example = Path(__file__).resolve().parents[2] / "examples" / "synthetic_benchmark.py"
    out = run_mpi(2, [str(example), "--model", "convnet", "--batch-size", "8",
                      "--num-warmup-batches", "1", "--num-iters", "2",
                      "--num-batches-per-iter", "2", "--use-adasum"], timeout=180).stdout
    assert "Adasum" in out and "Total img/sec on 2 rank(s)" in out, out[-3000:]
