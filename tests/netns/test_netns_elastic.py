"""Elastic training across 2 simulated hosts (network namespaces, tests/netns/simhosts.py):
4 ranks, 2 per host; the test plays lccrun (it publishes the host list in the status
directory, and the worker's rank 0 publishes the next one mid-run). When host 1 leaves the
list, its 2 ranks leave the job at the next commit (no failure, no rollback) and the 2 on
host 0 go on; their weights must equal a NumPy replay (4 ranks up to the reported reset step,
then 2). Skips where namespaces are unavailable (not Linux, not root, no iproute2).

Growth across hosts: after host 1 left, a third host (not in the launch allocation) appears
in the list and, with ``LCC_ELASTIC_MAX_NP=4``, 2 new processes start there (``MPI_Comm_spawn``
with ``PMIX_ADD_HOST``: PRRTE starts a daemon on it through the namespace agent) and join; the
weights must equal a NumPy replay of 4, then 2, then 4 ranks. Host 1 itself coming back gets
no new ranks (Open MPI 5.0.11 cannot start processes there again once all the launch job's
processes there ended: they failed in ``MPI_Init``, docs/elastic.md): the job must say so and
finish on 2 ranks. With ``LCC_ELASTIC_MIN_NP=4`` the 2 survivors of host 1's departure wait
until the third host appears and grow back to 4 within the same reset.
"""
from __future__ import annotations

import contextlib
import os
import re
import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest

from lightcc.common.elastic import hosts
from tests.netns.simhosts import SimHosts, unavailable_reason
from tests.parallel.workers_elastic import lsq

WORKER = str(Path(__file__).resolve().parent.parent / "parallel" / "workers_elastic"
             / "hosts_numpy.py")

pytestmark = [pytest.mark.netns, pytest.mark.timeout(300)]


def _replay(change_step: int, before: int = 4, after: int = 2) -> np.ndarray:
    """hosts_numpy.py's descent: ``before`` ranks until ``change_step``, then ``after``."""
    return lsq.replay(24, lambda step: before if step < change_step else after)


