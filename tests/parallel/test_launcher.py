"""Real runs of ``lccrun`` (``python -m lightcc.runner``): flags reach the ranks, a failing or
killed rank ends the job quickly with a message naming it, Ctrl-C leaves no process behind.

These tests start the launcher itself (not :func:`tests.mpi_harness.run_mpi`, which would
bypass it), each under a timeout that kills the whole process tree and fails with its output.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.mpi_harness import REPO, mpirun_path

WORKERS = Path(__file__).resolve().parent / "workers_launcher"
TIMEOUT_S = 60.0

psutil = pytest.importorskip("psutil")

try:
    mpirun_path()
except RuntimeError:  # pragma: no cover - no Open MPI: nothing to launch
    pytest.skip("mpirun not available", allow_module_level=True)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    env.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
    for name in [n for n in env if n.startswith("LCC_")]:
        del env[name]  # the test decides every LCC_* value
    return env


def _kill_everything(proc: subprocess.Popen) -> None:
    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    for p in [*family]:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.kill()


def start_lccrun(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "lightcc.runner", *args], cwd=str(REPO),
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float = TIMEOUT_S) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_everything(proc)
        out, err = proc.communicate()
        raise AssertionError(f"lccrun hung (> {timeout:.0f} s)\n--- stdout ---\n{out[-4000:]}"
                             f"\n--- stderr ---\n{err[-4000:]}") from None
    return proc.returncode, out, err


def run_lccrun(args: list[str], timeout: float = TIMEOUT_S) -> tuple[int, str, str, float]:
    t0 = time.monotonic()
    rc, out, err = finish(start_lccrun(args), timeout)
    return rc, out, err, time.monotonic() - t0


def last_lines(text: str, n: int = 2) -> str:
    return "\n".join(text.strip().splitlines()[-n:])


def test_flags_reach_every_rank():
    rc, out, err, _ = run_lccrun([
        "-np", "2", "--fusion-threshold-mb", "32", "--cycle-time-ms", "2.5",
        "--cache-capacity", "7", "--log-level", "debug", "--num-links", "3",
        "--local-size", "1", "--stall-check-time-seconds", "5", "-x", "LCC_TEST_EXTRA=hello",
        sys.executable, str(WORKERS / "env_check.py"),
        "LCC_FUSION_THRESHOLD=33554432", "LCC_CYCLE_TIME=2.5", "LCC_CACHE_CAPACITY=7",
        "LCC_LOG_LEVEL=debug", "LCC_NUM_LINKS=3", "LCC_LOCAL_SIZE=1",
        "LCC_STALL_CHECK_TIME=5", "LCC_TEST_EXTRA=hello", "PYTHONUNBUFFERED=1"])
    assert rc == 0, f"rc={rc}\n{out}\n{err}"
    assert "ENV-OK rank 0 of 2" in out and "ENV-OK rank 1 of 2" in out, out + err


@pytest.mark.parametrize("mode,victim,expect", [
    ("exit", 1, "lccrun: rank 1 exited with code 3"),
    ("kill", 0, "lccrun: rank 0 killed by signal 9 (SIGKILL)"),
    ("raise", 1, "lccrun: rank 1 exited with code 1 (uncaught RuntimeError: planned failure"),
])
def test_failed_rank_ends_job_and_is_named(mode, victim, expect, tmp_path):
    # The survivors block in a barrier the victim never reaches: only a teardown ends the job
    # (run_lccrun's timeout turns a job left hanging into a failure; no elapsed-time bound).
    stamp = tmp_path / "failed_at"
    rc, out, err, _ = run_lccrun(
        ["-np", "2", sys.executable, str(WORKERS / "fail.py"), mode, str(victim), str(stamp)],
        timeout=40)
    assert rc != 0, f"lccrun exited 0 although rank {victim} failed\n{err}"
    assert stamp.exists(), f"rank {victim} never reached its failure point\n{err}"
    assert "survivor finished" not in out, f"a survivor ran to its end: no teardown\n{out}"
    assert expect in last_lines(err), f"last lines do not name the rank:\n{err[-3000:]}"
    if mode == "exit":
        assert rc == 3
    if mode == "kill":
        assert rc == 128 + 9


def test_failing_non_python_rank_is_named():
    # rank 0 would sleep far past run_lccrun's timeout: only a teardown ends the job in time
    rc, out, err, _ = run_lccrun(
        ["-np", "2", "sh", "-c",
         'if [ "$OMPI_COMM_WORLD_RANK" = 1 ]; then exit 4; fi; sleep 600; echo survivor finished'])
    assert rc == 4, err
    assert "survivor finished" not in out, out
    assert "lccrun: rank 1 exited with code 4" in last_lines(err), err[-3000:]


def _marked(marker: str) -> list:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if marker in " ".join(p.info["cmdline"] or []):
                found.append(p)
        except psutil.NoSuchProcess:
            pass
    return found


def test_sigint_stops_every_rank_and_their_children(tmp_path):
    marker = f"lccrun-test-marker-{uuid.uuid4().hex}"
    proc = start_lccrun(["-np", "2", sys.executable, str(WORKERS / "sigint.py"),
                         str(tmp_path), marker])
    try:
        deadline = time.monotonic() + 30
        while len(list(tmp_path.glob("ready-*"))) < 2:
            if proc.poll() is not None or time.monotonic() > deadline:
                _kill_everything(proc)
                out, err = proc.communicate()
                raise AssertionError(f"ranks never became ready (rc={proc.returncode})\n{err}")
            time.sleep(0.05)
        # lccrun, prterun, two ranks and one escaped child per rank carry the marker
        assert len(_marked(marker)) >= 4
        # the ranks ignore SIGINT and sleep 120 s: finishing within finish()'s timeout means
        # lccrun stopped them (no elapsed-time bound beyond that hang guard)
        os.kill(proc.pid, signal.SIGINT)
        rc, out, err = finish(proc, timeout=60)
    finally:
        if proc.poll() is None:
            _kill_everything(proc)
    assert rc == 130, f"rc={rc}\n{err}"
    assert "interrupted by SIGINT" in last_lines(err)
    left = _marked(marker)
    deadline = time.monotonic() + 30.0   # a hang guard: the kernel finishes the kills
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [p for p in _marked(marker) if p.status() != psutil.STATUS_ZOMBIE]
    assert not left, f"processes left behind: {[(p.pid, p.cmdline()) for p in left]}"


def test_bad_script_is_refused_before_launch():
    rc, out, err, _ = run_lccrun(["-np", "2", sys.executable, "no_such_script_xyz.py"])
    assert rc == 2
    # one line from lccrun and nothing from mpirun or a rank: nothing was launched
    assert err.strip().count("\n") == 0 and "no_such_script_xyz.py" in err, err
    assert not out.strip(), out


@pytest.mark.parametrize("backend", ["gloo", "lightcc"])
def test_torchrun_style_script_runs_unchanged(backend):
    pytest.importorskip("torch")
    rc, out, err, _ = run_lccrun(["-np", "2", sys.executable, str(WORKERS / "torchrun_style.py"),
                                  backend], timeout=120)
    assert rc == 0, err[-3000:]
    for rank in (0, 1):
        assert f"rank {rank}/2 local {rank}/2 sum 3 backend {backend}" in out, out + err[-2000:]


@pytest.mark.parametrize("hook,least", [("none", 50.0), ("topk", 30.0)])
def test_ddp_mnist_example_on_digits(hook, least):
    """The example under lccrun, one epoch: measured 57.50 % without a hook, 40.83 % with
    TopK (seed 42). Issue 15's done-when (8 epochs: >= 96 % uncompressed, TopK within its
    1.5-point bar of that) is ``python benchmarks/convergence/run.py examples``; the hooks'
    accuracy bars are checked in CI by test_c10d.py (2 seeds a hook)."""
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    rc, out, err, _ = run_lccrun(["-np", "2", sys.executable, "examples/ddp_mnist.py",
                                  "--data-dir", "/nonexistent", "--comm-hook", hook,
                                  "--epochs", "1"], timeout=240)
    assert rc == 0, err[-3000:]
    assert f"backend lightcc, comm hook {hook}" in out, out
    accuracy = [float(line.split("test accuracy ")[1].split("%")[0])
                for line in out.splitlines() if line.startswith("epoch ")]
    assert len(accuracy) == 1 and accuracy[-1] >= least, out
