"""Elastic training without launching (issue 26): ElasticSampler's partition against Horovod's
documented rule computed by hand, ObjectState's commit/restore, which errors ``run`` recovers
from, its retry loop with a fake reset, and lccrun's elastic flags and membership lines."""
from __future__ import annotations

import json

import numpy as np
import pytest

from lightcc.common import elastic
from lightcc.common.exceptions import (CollectiveError, InvalidArgumentError, MismatchError,
                                       ShutdownError, StallError)
from lightcc.runner import supervise
from lightcc.runner.args import UsageError, parse_args, to_spec
from lightcc.runner.command import Machine, build_command

torch = pytest.importorskip("torch")
from lightcc.torch.elastic import sampler as sampler_mod  # noqa: E402


class _Group:
    def __init__(self, size, rank):
        self.n, self.r = size, rank

    def is_initialized(self):
        return True

    def size(self):
        return self.n

    def rank(self):
        return self.r


def _sampler(monkeypatch, size, rank, n=10, shuffle=False, seed=0):
    monkeypatch.setattr(sampler_mod, "_api", _Group(size, rank))
    return sampler_mod.ElasticSampler(range(n), shuffle=shuffle, seed=seed)


def test_sampler_splits_by_stride_and_pads_with_the_start(monkeypatch):
    # 10 indices on 3 ranks: 4 each, padded with 0 and 1
    assert [list(_sampler(monkeypatch, 3, r)) for r in range(3)] == \
        [[0, 3, 6, 9], [1, 4, 7, 0], [2, 5, 8, 1]]


def test_sampler_repartitions_what_is_left_after_a_reset(monkeypatch):
    s = _sampler(monkeypatch, 2, 1)
    s.record_batch(0, 2)               # 2 samples on each of 2 ranks: 0..3 processed
    assert s.state_dict() == {"epoch": 0, "processed_num": 4}
    monkeypatch.setattr(sampler_mod, "_api", _Group(3, 2))
    s.reset()                          # the group shrank/grew: 4..9 over 3 ranks
    assert list(s) == [6, 9] and len(s) == 2
    s.set_epoch(1)                     # a new epoch: nothing processed
    assert s.processed_num == 0 and list(s) == [2, 5, 8, 1]


def test_sampler_shuffle_is_the_seeded_permutation_of_the_epoch(monkeypatch):
    import random

    order = list(range(10))
    random.Random(3 + 2).shuffle(order)
    s = _sampler(monkeypatch, 2, 0, shuffle=True, seed=3)
    s.set_epoch(2)
    assert list(s) == order[0::2]
    s.load_state_dict({"epoch": 2, "processed_num": 6})
    assert list(s) == order[6::2]


def test_object_state_commit_restore_are_copies():
    st = elastic.ObjectState(w=np.zeros(3), step=0)
    st.w += 1.0                        # in place, before any commit
    st.step = 5
    st.restore()
    assert st.step == 0 and not st.w.any()
    st.w += 2.0
    st.step = 7
    st.commit()                        # not initialized: no host-check collective
    st.w += 1.0
    st.restore()
    assert st.step == 7 and np.array_equal(st.w, [2.0, 2.0, 2.0])


@pytest.mark.parametrize("exc,recover", [
    (ShutdownError("allreduce 'x': rank 2 exited or lost its connection"), True),
    (CollectiveError("allreduce 'x' failed on rank 1: rank 2 exited or lost its connection"), True),
    (MismatchError("allreduce 'x': shapes differ"), False),
    (StallError("rank 2 did not submit allreduce 'x'"), False),
    (InvalidArgumentError("bad op"), False),
    (ValueError("user bug"), False),
])
def test_only_lost_rank_errors_are_recovered(exc, recover):
    assert elastic.is_peer_failure(exc) is recover


def test_run_restores_resets_syncs_and_calls_again(monkeypatch):
    calls = []

    class S(elastic.ObjectState):
        def sync(self):
            calls.append("sync")

    st = S(step=0)
    st.register_reset_callbacks([lambda: calls.append("callback")])
    monkeypatch.setattr(elastic.recovery, "check_ready", lambda: None)

    def train(state):
        calls.append(f"train {state.step}")
        if len(calls) < 4:
            state.step = 3              # uncommitted
            raise ShutdownError("rank 1 exited or lost its connection")
        return "done"

    out = elastic.run_fn(train, lambda: calls.append("reset"))(st)
    assert out == "done"
    assert calls == ["sync", "train 0", "reset", "callback", "sync", "train 0"]


