"""Cross-barrier DistributedOptimizer on real ``mpirun`` jobs (issue 30).

The same worker trains the same configurations in barrier mode and in cross-barrier mode (in
separate cases of a job, each with a fresh init, so compressor state and bucket timing are
independent); rank 0's parameters
after 20 steps and the no_grad eval outputs every 5 steps must be equal bit for bit. The
cross-barrier job also checks the uncompressed SGD/Adam/AdamW/Adagrad runs against
single-process torch on the concatenated batch within 1e-6 (measured: passes with 2 and 3
ranks; RMSprop reaches 5.5e-6 in both modes and is only compared bitwise).
"""
from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from tests.mpi_harness import Cases, run_mpi  # noqa: E402

W = Path(__file__).parent / "workers_torch"
# (ranks, configuration set, environment) of each comparison: barrier and cross-barrier mode
# train it in separate cases (a fresh init each, so compressor state and bucket timing are
# independent) of one mpirun job per rank count (workers_core/cases.py): 3 launches, not 12
COMPARE = {"exact-2": (2, "exact", {}),
           "lossy-2": (2, "lossy", {"LCC_FUSION_THRESHOLD": "0"}),
           "core-3": (3, "core", {"LCC_FUSION_THRESHOLD": "0"}),
           "partition-exact-2": (2, "exact", {"XBAR_PARTITION": "60"}),
           "partition-core-3": (3, "core", {"XBAR_PARTITION": "60", "LCC_FUSION_THRESHOLD": "0"}),
           "core-4-2nodes": (4, "core", {"LCC_FUSION_THRESHOLD": "0", "LCC_LOCAL_SIZE": "2"}),
           "deterministic-3": (3, "core", {"LCC_DETERMINISTIC": "1"})}
pytestmark = pytest.mark.timeout(900)        # the first test of a rank count runs its job


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    base = tmp_path_factory.mktemp("xbar_cases")
    c = Cases(base, timeout=840)
    for key, (np_, which, env) in COMPARE.items():
        for mode in ("barrier", "xbar"):
            c.add(np_, f"{key}-{mode}", str(W / "cross_barrier_train.py"),
                  args=[mode, which, str(base / f"{key}-{mode}.pt")], env=env)
    return c, base


def _compare(jobs, key: str) -> None:
    c, base = jobs
    np_ = COMPARE[key][0]
    files = {}
    for mode in ("barrier", "xbar"):
        out = c.output(np_, f"{key}-{mode}")
        assert out.count(" OK ") == np_, out[-4000:]
        files[mode] = base / f"{key}-{mode}.pt"
    a, b = torch.load(files["barrier"]), torch.load(files["xbar"])
    assert a.keys() == b.keys() and a
    bad = []
    for tag in a:
        for name, p in a[tag]["params"].items():
            if not torch.equal(p, b[tag]["params"][name]):
                bad.append(f"{tag} {name}: max diff "
                           f"{(p - b[tag]['params'][name]).abs().max().item():.3g}")
        for i, (x, y) in enumerate(zip(a[tag]["evals"], b[tag]["evals"], strict=True)):
            if not torch.equal(x, y):
                bad.append(f"{tag} eval forward {i}: max diff {(x - y).abs().max().item():.3g}")
    assert not bad, "cross-barrier != barrier mode:\n" + "\n".join(bad)


def test_bitwise_equal_to_barrier_mode_2_ranks(jobs):
    """SGD (momentum, nesterov, weight decay), AdamW, Adam foreach/fused, RMSprop, Adagrad;
    fp32, fp16, bf16; backward_passes_per_step=2; clipping and GradScaler at the explicit
    synchronize() sync point; LR scheduler every step; add_param_group; unused, shared and
    twice-called parameters; no_grad eval forwards."""
    _compare(jobs, "exact-2")


def test_bitwise_equal_to_barrier_mode_lossy_compressors(jobs):
    """fp8, TopK + error feedback, PowerSGD (fusion off: one bucket per tensor in both
    modes, as these compressors' results depend on the bucket)."""
    _compare(jobs, "lossy-2")


def test_bitwise_equal_to_barrier_mode_3_ranks(jobs):
    """SGD/AdamW with fp32, fp16 and TopK, and a process set of ranks 0 and 2."""
    _compare(jobs, "core-3")


@pytest.mark.parametrize("np_,which", [(2, "exact"), (3, "core")])
def test_partitioned_gradients_bitwise_equal_to_barrier_mode(jobs, np_, which):
    """Cross-barrier mode with every gradient over 60 bytes cut into pieces (uncompressed,
    fp16, bf16 are cut; fp8/TopK are not): the same bits as barrier mode, whole tensors, and
    (uncompressed) single-process torch within 1e-6."""
    _compare(jobs, f"partition-{which}-{np_}")


def test_bitwise_equal_to_barrier_mode_4_ranks_2_nodes(jobs):
    """As the 3-rank test, on 2 simulated nodes of 2 ranks (LCC_LOCAL_SIZE=2)."""
    _compare(jobs, "core-4-2nodes")


@pytest.mark.timeout(300)
def test_refusals_stale_reads_zero_grad_compile(tmp_path):
    out = run_mpi(2, [str(W / "check_cross_barrier.py")], timeout=280).stdout
    assert out.count("OK 11 cases") == 2, out[-4000:]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("xbar", ["0", "1"])
def test_rank_raising_mid_step_does_not_hang(xbar):
    """Under plain mpirun: rank 1's uncaught error ends the job (init()'s exit hook aborts),
    instead of rank 1 waiting in MPI_Finalize while rank 0 waits in a bucket for it."""
    res = run_mpi(2, [str(W / "cross_barrier_raise.py")], timeout=150, expect_rc=None,
                  env={"XBAR": xbar, "LCC_STALL_SHUTDOWN_TIME": "5"})
    assert res.returncode != 0, res.stdout[-4000:]
    assert "rank 1 fails in the middle of backward" in res.stdout, res.stdout[-4000:]
    assert "finished without error" not in res.stdout, res.stdout[-4000:]
    assert "MPI_ABORT was invoked on rank 1" in res.stdout, res.stdout[-4000:]


def test_deterministic_sums_bitwise_equal_with_any_buckets(jobs):
    """LCC_DETERMINISTIC=1 with the default fusion threshold: cross-barrier mode cuts its
    buckets by priority and barrier mode does not, so a tensor sits at other offsets of other
    buckets; with every float32 element summed in rank order the parameters are still bitwise
    those of barrier mode (checked to fail without the knob: SGD's parameters differed by up
    to 3e-8). 4 ranks on 2 simulated nodes passed as well when run by hand (left out of CI for
    time: the scheme is the same world-wide one)."""
    _compare(jobs, "deterministic-3")
