"""lccrun's start-up watch, horovodrun's flags and the Slurm allocation, as pure logic (the real
launches are in tests/parallel/test_launcher_watch.py and tests/netns/test_netns_startup.py).
Every expectation is written out by hand."""
from __future__ import annotations

import os
import socket

import pytest

from lightcc.runner import _rankwrap, args as rargs, slurm, startup
from lightcc.runner.hosts import Host

# ---------------------------------------------------------------- Slurm's compressed syntax


@pytest.mark.parametrize("text,names", [
    ("node1", ["node1"]),
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("a,b[1-2],c", ["a", "b1", "b2", "c"]),
    ("gpu[8-11]", ["gpu8", "gpu9", "gpu10", "gpu11"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("r[1-2]-n[1-2]", ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]),
    ("x[3],y[0-1]z", ["x3", "y0z", "y1z"]),
])
def test_nodelist_expands_as_slurm_writes_it(text, names):
    assert slurm.expand_nodelist(text) == names


@pytest.mark.parametrize("text,tasks", [
    ("1", [1]), ("2(x3),1", [2, 2, 2, 1]), ("4(x2)", [4, 4]), ("1,2,3", [1, 2, 3]),
])
def test_tasks_per_node_expands(text, tasks):
    assert slurm.expand_tasks(text) == tasks


@pytest.mark.parametrize("text", ["", "node[01-03", "node01-03]", "node[a-b]", "node[3-1]",
                                  "a,,b", "n[[1]]"])
def test_bad_nodelist_is_a_clear_error(text):
    with pytest.raises(rargs.ConfigError, match="SLURM_JOB_NODELIST"):
        slurm.expand_nodelist(text)


@pytest.mark.parametrize("text", ["", "2(x)", "x2", "0", "2(x0)", "2(3)"])
def test_bad_tasks_is_a_clear_error(text):
    with pytest.raises(rargs.ConfigError, match="SLURM_TASKS_PER_NODE"):
        slurm.expand_tasks(text)


def test_allocation_hosts_pairs_nodes_with_their_tasks():
    env = {"SLURM_JOB_NODELIST": "node[01-03],gpu7", "SLURM_TASKS_PER_NODE": "2(x3),1"}
    assert slurm.allocation_hosts(env) == [Host("node01", 2), Host("node02", 2),
                                           Host("node03", 2), Host("gpu7", 1)]
    assert slurm.allocation_hosts({"SLURM_JOB_NODELIST": "a,b"}) == [Host("a", 1), Host("b", 1)]
    assert slurm.allocation_hosts({}) is None
    with pytest.raises(rargs.ConfigError, match="counts 2 nodes but"):
        slurm.allocation_hosts({"SLURM_JOB_NODELIST": "a", "SLURM_TASKS_PER_NODE": "1(x2)"})


def _spec(argv, environ=None):
    return rargs.to_spec(rargs.parse_args(argv), environ or {})


def test_lccrun_in_an_allocation_takes_hosts_and_slots_from_slurm():
    env = {"SLURM_JOB_NODELIST": "node[1-2]", "SLURM_TASKS_PER_NODE": "4(x2)"}
    spec = _spec(["python", "t.py"], env)
    assert spec.hosts == [Host("node1", 4), Host("node2", 4)]
    assert spec.np == 8
    assert spec.notes == ["Slurm allocation: hosts and slots from SLURM_JOB_NODELIST and "
                          "SLURM_TASKS_PER_NODE: node1:4,node2:4"]
    explicit = _spec(["-H", "a:1", "python", "t.py"], env)      # -H wins, no note
    assert explicit.hosts == [Host("a", 1)] and explicit.notes == []
    with pytest.raises(rargs.UsageError, match="SLURM_JOB_NODELIST"):
        _spec(["python", "t.py"], {"SLURM_JOB_NODELIST": "node[1-"})


# ---------------------------------------------------------------- horovodrun's flags


def test_hierarchical_allreduce_and_no_stall_check_set_knobs():
    spec = _spec(["-np", "2", "--hierarchical-allreduce", "--no-stall-check", "python", "t.py"])
    assert spec.knob_env["LCC_ALGORITHM"] == "hierarchical"
    assert spec.knob_env["LCC_STALL_CHECK_TIME"] == "0"
    assert spec.knob_env["LCC_STALL_SHUTDOWN_TIME"] == "0"
    with pytest.raises(rargs.UsageError, match="contradicts --algorithm ring"):
        _spec(["-np", "2", "--hierarchical-allreduce", "--algorithm", "ring", "python", "t.py"])
    with pytest.raises(rargs.UsageError, match="--no-stall-check contradicts"):
        _spec(["-np", "2", "--no-stall-check", "--stall-check-time-seconds", "5", "python",
               "t.py"])


def test_output_flags_become_open_mpi_output_options(tmp_path):
    spec = _spec(["-np", "2", "--output-filename", str(tmp_path / "logs"),
                  "--prefix-output-with-timestamp", "python", "t.py"])
    assert spec.mpi_args[:2] == ["--output", f"dir={tmp_path / 'logs'},timestamp"]
    assert _spec(["-np", "1", "python", "t.py"]).mpi_args == []


def test_start_timeout_and_slots_per_host():
    spec = _spec(["-H", "a,b:3", "--slots-per-host", "2", "--start-timeout", "30", "python",
                  "t.py"])
    assert spec.hosts == [Host("a", 2), Host("b", 3)]
    assert spec.np == 5 and spec.start_timeout == 30.0
    with pytest.raises(rargs.UsageError, match="--start-timeout 0: must be > 0"):
        _spec(["-np", "1", "--start-timeout", "0", "python", "t.py"])
    with pytest.raises(rargs.UsageError, match="--slots-per-host 0"):
        _spec(["-H", "a", "--slots-per-host", "0", "python", "t.py"])


def test_timeline_mark_cycles_is_accepted_with_a_note():
    spec = _spec(["-np", "1", "--timeline-mark-cycles", "python", "t.py"])
    assert len(spec.notes) == 1 and "always marks engine cycles" in spec.notes[0]


def test_horovod_config_file_fills_unset_flags(tmp_path):
    cfg = tmp_path / "hvd.yaml"
    cfg.write_text("params:\n  fusion_threshold_mb: 32\n  cycle_time_ms: 10\n"
                   "  hierarchical_allgather: true\n"
                   "timeline:\n  filename: tl.json\n"
                   "stall_check:\n  warning_time_seconds: 120\n  shutdown_time_seconds: 240\n"
                   "logging:\n  level: INFO\nlibrary_options:\n  num_nccl_streams: 2\n")
    spec = _spec(["-np", "2", "--config-file", str(cfg), "--cycle-time-ms", "5", "python",
                  "t.py"])
    env = spec.knob_env
    assert env["LCC_FUSION_THRESHOLD"] == str(32 * 1024 * 1024)
    assert env["LCC_CYCLE_TIME"] == "5"                    # the command line wins
    assert env["LCC_TIMELINE"] == os.path.abspath("tl.json")
    assert env["LCC_STALL_CHECK_TIME"] == "120" and env["LCC_STALL_SHUTDOWN_TIME"] == "240"
    assert env["LCC_LOG_LEVEL"] == "info"
    assert spec.notes == ["--config-file: params.hierarchical_allgather, "
                          "library_options.num_nccl_streams do not apply to lightcc and are "
                          "ignored"]
    off = tmp_path / "off.yaml"
    off.write_text("stall_check:\n  enabled: false\n")
    assert _spec(["-np", "1", "--config-file", str(off), "python", "t.py"]).knob_env[
        "LCC_STALL_SHUTDOWN_TIME"] == "0"
    with pytest.raises(rargs.UsageError, match="no such file"):
        _spec(["-np", "1", "--config-file", str(tmp_path / "nope.yaml"), "python", "t.py"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("params:\n  cycle_time_ms: -3\n")
    with pytest.raises(rargs.UsageError, match="--cycle-time-ms"):
        _spec(["-np", "1", "--config-file", str(bad), "python", "t.py"])


# ---------------------------------------------------------------- start-up progress


def test_layout_follows_map_by_slot():
    assert startup.layout([Host("a", 2), Host("b", 2)], 3) == {0: "a", 1: "a", 2: "b"}
    assert startup.layout(None, 2) == {0: "localhost", 1: "localhost"}
    assert startup.layout([Host("a", 2)], 2, mapped_by_user=True) == {0: "", 1: ""}


def test_progress_line_names_the_missing_hosts_and_ranks():
    placed = startup.layout([Host("node1", 3), Host("node2", 3), Host("node3", 2)], 8)
    assert startup.progress_line({0, 1, 2, 3, 4, 5}, placed, 10.2) == \
        "6/8 ranks up after 10 s; waiting for node3 (ranks 6, 7)"
    assert startup.progress_line({0, 1, 2, 3, 4, 6}, placed, 4.6, silent={"node3"}) == \
        "6/8 ranks up after 5 s; waiting for node2 (rank 5), node3 (rank 7); node3 does not " \
        "answer the launch agent (ssh), and Open MPI starts no rank until every host's " \
        "daemon is up"
    assert startup.progress_line({0}, {0: "", 1: ""}, 3) == \
        "1/2 ranks up after 3 s; waiting for rank 1"


class _FakeRegistry:
    def __init__(self):
        self.up = set()

    def ranks_up(self):
        return set(self.up)


def test_start_watch_prints_every_interval_and_ends_at_the_timeout():
    reg = _FakeRegistry()
    watch = startup.StartWatch(reg, {0: "a", 1: "b"}, timeout=12.0, interval=5.0, now=100.0)
    assert watch.poll(101.0) == ([], None)             # quiet before the first interval
    reg.up.add(0)
    assert watch.poll(105.0) == (["lccrun: 1/2 ranks up after 5 s; waiting for b (rank 1)"],
                                 None)
    assert watch.poll(107.0) == ([], None)
    lines, error = watch.poll(112.0)
    assert lines == [] and error == ("lccrun: error: --start-timeout 12 s expired: 1/2 ranks "
                                     "up after 12 s; waiting for b (rank 1)")
    assert watch.poll(120.0) == ([], None)             # said once


def test_start_watch_reports_once_when_everyone_came():
    reg = _FakeRegistry()
    watch = startup.StartWatch(reg, {0: "a", 1: "a"}, timeout=None, interval=5.0, now=0.0)
    reg.up |= {0, 1}
    assert watch.poll(1.0) == ([], None)               # fast start: nothing printed
    slow = startup.StartWatch(_FakeRegistry(), {0: "a"}, timeout=None, interval=5.0, now=0.0)
    assert slow.poll(5.0)[0] == ["lccrun: 0/1 ranks up after 5 s; waiting for a (rank 0)"]
    slow.registry.up.add(0)
    assert slow.poll(6.0) == (["lccrun: all 1 ranks up after 6 s"], None)


def test_agent_command_uses_the_plm_ssh_agent_of_mpi_args():
    assert startup.agent_command(["--prtemca", "plm_ssh_agent", "/x/agent.sh -v"], None,
                                 None) == ["/x/agent.sh", "-v"]
    assert startup.agent_command([], 2222, "/k") == [
        "ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "-p", "2222", "-i", "/k"]


def test_agent_probe_names_a_host_that_does_not_answer(tmp_path):
    agent = tmp_path / "agent.sh"
    agent.write_text('#!/bin/sh\nif [ "$1" = dead ]; then exec sleep 60; fi\nexec "$2"\n')
    agent.chmod(0o755)
    assert startup.answers([str(agent)], "alive", timeout=5.0)
    assert not startup.answers([str(agent)], "dead", timeout=0.5)


def test_rank_wrapper_reports_to_the_registry_and_strangers_are_dropped(monkeypatch):
    reg = startup.Registry(["127.0.0.1"])
    try:
        env = dict(reg.env())
        monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "3")
        assert _rankwrap.announce(env)
        with socket.create_connection(("127.0.0.1", reg.port)) as s:   # wrong token
            s.sendall(b"0123 5 host 77\n")
        assert not _rankwrap.announce({**env, _rankwrap.ADDR_ENV: f"127.0.0.1:{1}"},
                                      timeout=0.5)
        for _ in range(200):
            if reg.strangers and reg.ranks_up():
                break
            import time
            time.sleep(0.01)
        assert reg.ranks_up() == {3}
        assert reg.up[3][0] == socket.gethostname()
        assert reg.strangers == 1
    finally:
        reg.close()