def test_run_reraises_what_is_not_a_lost_rank(monkeypatch):
    monkeypatch.setattr(elastic.recovery, "check_ready", lambda: None)

    def train(state):
        raise MismatchError("shapes differ")

    class S(elastic.ObjectState):
        def sync(self):
            pass

    with pytest.raises(MismatchError):
        elastic.run_fn(train, lambda: pytest.fail("no reset"))(S(a=1))


def test_elastic_timeout_watchdog_ends_the_job(monkeypatch):
    import threading

    codes = []
    monkeypatch.setattr(elastic.recovery.ulfm, "abort", codes.append)
    elastic.recovery._watch(threading.Event(), 0.05)      # never set: times out
    assert codes == [75]
    done = threading.Event()
    done.set()
    elastic.recovery._watch(done, 5.0)                    # re-formed in time: nothing
    assert codes == [75]


# ---------------------------------------------------------------- lccrun
def _build(argv):
    spec = to_spec(parse_args(argv))
    return spec, build_command(spec, Machine(mpirun="/x/mpirun", euid=1000, cores=64),
                               {"PATH": "/usr/bin"})


def test_elastic_flags_launch_with_fault_tolerance():
    spec, launch = _build(["-np", "3", "--min-np", "2", "--elastic-timeout", "30",
                           "--max-np", "4", "python", "t.py"])
    assert spec.elastic
    i = launch.argv.index("--with-ft")
    assert launch.argv[i + 1] == "ulfm"
    assert launch.env["LCC_ELASTIC_MIN_NP"] == "2" and launch.env["LCC_ELASTIC_TIMEOUT"] == "30"
    assert "LCC_ELASTIC_RESET_LIMIT" not in launch.env
    _, launch = _build(["-np", "3", "--reset-limit", "2", "python", "t.py"])
    assert launch.env["LCC_ELASTIC_RESET_LIMIT"] == "2" and "--with-ft" in launch.argv


def _prtemca(argv: list[str]) -> list[str]:
    return [argv[i + 1] + "=" + argv[i + 2] for i, a in enumerate(argv) if a == "--prtemca"]


def test_elastic_jobs_are_recoverable_for_prrte_unless_told_otherwise():
    """Spawned jobs (replacements) must not take the job down when they die."""
    _, launch = _build(["-np", "3", "--max-np", "3", "python", "t.py"])
    assert _prtemca(launch.argv) == ["state_base_recoverable=1"]
    _, launch = _build(["-np", "3", "--max-np", "3", "--mpi-args",
                        "--prtemca state_base_recoverable 0", "python", "t.py"])
    assert _prtemca(launch.argv) == ["state_base_recoverable=0"]


def test_without_elastic_flags_nothing_changes():
    spec, launch = _build(["-np", "3", "python", "t.py"])
    assert not spec.elastic and "--with-ft" not in launch.argv
    assert "state_base_recoverable" not in launch.argv
    assert "LCC_ELASTIC_MIN_NP" not in launch.env


@pytest.mark.parametrize("argv,fragment", [
    (["-np", "3", "--min-np", "4"], "--min-np 4: must be between 1 and -np (3)"),
    (["-np", "3", "--min-np", "0"], "--min-np 0"),
    (["-np", "3", "--max-np", "2"], "--max-np 2 is below -np 3"),
    (["-np", "3", "--min-np", "2", "--host-discovery-period", "0"],
     "--host-discovery-period 0: must be > 0"),
    (["-np", "3", "--elastic-timeout", "0"], "--elastic-timeout 0"),
    (["-np", "3", "--reset-limit", "-1"], "--reset-limit -1: must be >= 0"),
    (["-np", "3", "--blacklist-after", "-2"], "--blacklist-after -2: must be >= 0"),
    (["-H", "a:2", "--host-discovery-script", "/bin/true"], "not both"),
    (["--host-discovery-script", "/nonexistent/x"], "not an executable file"),
])
def test_bad_elastic_flags_are_refused(argv, fragment):
    with pytest.raises(UsageError) as info:
        to_spec(parse_args([*argv, "python", "t.py"]))
    assert fragment in str(info.value)


