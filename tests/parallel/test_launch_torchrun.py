"""lightcc started the torchrun way, with no MPI (issue 41): under torchrun itself and as
processes given torchrun's or Slurm's variables by hand (srun, Ray, Kubeflow). The suite's own
workers run unchanged (workers_core/*), inside a wrapper that fails if anything imports
mpi4py; results are checked there against NumPy / single-process torch references."""
from __future__ import annotations

import re
import sys

import pytest

sys.path.insert(0, __import__("os").path.dirname(__file__))
from launch_harness import NO_MPI, WORKERS, by_hand, plain, torchrun  # noqa: E402

CORE = "tests/parallel/workers_core/"
pytestmark = pytest.mark.timeout(400)


def _ok(out: str, word: str, n: int) -> None:
    assert out.count(word) == n, out[-6000:]
    assert out.count("no-mpi ok") == n, out[-6000:]


@pytest.mark.parametrize("np_", [2, 3])
def test_numpy_collectives_under_torchrun(np_):
    pytest.importorskip("torch")
    rc, out = torchrun(np_, [NO_MPI, CORE + "collectives.py"], env={"LCC_LOG_LEVEL": "info"})
    assert rc == 0, out[-6000:]
    _ok(out, "checks passed", np_)
    assert out.count("transport: MPI-free") == 1, out[-3000:]     # logged once, by rank 0


def test_engine_steady_state_and_errors_under_torchrun():
    """The control tree's steady state, process sets, join, and mismatches raised on every
    rank (workers_core/steady.py, errors.py) on 3 ranks."""
    pytest.importorskip("torch")
    for worker, word in (("steady.py", "steady ok"), ("errors.py", "errors ok")):
        rc, out = torchrun(3, [NO_MPI, CORE + worker], env={"LCC_CONTROL_FANOUT": "1"})
        assert rc == 0, out[-6000:]
        _ok(out, word, 3)


def test_slurm_variables_numpy_core_without_torch():
    """srun-style: SLURM_PROCID/SLURM_NTASKS set by hand, torch hidden (lightcc's own store)."""
    codes, out = by_hand(3, [NO_MPI, "--no-torch", CORE + "collectives.py"], kind="slurm")
    assert codes == [0, 0, 0], out[-6000:]
    _ok(out, "checks passed", 3)


@pytest.mark.parametrize("np_", [2, 3])
def test_c10d_backend_under_torchrun(np_):
    pytest.importorskip("torch")
    rc, out = torchrun(np_, [NO_MPI, str(WORKERS / "c10d_basic.py")])
    assert rc == 0, out[-6000:]
    _ok(out, "c10d ok", np_)


def test_algorithms_and_compressors_under_torchrun():
    pytest.importorskip("torch")
    rc, out = torchrun(3, [NO_MPI, str(WORKERS / "algorithms.py")],
                       env={"LCC_LOCAL_SIZE": "2"})
    assert rc == 0, out[-6000:]
    _ok(out, "algorithms ok", 3)


@pytest.mark.parametrize("mode", ["raise", "kill"])
def test_a_failing_rank_is_named_and_every_rank_exits_nonzero(mode):
    codes, out = by_hand(3, [str(WORKERS / "fail.py"), "1", mode], timeout=120)
    assert codes[0] != 0 and codes[2] != 0 and codes[1] != 0, (codes, out[-4000:])
    for r in (0, 2):
        assert f"rank {r}: LightCCError:" in out and "rank 1 " in out, out[-4000:]
    assert "survived" not in out, out[-4000:]


def test_unreachable_master_addr_is_named():
    pytest.importorskip("torch")
    codes, out = by_hand(2, ["-c", "import lightcc; lightcc.init()"], ranks=[1, 1],
                         env={"LCC_RENDEZVOUS_TIMEOUT": "3", "MASTER_PORT": "9"})
    assert codes[0] != 0 and "127.0.0.1:9" in out and "LightCCError" in out, out[-3000:]


def test_duplicate_rank_and_world_size_mismatch_are_named():
    pytest.importorskip("torch")
    codes, out = by_hand(3, ["-c", "import lightcc; lightcc.init()"], ranks=[0, 1, 1],
                         env={"LCC_RENDEZVOUS_TIMEOUT": "15"})
    assert all(c != 0 for c in codes) and out.count("RANK=1") >= 3, out[-3000:]
    codes, out = by_hand(2, ["-c", "import lightcc; lightcc.init()"],
                         env={"LCC_RENDEZVOUS_TIMEOUT": "15", "WORLD_SIZE": "3"})
    assert all(c != 0 for c in codes) and out.count("ranks [2] of world size 3") == 2, \
        out[-3000:]


def test_bad_transport_value_fails_on_every_rank():
    codes, out = by_hand(2, ["-c", "import lightcc; lightcc.init()"],
                         env={"LCC_TRANSPORT": "ib"}, timeout=60)
    assert codes == [1, 1] and out.count("LCC_TRANSPORT='ib'") == 2, out[-3000:]


