"""Flight recorder (issue 26): real 3-rank jobs under lccrun where one rank raises or hangs
(SIGSTOP) before a collective the others wait in; lccrun's summary must name that rank and
that collective, and show where the waiting ranks' threads are (the worker's own function).

Checked to fail: with the engine's ``self.flight.record(...)`` line removed no rank has a
record of step5.grad and the "is behind" line is missing.
"""
from __future__ import annotations

import sys

import pytest

from tests.parallel.test_reliability import WORKERS, _finish, _lccrun, _lccrun_env, needs_lccrun


def _summary(err: str) -> str:
    """The last summary lccrun printed."""
    start = err.rfind("lccrun: flight recorder:")
    assert start >= 0, f"no flight recorder summary\n{err[-4000:]}"
    return err[start:]


@needs_lccrun
@pytest.mark.timeout(180)
def test_rank_that_raises_is_named_with_the_collective_it_never_reached():
    proc, _ = _lccrun(["-np", "3", sys.executable, str(WORKERS / "flight_worker.py"),
                       "raise", "1"], _lccrun_env())
    rc, _out, err = _finish(proc, 150)
    assert rc != 0
    summary = _summary(err)
    assert "records from 3 of 3 ranks" in summary, summary
    assert "rank 1 is behind: never reached allreduce 'step5.grad' (float32 8x4)" in summary, \
        summary
    assert "wait in" in summary and "0, 2" in summary.split("is behind")[1], summary
    # the waiting ranks' stacks end in the worker's waiting function
    assert summary.count("in wait_for_peers") >= 2, summary
    assert "exited on uncaught RuntimeError" in summary, summary


@needs_lccrun
@pytest.mark.timeout(240)
def test_rank_that_hangs_is_named_with_the_collective_it_never_reached():
    env = _lccrun_env({"LCC_STALL_CHECK_TIME": "1", "LCC_STALL_SHUTDOWN_TIME": "4"})
    proc, _ = _lccrun(["-np", "3", sys.executable, str(WORKERS / "flight_worker.py"),
                       "stop", "2"], env)
    rc, _out, err = _finish(proc, 200)
    assert rc != 0
    summary = _summary(err)
    # rank 2 answers SIGUSR1 only if Open MPI's teardown sends it SIGCONT first: either way
    # it must be the one named
    assert "rank 2 is behind: never reached allreduce 'step5.grad' (float32 8x4)" in summary, \
        summary
    assert summary.count("in wait_for_peers") >= 2, summary


@needs_lccrun
@pytest.mark.timeout(240)
def test_sigusr1_to_lccrun_prints_a_summary_while_the_job_runs(tmp_path):
    """No failure at all: rank 1 sleeps before step5.grad; SIGUSR1 to lccrun (repeated every
    3 s until the summary appears, a loaded machine may start the ranks slowly) must print
    the summary naming it, and the job keeps running until we interrupt it."""
    import signal
    import threading
    import time

    proc, _ = _lccrun(["-np", "3", sys.executable, str(WORKERS / "flight_worker.py"),
                       "sleep", "1"], _lccrun_env({"LCC_FLIGHT_DIR": str(tmp_path)}))
    chunks: list[str] = []
    reader = threading.Thread(target=lambda: chunks.extend(iter(proc.stderr.readline, "")),
                              daemon=True)
    reader.start()
    deadline = time.monotonic() + 150
    try:       # every rank registered: lccrun (which started them) handles SIGUSR1 by now
        while len(list(tmp_path.glob("rank*.pid"))) < 3 and proc.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.5)
        # a summary taken while rank 1 is still starting (importing) names an earlier
        # collective, correctly: ask again until rank 1 sleeps at its place
        while time.monotonic() < deadline and "never reached allreduce 'step5.grad'" \
                not in "".join(chunks) and proc.poll() is None:
            proc.send_signal(signal.SIGUSR1)
            time.sleep(3)
        assert proc.poll() is None, "".join(chunks)[-3000:]
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        finally:
            if proc.poll() is None:
                proc.kill()
    reader.join(10)
    err = "".join(chunks)
    summary = _summary(err)
    assert "rank 1 is behind: never reached allreduce 'step5.grad' (float32 8x4)" in summary, \
        summary
