"""lightcc.torch keeps Horovod's semantics (issue 17), on real ``mpirun`` jobs.

Each test runs one group of workers_torch/check_horovod_compat.py; the references there come
from Horovod's documented behaviour (its autograd functions, its integer scaling, its own
test_torch.py vectors), computed from every rank's inputs, never from lightcc's output.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from tests.mpi_harness import REPO, Cases, mpi_env  # noqa: E402

WORKERS = Path(__file__).parent / "workers_torch"
WORKER = str(WORKERS / "check_horovod_compat.py")


GROUPS = {2: ["grads", "intscale", "compressors", "join"], 3: ["root", "residuals"]}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> Cases:
    """Every group of checks as a case of one mpirun job per rank count
    (workers_core/cases.py): 2 launches instead of 6."""
    c = Cases(tmp_path_factory.mktemp("hvd_cases"), timeout=540)
    for ranks, groups in GROUPS.items():
        for group in groups:
            c.add(ranks, group, WORKER, args=[group])
    return c


def _run(jobs: Cases, group: str, ranks: int, cases: int) -> None:
    out = jobs.output(ranks, group)
    assert out.count(f"OK {cases} cases") == ranks, out[-4000:]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("group,ranks,cases", [
    pytest.param("grads", 2, 8, id="item1-gradients-of-allgather-broadcast-reducescatter"),
    pytest.param("root", 3, 5, id="item2-root-rank-is-global-in-process-sets"),
    pytest.param("intscale", 2, 5, id="item3-integer-tensors-scale-like-horovod"),
    pytest.param("compressors", 2, 5, id="item4-compressor-objects-and-user-compressors"),
])
def test_horovod_semantics(jobs, group, ranks, cases):
    _run(jobs, group, ranks, cases)


@pytest.mark.timeout(600)
def test_join_with_uneven_data_matches_horovod(jobs):
    """Issue 17 item 5 (fixed by 2fbe244): before it, an allgather while a rank had joined
    returned instead of raising."""
    _run(jobs, "join", 2, 4)


@pytest.mark.timeout(600)
def test_error_feedback_residuals_are_kept_per_process_set(jobs):
    """Issue 17 item 8 (fixed by the per-process-set Group): failed before it, with 7372.0 in
    a sum of zeros."""
    _run(jobs, "residuals", 3, 2)


def _lccrun(args: list[str], timeout: float) -> str:
    """Run ``lccrun`` itself (not mpirun: the flag under test is the launcher's) with no
    inherited LCC_* variable; a hang fails with the job's output."""
    env = {k: v for k, v in mpi_env().items() if not k.startswith("LCC_")}
    proc = subprocess.Popen([sys.executable, "-m", "lightcc.runner", *args], cwd=str(REPO),
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"lccrun {' '.join(args)} hung\n{out[-6000:]}") from None
    assert proc.returncode == 0, f"lccrun exited {proc.returncode}\n{out[-8000:]}"
    return out


@pytest.mark.timeout(180)
def test_lccrun_compression_sets_the_distributed_optimizer_default():
    out = _lccrun(["-np", "2", "--compression", "fp16", sys.executable,
                   str(WORKERS / "check_default_compression.py")], timeout=150)
    assert out.count("OK 3 cases") == 2, out[-4000:]