@contextlib.contextmanager
def _simulated(n: int, tag: str):
    """``n`` simulated hosts and a status directory whose host list (version 1) is the first
    two with 2 slots each; skips where namespaces are unavailable."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"simulated hosts unavailable: {reason}")
    with SimHosts(n, None, tag=f"{tag}{os.getpid()}") as sim, \
            tempfile.TemporaryDirectory() as status:
        hosts.write(status, 1, [(sim.hosts[0], 2), (sim.hosts[1], 2)])
        yield sim, status


def test_a_host_that_leaves_the_list_takes_its_ranks_out_at_a_commit():
    with _simulated(2, "lcel") as (sim, status):
        h0, h1 = sim.hosts
        res = sim.run(2, [WORKER, f"{h0}:2", f"{h1}:2", "4", "-1"], timeout=240,
                      env={"LCC_RUNNER_STATUS_DIR": status},
                      extra=["--with-ft", "ulfm", "-x", "LCC_RUNNER_STATUS_DIR"])
    out = res.stdout
    assert res.returncode == 0, out[-6000:]
    assert f"this rank's host {h1} is no longer in the job's host list: it leaves" in out, out
    assert "elastic: removed (host left) launch rank(s) 2, 3; continuing with 2 ranks" in out
    step = int(re.search(r"RESET step (\d+) size 2", out).group(1))
    got = lsq.parse_weights(out, 2)
    assert got is not None, out
    np.testing.assert_allclose(got, _replay(step), rtol=1e-10)
    assert not np.allclose(got, _replay(24))           # the change of size matters


def _grow(sim, status, new_host: str, back: int = 10, min_np: int = 1):
    """hosts_numpy.py on 2 + 2 ranks: host 1 leaves at step 4, ``new_host`` is listed at
    step ``back`` (-1: never), ``LCC_ELASTIC_MAX_NP=4``, ``LCC_ELASTIC_MIN_NP=min_np``."""
    h0, h1 = sim.hosts[:2]
    # the agent maps addresses to namespaces; the host list names hosts by name, so
    # PRRTE asks the agent for a new host by its name too
    names = ",".join(f"{h}={h}" for h in sim.hosts)
    return sim.run(2, [WORKER, f"{h0}:2", f"{h1}:2", "4", str(back), f"{new_host}:2"],
                   timeout=240,
                   env={"LCC_RUNNER_STATUS_DIR": status, "LCC_ELASTIC_MAX_NP": "4",
                        "LCC_ELASTIC_MIN_NP": str(min_np), "LCC_ELASTIC_TIMEOUT": "120",
                        "LCC_NETNS_HOSTS": f"{sim.env()['LCC_NETNS_HOSTS']},{names}"},
                   extra=["--with-ft", "ulfm", "--prtemca", "state_base_recoverable", "1",
                          "-x", "LCC_RUNNER_STATUS_DIR", "-x", "LCC_ELASTIC_MAX_NP",
                          "-x", "LCC_ELASTIC_MIN_NP", "-x", "LCC_ELASTIC_TIMEOUT"],
                   slots=[2] * 2 + [0] * (sim.n - 2))


# Open MPI 5.0.11's prterun, after a spawn onto a host added with ``PMIX_ADD_HOST``, once
# aborted in its own teardown (glibc ``free(): invalid pointer``, after rank 0 had printed the
# final weights: 1 of ~60 runs, docs/elastic.md). That is prterun's exit status, not a rank's
# (a rank's crash reaches us as prterun's banner and a positive code), so only that exact
# ending is let through; the job's output is still checked in full below.
def _job_ended(res) -> bool:
    if res.returncode == 0:
        return True
    tail = res.stdout.rstrip().splitlines()[-1:] if res.stdout.strip() else []
    return res.returncode == -6 and tail == ["free(): invalid pointer"]


def test_a_host_that_appears_in_the_list_gets_new_ranks_that_join_at_a_commit():
    with _simulated(3, "lceg") as (sim, status):
        res = _grow(sim, status, sim.hosts[2])
    out = res.stdout
    assert _job_ended(res), out[-6000:]
    assert "elastic: removed (host left) launch rank(s) 2, 3; continuing with 2 ranks" in out
    assert "elastic: joined launch rank(s) 4, 5; continuing with 4 ranks" in out, out[-6000:]
    left = int(re.search(r"RESET step (\d+) size 2", out).group(1))
    grew = int(re.search(r"RESET step (\d+) size 4", out).group(1))
    assert left < grew, out
    got = lsq.parse_weights(out, 4)
    assert got is not None, out[-6000:]
    np.testing.assert_allclose(
        got, lsq.replay(24, lambda step: 4 if step < left or step >= grew else 2), rtol=1e-10)
    assert not np.allclose(got, _replay(left))          # the growth matters


def test_a_host_that_left_and_comes_back_gets_no_new_ranks():
    with _simulated(2, "lceb") as (sim, status):
        h1 = sim.hosts[1]
        res = _grow(sim, status, h1)
    out = res.stdout
    assert _job_ended(res), out[-6000:]
    assert "elastic: removed (host left) launch rank(s) 2, 3; continuing with 2 ranks" in out
    assert f"host {h1} had ranks of this job and has none left" in out, out[-6000:]
    assert "joined" not in out, out[-6000:]
    step = int(re.search(r"RESET step (\d+) size 2", out).group(1))
    got = lsq.parse_weights(out, 2)
    assert got is not None, out[-6000:]
    np.testing.assert_allclose(got, _replay(step), rtol=1e-10)


def test_below_min_np_the_survivors_wait_for_a_host_to_appear():
    """``LCC_ELASTIC_MIN_NP=4``: when host 1 leaves, the 2 survivors are below the minimum and
    wait (nobody trains); the test, playing lccrun, lists a third host 3 s after the change;
    2 processes start there within the same reset, so the job never trains on 2 ranks: its
    weights equal the uninterrupted 4-rank replay."""
    with _simulated(3, "lcew") as (sim, status):
        h0, h2 = sim.hosts[0], sim.hosts[2]
        stop = threading.Event()

        def appear() -> None:
            while hosts.published(status) < 2 and not stop.wait(0.2):
                pass
            if not stop.wait(3.0):
                hosts.write(status, 3, [(h0, 2), (h2, 2)])

        helper = threading.Thread(target=appear, daemon=True)
        helper.start()
        try:
            res = _grow(sim, status, h2, back=-1, min_np=4)
        finally:
            stop.set()
            helper.join()
    out = res.stdout
    assert _job_ended(res), out[-6000:]
    assert "fewer than the minimum of 4: waiting up to 120 s for hosts" in out, out[-6000:]
    assert "elastic: removed (host left) launch rank(s) 2, 3, joined launch rank(s) 4, 5; " \
        "continuing with 4 ranks" in out, out[-6000:]
    assert re.search(r"RESET step \d+ size 4", out) and not re.search(r"RESET step \d+ size 2",
                                                                      out), out[-6000:]
    got = lsq.parse_weights(out, 4)
    assert got is not None, out[-6000:]
    np.testing.assert_allclose(got, _replay(24), rtol=1e-10)
