"""Elastic training (issue 26), real 3-rank jobs under lccrun with fault tolerance: one rank
kills itself with SIGKILL in the middle of epoch 0; the survivors roll back to the last
commit, re-form the group (shrink in place) and finish. Their final parameters must equal a
single-process torch replay of Horovod's documented semantics (``_reference``): the steps up
to the last commit on 3 ranks, then the rest of the epoch's unprocessed samples split
between 2 ranks by ``ElasticSampler``'s rule, then the next epoch on 2 ranks. Below
``--min-np`` the job must end with a clear message, not hang.

Checked to fail: with ``state.restore()`` removed from ``run``'s retry loop the parameters
differ from the reference (the failed step's partial work stays); with the sampler's
re-partition disabled (``num_replicas`` kept at 3) the survivors skip samples and the
parameters differ.
"""
from __future__ import annotations

import random
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.parallel.test_reliability import _finish, _lccrun, _lccrun_env, needs_lccrun

torch = pytest.importorskip("torch")

WORKER = Path(__file__).resolve().parent / "workers_elastic" / "train_torch.py"
# the worker's problem (constants and data), shared with it
from tests.parallel.workers_elastic import lsq
from tests.parallel.workers_elastic.problem import BATCH, COMMIT, DIM, EPOCHS, LR, MOMENTUM, SEED, N
from tests.parallel.workers_elastic.problem import data as _data