def test_host_discovery_script_in_horovods_format(tmp_path):
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho hostA:2\necho\necho hostB\n")
    script.chmod(0o755)
    spec = to_spec(parse_args(["--host-discovery-script", str(script), "python", "t.py"]))
    assert [(h.name, h.slots) for h in spec.hosts] == [("hostA", 2), ("hostB", 1)]
    assert spec.np == 3 and spec.elastic


def test_membership_lines_one_per_change_once(tmp_path):
    (tmp_path / "elastic-1.json").write_text(json.dumps({"size": 2, "lost": [2],
                                                         "seconds": 0.061}))
    seen: set[str] = set()
    assert supervise.membership_lines(str(tmp_path), seen) == [
        "lccrun: elastic: lost rank 2 (launch numbering); 2 ranks continue, group re-formed "
        "in 0.06 s"]
    assert supervise.membership_lines(str(tmp_path), seen) == []
    (tmp_path / "elastic-2.json").write_text(json.dumps({"size": 1, "lost": [0, 1],
                                                         "seconds": 1.5}))
    assert supervise.membership_lines(str(tmp_path), seen) == [
        "lccrun: elastic: lost ranks 0, 1 (launch numbering); 1 ranks continue, group "
        "re-formed in 1.50 s"]
    (tmp_path / "elastic-3.json").write_text(json.dumps({"size": 1, "lost": [], "seconds": 0.2}))
    assert supervise.membership_lines(str(tmp_path), seen) == [
        "lccrun: elastic: hosts updated; the same 1 ranks continue, group re-formed in 0.20 s"]


@pytest.mark.parametrize("code,status", [(None, 0), (0, 0), (3, 3), (256 + 4, 4), ("bye", 1)])
def test_exit_status_after_a_shrink_is_the_interpreters(code, status):
    assert elastic.exiting.exit_status(code) == status


# ---------------------------------------------------------------- growth and host lists
from lightcc.common.elastic import hosts as hosts_mod  # noqa: E402
from lightcc.runner.discovery import Discovery, describe  # noqa: E402
from lightcc.runner.hosts import Host  # noqa: E402


def test_free_slots_fill_listed_hosts_in_order_up_to_the_target():
    hl = hosts_mod.HostList(3, (("a", 2), ("b", 2), ("c", 4)), launcher="a")
    # ranks on a (2) and b (1): b has 1 free slot, c 4; target 5 needs 2 more
    assert hl.free_slots(["a", "a", "b"], 5) == [("b", 1, 2), ("c", 1, 4)]
    assert hl.free_slots(["a", "a", "b"], 3) == []
    assert hl.free_slots(["a.example.com"], 2) == [("a", 1, 2)]   # short names match
    assert hl.free_slots(["a", "a", "b"], 5, excluded=["b"]) == [("c", 2, 4)]   # blacklisted


def test_a_host_whose_ranks_all_ended_is_excluded_from_growth():
    """Open MPI cannot start processes there again (docs/elastic.md): hosts where members ran
    and none runs now; not a host that still has one, nor one that never had any."""
    from lightcc.common.elastic import growth

    ran_on = ["a", "b", "b", "node7"]
    hl = hosts_mod.HostList(4, (("a", 2), ("b", 2), ("c", 2), ("localhost", 2)),
                            launcher="node7")
    assert growth.vacated(hl, ["a", "a"], ran_on, False) == ["b", "localhost"]
    assert growth.vacated(hl, ["a", "b", "node7"], ran_on, False) == []
    excluded = growth.vacated(hl, ["a", "a", "node7"], ran_on, False)
    assert hl.free_slots(["a", "a", "node7"], 5, excluded) == [("c", 2, 2)]


def test_localhost_entries_belong_to_the_launchers_machine():
    hl = hosts_mod.HostList(1, (("localhost", 3),), launcher="node7")
    assert hl.owner("node7") == "localhost" and hl.owner("node8") is None
    assert hl.free_slots(["node7", "node7"], 3) == [("localhost", 1, 3)]


def test_host_list_file_round_trip_and_missing(tmp_path):
    assert hosts_mod.read(str(tmp_path)).version == 0
    hosts_mod.write(str(tmp_path), 4, [("a", 2), ("b", 1)])
    hl = hosts_mod.read(str(tmp_path))
    assert hl.version == 4 and hl.hosts == (("a", 2), ("b", 1))
    assert hosts_mod.published(str(tmp_path)) == 4 and hosts_mod.published(None) == 0