def _accuracy(out: str) -> float:
    lines = re.findall(r"^epoch (\d+)/(\d+) .*test accuracy ([\d.]+)%", out, re.M)
    assert lines and len(lines) == int(lines[-1][1]), out[-4000:]     # one line per epoch
    return float(lines[-1][2])


def test_examples_under_torchrun_reach_their_lccrun_accuracy():
    """The issue's first client: ``torchrun --nproc-per-node 2 examples/ddp_mnist.py --backend
    lightcc`` and the Horovod-style examples/mnist.py, on the digits fallback, reach the 96 %
    their lccrun tests require (test_launcher.py, test_torch_examples.py)."""
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    rc, out = torchrun(2, [NO_MPI, "examples/ddp_mnist.py", "--backend", "lightcc",
                           "--data-dir", "/nonexistent"], timeout=300)
    assert rc == 0 and "backend lightcc" in out, out[-4000:]
    assert _accuracy(out) >= 96.0, out[-4000:]
    rc, out = torchrun(2, [NO_MPI, "examples/mnist.py", "--data-dir", "/nonexistent"],
                       timeout=300)
    assert rc == 0, out[-4000:]
    assert _accuracy(out) >= 96.0, out[-4000:]


@pytest.mark.parametrize("backend", ["lightcc", "gloo"])
def test_dcp_save_async_save_and_load_of_a_ddp_model(backend, tmp_path):
    """``dcp.async_save`` needs the group to declare the CPU device (it refused the lightcc
    group before); the same script on gloo is the reference."""
    pytest.importorskip("torch")
    rc, out = torchrun(2, [NO_MPI, str(WORKERS / "dcp_ddp.py"), backend, str(tmp_path)])
    assert rc == 0, out[-6000:]
    _ok(out, f"dcp ok on {backend}", 2)


def test_dcp_async_save_under_mpirun(tmp_path):
    pytest.importorskip("torch")
    from tests.mpi_harness import run_mpi
    out = run_mpi(2, [str(WORKERS / "dcp_ddp.py"), "lightcc", str(tmp_path)],
                  env={"PYTHONWARNINGS": "ignore"}, timeout=150).stdout
    assert out.count("dcp ok on lightcc") == 2, out[-4000:]


def _lightning_ok(out: str, transport: str) -> None:
    sums = re.findall(r"lightning rank (\d): checksum ([-\d.]+) loss [\d.]+ -> [\d.]+ "
                      r"transport (tcp|mpi)", out)
    assert sorted(r for r, _, _ in sums) == ["0", "1"], out[-5000:]
    assert sums[0][1] == sums[1][1], sums               # DDP kept the replicas equal
    assert {t for _, _, t in sums} == {transport}, sums


@pytest.mark.parametrize("launch", ["python", "torchrun", "lccrun"])
def test_lightning_ddp_strategy_with_a_lightcc_hook(launch):
    """Issue 41's report: Trainer(devices=2, strategy=DDPStrategy(process_group_backend=
    "lightcc", ddp_comm_hook=fp16 hook)) run with plain python (Lightning starts the second
    process), under torchrun and under lccrun (MPI)."""
    pytest.importorskip("pytorch_lightning")
    script = str(WORKERS / "lightning_ddp.py")
    if launch == "python":            # no launcher variables at all: Lightning sets them
        rc, out = plain([script], timeout=300)
    elif launch == "torchrun":
        rc, out = torchrun(2, [script], timeout=300)
    else:
        from tests.mpi_harness import run_mpi
        res = run_mpi(2, [script], env={"PYTHONWARNINGS": "ignore"}, timeout=300,
                      expect_rc=None)
        rc, out = res.returncode, res.stdout
    assert rc == 0, out[-5000:]
    _lightning_ok(out, "mpi" if launch == "lccrun" else "tcp")


def test_accelerate_on_an_existing_lightcc_group():
    pytest.importorskip("accelerate")
    rc, out = torchrun(2, [NO_MPI, str(WORKERS / "accelerate_ddp.py")], timeout=300)
    assert rc == 0, out[-5000:]
    _ok(out, "accelerate ok", 2)


def test_horovod_style_torch_api_under_torchrun(tmp_path):
    """The torch layer's own worker (DistributedOptimizer, broadcasts, SyncBatchNorm; 16 cases,
    workers_torch/check_train.py) unchanged under torchrun."""
    pytest.importorskip("torch")
    rc, out = torchrun(2, [NO_MPI, "tests/parallel/workers_torch/check_train.py"],
                       env={"LCC_TEST_TMP": str(tmp_path)}, timeout=300)
    assert rc == 0, out[-5000:]
    assert out.count("OK 16 cases") == 2 and out.count("no-mpi ok") == 2, out[-5000:]