def _partition(epoch: int, processed: int, ranks: int) -> list[list[int]]:
    """Horovod's ElasticSampler: the epoch's permutation, its processed prefix dropped, padded
    with its own start to a multiple of ``ranks``, then every ``ranks``-th index per rank."""
    order = list(range(N))
    random.Random(SEED + epoch).shuffle(order)
    rest = order[processed:]
    per = -(-len(rest) // ranks)
    rest += rest[:per * ranks - len(rest)]
    return [rest[r::ranks] for r in range(ranks)]


def _steps(model, opt, x, y, parts: list[list[int]], count: int | None) -> int:
    """Run ``count`` (None: all) synchronous steps over ``parts`` (one index list per rank):
    the gradient is the mean over ranks of each rank's mean-loss gradient (Average)."""
    n = len(parts[0])
    done = 0
    for i in range(0, n, BATCH):
        if count is not None and done == count:
            break
        opt.zero_grad()
        losses = [torch.nn.functional.mse_loss(model(x[p[i:i + BATCH]]), y[p[i:i + BATCH]])
                  for p in parts]
        (sum(losses) / len(parts)).backward()
        opt.step()
        done += 1
    return done


def _reference(kill_at: int | None, ranks: int = 3, after: int | None = None) -> dict:
    """Uninterrupted on ``ranks``, or: killed at step ``kill_at`` of epoch 0, so resumed from
    its last commit on ``after`` ranks (default ``ranks - 1``)."""
    if kill_at is None:
        return _replay(ranks, 0, None, ranks)
    return _replay(ranks, 0, (kill_at // COMMIT) * COMMIT, ranks - 1 if after is None else after)


def _replay(ranks: int, epoch: int, batch: int | None, new_ranks: int) -> dict:
    """SGD on ``ranks`` until the commit at (``epoch``, ``batch`` steps), then on
    ``new_ranks``: the rest of that epoch's unprocessed samples re-partitioned, then the
    following epochs (batch None: no change)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(DIM, 1)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    x, y = _data()
    for e in range(EPOCHS):
        if batch is None or e < epoch:
            _steps(model, opt, x, y, _partition(e, 0, ranks), None)
        elif e == epoch:
            _steps(model, opt, x, y, _partition(e, 0, ranks), batch)
            _steps(model, opt, x, y, _partition(e, batch * BATCH * ranks, new_ranks), None)
        else:
            _steps(model, opt, x, y, _partition(e, 0, new_ranks), None)
    return model.state_dict()


def test_reference_depends_on_the_failure():
    """The replay is not trivially the same whatever happens (else the test could not fail)."""
    a, b = _reference(None), _reference(5)
    assert not torch.allclose(a["weight"], b["weight"], atol=1e-4)
    c = _reference(4)     # the same last commit (step 3) as a kill at step 5
    assert torch.allclose(b["weight"], c["weight"]) and not torch.allclose(
        _reference(7)["weight"], b["weight"], atol=1e-4)


def _run(tmp_path, victim: int, kill_at: int, min_np: int, flags=(), extra=(), env=None):
    out = tmp_path / "params.pt"
    proc, _ = _lccrun(["-np", "3", "--min-np", str(min_np), "--elastic-timeout", "120",
                       *flags, sys.executable, str(WORKER), str(out), str(victim),
                       str(kill_at), *extra], {**_lccrun_env(), **(env or {})})
    rc, stdout, stderr = _finish(proc, 400)
    return rc, stdout, stderr, out


@needs_lccrun
@pytest.mark.timeout(480)
@pytest.mark.parametrize("victim,kill_at", [(2, 5), (0, 4)])
def test_survivors_of_kill_9_resume_from_the_last_commit(tmp_path, victim, kill_at):
    """Rank 2 (a leaf of the control tree), or rank 0 (its root and the coordinator)."""
    rc, out, err, params = _run(tmp_path, victim, kill_at, 2)
    assert rc == 0, f"{out[-3000:]}\n{err[-5000:]}"
    assert f"lccrun: elastic: lost rank {victim} (launch numbering); 2 ranks continue" in err, err
    assert "DONE size 2 resets 1" in out, out
    kill = float(re.search(r"KILL (\d+\.\d+)", out).group(1))
    first = float(re.search(r"FIRST_STEP (\d+\.\d+) size 2", out).group(1))
    print(f"\nrecovery (kill -> first step on the new group): {first - kill:.3f} s; "
          f"{re.search(r're-formed in [0-9.]+ s', err).group(0)}")
    got = torch.load(params)
    want = _reference(kill_at)
    for name in ("weight", "bias"):
        assert torch.allclose(got[name], want[name], rtol=1e-5, atol=1e-6), \
            (name, got[name], want[name])


def _check_params(params, want) -> None:
    got = torch.load(params)
    for name in ("weight", "bias"):
        assert torch.allclose(got[name], want[name], rtol=1e-5, atol=1e-6), \
            (name, got[name], want[name])


@needs_lccrun
@pytest.mark.timeout(480)
def test_a_replacement_joins_after_a_kill_up_to_max_np(tmp_path):
    """``--max-np 3``: after rank 2 dies the survivors start a new process on the free slot
    of this machine (MPI_Comm_spawn); it joins with launch number 3 and the state of the last
    commit, and the job finishes on 3 ranks: the reference is 3 ranks throughout, with the
    epoch's unprocessed samples re-partitioned at the commit the job rolled back to."""
    rc, out, err, params = _run(tmp_path, 2, 5, 2, flags=["--max-np", "3"])
    assert rc == 0, f"{out[-3000:]}\n{err[-5000:]}"
    assert "lccrun: elastic: lost rank 2, joined rank 3 (launch numbering); 3 ranks continue" \
        in err, err
    assert "DONE size 3 resets 1" in out, out
    kill = float(re.search(r"KILL (\d+\.\d+)", out).group(1))
    first = float(re.search(r"FIRST_STEP (\d+\.\d+) size 3", out).group(1))
    print(f"\nrecovery with a replacement (kill -> first step on 3 ranks): {first - kill:.3f} s;"
          f" {re.search(r're-formed in [0-9.]+ s', err).group(0)}")
    want = _reference(5, 3, after=3)
    assert not torch.allclose(want["weight"], _reference(5)["weight"], atol=1e-4)
    _check_params(params, want)


@needs_lccrun
@pytest.mark.timeout(480)
def test_a_replacement_that_dies_is_replaced_and_the_job_ends_cleanly(tmp_path):
    """As above, then the replacement (launch number 3) kills itself at epoch 1, step 4: the
    survivors roll back to that epoch's commit at step 3 and a second replacement (launch
    number 4) joins; the job must end with the training's exit code (0), not as a failed
    job. Re-partitioning the epoch's rest on the same 3 ranks at a commit changes nothing,
    so the reference is the single replacement's."""
    rc, out, err, params = _run(tmp_path, 2, 5, 2, flags=["--max-np", "3"],
                                env={"LCC_TEST_SECOND_KILL": "3:1:4"})
    assert rc == 0, f"{out[-3000:]}\n{err[-5000:]}"
    assert "lccrun: elastic: lost rank 2, joined rank 3 (launch numbering); 3 ranks continue" \
        in err, err
    assert "lccrun: elastic: lost rank 3, joined rank 4 (launch numbering); 3 ranks continue" \
        in err, err
    assert "DONE size 3 resets 2" in out, out
    assert "killed by signal" not in err, err
    _check_params(params, _reference(5, 3, after=3))


@needs_lccrun
@pytest.mark.timeout(480)
def test_a_replacement_that_raises_is_named_by_its_launch_number(tmp_path):
    """The replacement (launch number 3; rank 0 of its own spawned job) raises at epoch 1:
    an error of the program, not a lost rank, so the job ends, and lccrun's last line names
    launch rank 3, not rank 0."""
    rc, out, err, _ = _run(tmp_path, 2, 5, 2, flags=["--max-np", "3"],
                           env={"LCC_TEST_SECOND_KILL": "3:1:4:raise"})
    assert rc == 1, f"{out[-3000:]}\n{err[-5000:]}"
    assert "joined rank 3 (launch numbering)" in err, err
    last = err.strip().splitlines()[-1]
    assert last == "lccrun: rank 3 exited with code 1 (uncaught RuntimeError: launch number 3 " \
        "fails)", err[-3000:]


@needs_lccrun
@pytest.mark.timeout(480)
def test_a_blacklisted_host_gets_no_replacement(tmp_path):
    """The same kill with ``--blacklist-after 1``: this machine (``localhost`` in the host
    list) is blacklisted by the failure, no process is started, and the job finishes on the
    2 survivors (the reference of the plain shrink)."""
    rc, out, err, params = _run(tmp_path, 2, 5, 2, flags=["--max-np", "3",
                                                          "--blacklist-after", "1"])
    assert rc == 0, f"{out[-3000:]}\n{err[-5000:]}"
    assert ("lccrun: elastic: lost rank 2 (launch numbering); 2 ranks continue, group "
            "re-formed in") in err and "; host localhost blacklisted after 1 failed rank(s)" \
        in err, err
    assert "DONE size 2 resets 1" in out, out
    _check_params(params, _reference(5))


def run_discovery_job(tmp_path: Path, first: str, then: str, out_pt: Path,
                      np_args: list[str]) -> tuple[int, str, str]:
    """lccrun with a discovery script printing ``first``; at step 4 rank 0 makes it print
    ``then``. Returns (exit code, stdout, stderr) of the job."""
    hosts_file = tmp_path / "hosts.txt"
    hosts_file.write_text(f"{first}\n")
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {hosts_file}\n")
    script.chmod(0o755)
    proc, _ = _lccrun([*np_args, "--elastic-timeout", "120",
                       "--host-discovery-script", str(script), "--host-discovery-period",
                       "0.3", sys.executable, str(WORKER), str(out_pt), "-1", "0", "4", then],
                      {**_lccrun_env(), "LCC_TEST_HOSTS_FILE": str(hosts_file)})
    return _finish(proc, 400)


@needs_lccrun
@pytest.mark.timeout(480)
def test_a_host_added_by_the_discovery_script_grows_the_job(tmp_path):
    """-np 2 --max-np 3 with a discovery script printing ``localhost:2``; at step 4 rank 0
    makes it print ``localhost:3``: lccrun publishes the new list, every rank raises
    HostsUpdatedInterrupt at the same commit, one process is started and joins, and training
    goes on on 3 ranks from that commit (no rollback). The reference replays 2 ranks up to
    the commit the job reported, then 3."""
    out_pt = tmp_path / "params.pt"
    rc, out, err = run_discovery_job(tmp_path, "localhost:2", "localhost:3", out_pt,
                                     ["--min-np", "2", "--max-np", "3"])
    assert rc == 0, f"{out[-3000:]}\n{err[-5000:]}"
    assert "lccrun: elastic: hosts changed (localhost 2->3 slots)" in err, err
    assert "lccrun: elastic: joined rank 2 (launch numbering); 3 ranks continue" in err, err
    assert "DONE size 3 resets 1" in out, out
    epoch, batch, size = map(int, re.search(r"RESET (\d+) (\d+) (\d+)", out).groups())
    assert size == 3 and batch % COMMIT == 0 and (epoch, batch) >= (0, 4), out
    want = _replay(2, epoch, batch, 3)
    assert not torch.allclose(want["weight"], _replay(2, 0, None, 2)["weight"], atol=1e-4)
    _check_params(out_pt, want)


@needs_lccrun
@pytest.mark.timeout(480)
@pytest.mark.parametrize("comes_back", [True, False])
def test_below_min_np_the_survivors_wait_for_hosts(tmp_path, comes_back):
    """-np 3 --min-np 3 --max-np 3; at step 1 the discovery script's list drops to
    ``localhost:2``: at the next commit the rank beyond the 2 slots leaves (issue 38: it used
    to stay, 3 ranks on 2 slots), leaving 2 ranks and no free slot, so the survivors wait.
    When the list offers a third slot again (6 s after it dropped) a new process joins and
    the job finishes on 3 ranks; when it never does, the job ends after --elastic-timeout
    with a message naming the counts - on every survivor, no hang (horovod#3494)."""
    import threading
    import time

    hosts_file = tmp_path / "hosts.txt"
    hosts_file.write_text("localhost:3\n")
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {hosts_file}\n")
    script.chmod(0o755)

    def bring_back() -> None:
        while hosts_file.read_text().strip() != "localhost:2":
            time.sleep(0.1)
        time.sleep(6.0)
        hosts_file.write_text("localhost:3\n")

    if comes_back:
        threading.Thread(target=bring_back, daemon=True).start()
    wait_s = 30 if comes_back else 10
    out_pt = tmp_path / "params.pt"
    proc, _ = _lccrun(["--min-np", "3", "--max-np", "3", "--elastic-timeout", str(wait_s),
                       "--host-discovery-script", str(script), "--host-discovery-period",
                       "0.3", sys.executable, str(WORKER), str(out_pt), "-1", "0", "1",
                       "localhost:2"], {**_lccrun_env(), "LCC_TEST_HOSTS_FILE": str(hosts_file)})
    rc, out, err = _finish(proc, 400)
    assert f"fewer than the minimum of 3: waiting up to {wait_s} s for hosts" in err + out, err
    if comes_back:
        assert rc == 0, f"{out[-3000:]}\n{err[-5000:]}"
        assert "lccrun: elastic: removed (host left) rank 2, joined rank 3 (launch " \
            "numbering); 3 ranks continue" in err, err
        assert "DONE size 3 resets 1" in out, out
    else:
        assert rc != 0 and "DONE" not in out
        last = err.strip().splitlines()[-1]
        assert ("2 rank(s) left, fewer than the minimum of 3 (--min-np / LCC_ELASTIC_MIN_NP); "
                "waited") in last and "more slot(s), it offers 0: ending the job" in last, \
            err[-4000:]


@needs_lccrun
@pytest.mark.timeout(480)
def test_below_min_np_the_job_ends_with_a_clear_message(tmp_path):
    rc, out, err, _ = _run(tmp_path, 1, 4, 3)
    assert rc != 0
    last = err.strip().splitlines()[-1]
    assert "2 rank(s) left after launch rank(s) 1 failed, fewer than the minimum of 3" in last, \
        err[-4000:]
    assert "DONE" not in out


def _numpy_reference(kill_at: int | None) -> np.ndarray:
    """train_numpy.py replayed: steps up to the last commit on 3 ranks, the rest on 2."""
    steps, commit = 12, 4
    return lsq.replay(steps, lambda step: 3 if kill_at is None or
                      step < (kill_at // commit) * commit else 2)


def test_numpy_state_under_plain_mpirun_with_ft():
    """The core's ObjectState and run, launched by plain ``mpirun --with-ft ulfm``."""
    from tests.mpi_harness import run_mpi

    worker = str(WORKER.parent / "train_numpy.py")
    out = run_mpi(3, ["--with-ft", "ulfm", sys.executable, worker, "2", "6"],
                  timeout=240).stdout
    assert "elastic: lost launch rank(s) 2; continuing with 2 ranks" in out, out
    got = lsq.parse_weights(out, 2)
    assert got is not None, out
    np.testing.assert_allclose(got, _numpy_reference(6), rtol=1e-10)
    assert not np.allclose(got, _numpy_reference(9))     # a different last commit differs


def test_a_host_notice_on_one_rank_resets_every_rank_at_the_next_commit():
    """``on_hosts_updated`` on launch rank 1 alone at step 5: all ranks raise
    HostsUpdatedInterrupt at the commit of step 8, the group is re-formed with the same 3
    ranks, and training goes on from that commit (the result equals an uninterrupted run)."""
    from tests.mpi_harness import run_mpi

    worker = str(WORKER.parent / "train_numpy.py")
    out = run_mpi(3, ["--with-ft", "ulfm", sys.executable, worker, "-1", "0", "5"],
                  timeout=240).stdout
    assert "elastic: group re-formed with the same 3 ranks (hosts updated)" in out, out
    got = lsq.parse_weights(out, 3)
    assert got is not None, out
    np.testing.assert_allclose(got, _numpy_reference(None), rtol=1e-10)


@pytest.mark.parametrize("overlap,delay", [("0", "0.3"), ("1", "0.3"), ("0", "direct")])
def test_rank_killed_inside_a_large_allreduce(overlap, delay):
    """The victim dies at a random point of 8 MB allreduces (a timer, not a step boundary), on
    the waiting thread (lazy) or the background thread (overlap), or before a small unnamed
    allreduce on the direct path: the survivors recover."""
    from tests.mpi_harness import run_mpi

    worker = str(WORKER.parent / "midkill_numpy.py")
    out = run_mpi(3, ["--with-ft", "ulfm", "-x", "LCC_OVERLAP", sys.executable, worker, "1",
                      delay], env={"LCC_OVERLAP": overlap}, timeout=240).stdout
    assert "elastic: lost launch rank(s) 1; continuing with 2 ranks" in out, out
    for rank in (0, 2):
        assert f"launch {rank}: done size 2 step 60" in out, out


GAPS = str(WORKER.parent / "gaps_numpy.py")


@pytest.mark.parametrize("victim,kept,renumbered,gone", [(2, "a", [0, 1], "b"),
                                                         (0, "b", [0, 1], "a")])
def test_process_sets_and_exit_code_after_a_shrink(victim, kept, renumbered, gone):
    """Process sets [0, 1] and [1, 2]: the one whose members survived works on the new
    group, renumbered; the other says which launch rank it lost. ``sys.exit(3)`` after the
    shrink is the job's exit code under plain mpirun (it was 0: the process ends without
    MPI_Finalize)."""
    from tests.mpi_harness import run_mpi

    out = run_mpi(3, ["--with-ft", "ulfm", sys.executable, GAPS, f"{victim}@4", "3"],
                  timeout=240, expect_rc=3).stdout
    survivors = [r for r in range(3) if r != victim]
    for r in survivors:
        assert f"launch {r}: set {kept} ranks {renumbered} size 2" in out, out
        assert (f"launch {r}: set {gone} error: process set {[0, 1] if gone == 'a' else [1, 2]}"
                f" was removed when the elastic group was re-formed: it lost launch rank(s) "
                f"{victim}") in out, out
        assert f"launch {r}: done size 2 step 12" in out, out


@pytest.mark.parametrize("limit", ["1", "0"])
def test_reset_limit_ends_the_job_at_the_reset_past_it(limit):
    """Two failures (launch rank 2 at step 4, rank 1 at step 8): with LCC_ELASTIC_RESET_LIMIT=1
    the second one ends the job with the message (exit status 1 from the last process left);
    with 0 (no limit) rank 0 finishes alone."""
    from tests.mpi_harness import run_mpi

    out = run_mpi(3, ["--with-ft", "ulfm", "-x", "LCC_ELASTIC_RESET_LIMIT", sys.executable,
                      GAPS, "2@4,1@8", "0"], env={"LCC_ELASTIC_RESET_LIMIT": limit},
                  timeout=240, expect_rc=None)
    if limit == "1":
        assert out.returncode == 1, out.stdout
        assert ("ElasticError: elastic: the group was already re-formed 1 time(s), the limit "
                "(--reset-limit / LCC_ELASTIC_RESET_LIMIT 1): ending the job") in out.stdout
        assert "done" not in out.stdout
    else:
        assert out.returncode == 0, out.stdout
        assert "launch 0: done size 1 step 12" in out.stdout, out.stdout