def test_discovery_publishes_a_new_version_only_when_the_list_changes(tmp_path, capsys):
    listing = tmp_path / "hosts.txt"
    listing.write_text("a:2\n")
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {listing}\n")
    script.chmod(0o755)
    d = Discovery(str(tmp_path), [Host("a", 2)], str(script), period=10.0)
    assert hosts_mod.read(str(tmp_path)).version == 1
    assert d.poll(now=0.0) == []                       # not due yet
    assert d.poll(now=1e9) == [] and hosts_mod.read(str(tmp_path)).version == 1   # same list
    listing.write_text("a:2\nb:4\n")
    assert d.poll(now=2e9) == ["lccrun: elastic: hosts changed (+b:4); the ranks re-form the "
                               "group at their next commit"]
    assert hosts_mod.read(str(tmp_path)).hosts == (("a", 2), ("b", 4))
    listing.write_text("")                             # prints nothing: keep the last list
    assert d.poll(now=3e9) == [] and hosts_mod.read(str(tmp_path)).version == 2
    assert "keeping the last host list" in capsys.readouterr().err


def test_describe_a_host_change():
    assert describe([("a", 2), ("b", 2)], [("a", 3), ("c", 1)]) == "+c:1, -b, a 2->3 slots"


def test_membership_line_names_joined_and_removed_ranks(tmp_path):
    (tmp_path / "elastic-1.json").write_text(json.dumps(
        {"size": 3, "lost": [2], "joined": [3], "seconds": 2.5}))
    (tmp_path / "elastic-2.json").write_text(json.dumps(
        {"size": 2, "lost": [], "removed": [0, 1], "joined": [4, 5], "seconds": 1.0}))
    (tmp_path / "elastic-3.json").write_text(json.dumps(
        {"size": 2, "lost": [4], "blacklisted": ["b"], "failures": 2, "seconds": 0.1}))
    assert supervise.membership_lines(str(tmp_path), set()) == [
        "lccrun: elastic: lost rank 2, joined rank 3 (launch numbering); 3 ranks continue, "
        "group re-formed in 2.50 s",
        "lccrun: elastic: removed (host left) ranks 0, 1, joined ranks 4, 5 (launch "
        "numbering); 2 ranks continue, group re-formed in 1.00 s",
        "lccrun: elastic: lost rank 4 (launch numbering); 2 ranks continue, group re-formed "
        "in 0.10 s; host b blacklisted after 2 failed rank(s)"]


def test_failures_are_counted_per_listed_host_and_blacklist_at_the_limit(monkeypatch):
    members = elastic.recovery._Membership()
    monkeypatch.setattr(elastic.recovery, "_members", members)
    hl = hosts_mod.HostList(1, (("a", 2), ("localhost", 2)), launcher="node0")
    assert elastic.recovery._count_failures(hl, ["node0"], 2) == []
    assert elastic.recovery._count_failures(hl, ["a", "node0"], 2) == ["localhost"]
    assert members.failures == {"localhost": 2, "a": 1} and members.blacklist == ["localhost"]
    assert elastic.recovery._count_failures(hl, ["a"], 0) == []        # 0: never


class _FakeComm:
    """The two calls ``without_removed`` makes, for one member of a group."""

    def __init__(self, rank):
        self.rank, self.split = rank, None

    def Get_rank(self):  # noqa: N802 - mpi4py's name
        return self.rank

    def Split(self, color, key):  # noqa: N802
        self.split = (color, key)
        return "sub"


def test_ranks_of_a_removed_host_leave_and_the_others_split_off(monkeypatch):
    from lightcc.common.elastic import growth

    monkeypatch.setattr(growth.ulfm, "UNDEFINED", lambda: -32766)
    hl = hosts_mod.HostList(2, (("a", 2),))
    names = ["a", "b", "a"]
    stay, leave = _FakeComm(2), _FakeComm(1)
    assert growth.without_removed(stay, hl, names) == ("sub", True) and stay.split == (0, 2)
    assert growth.without_removed(leave, hl, names) == ("sub", False)
    assert leave.split == (-32766, 1)
    everyone = _FakeComm(0)                         # all listed (or no list): no split
    assert growth.without_removed(everyone, hl, ["a", "a"]) == (everyone, True)
    assert growth.without_removed(everyone, hosts_mod.HostList(), names) == (everyone, True)
    assert everyone.split is None
