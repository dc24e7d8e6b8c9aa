"""lccrun without launching: flags -> LCC_* env, host lists, hostfiles, the mpirun command,
argument errors, the rank wrapper's exit handling and the failure summary."""
from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from lightcc.common.config import KNOBS
from lightcc.runner import _rankwrap, args as rargs, check_build, cli, command, supervise
from lightcc.runner.args import UsageError, parse_args, to_spec
from lightcc.runner.command import Machine, build_command, split_python_args, wrap_command
from lightcc.runner.hosts import (Host, distinct_machines, parse_host_list, parse_hostfile,
                                  parse_hostfile_text)
from lightcc.common.exceptions import ConfigError

MPIRUN = "/opt/mpi/bin/mpirun"
BASE_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/root"}
KNOB_DEFAULT = {k.env: k.default for k in KNOBS}


def build(argv, env=None, **machine):
    spec = to_spec(parse_args(argv))
    m = Machine(mpirun=MPIRUN, **{"euid": 1000, "cores": 64, **machine})
    return build_command(spec, m, dict(BASE_ENV if env is None else env))


def pairs(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, tok in enumerate(argv) if tok == flag]


def mca(argv: list[str]) -> dict[str, str]:
    return {argv[i + 1]: argv[i + 2] for i, tok in enumerate(argv) if tok == "--mca"}


# ---------------------------------------------------------------- flags -> environment
@pytest.mark.parametrize("flags,env_name,value", [
    (["--fusion-threshold-mb", "32"], "LCC_FUSION_THRESHOLD", "33554432"),
    (["--fusion-threshold-mb", "0.5"], "LCC_FUSION_THRESHOLD", "524288"),
    (["--fusion-threshold-mb", "0"], "LCC_FUSION_THRESHOLD", "0"),
    (["--cycle-time-ms", "2.5"], "LCC_CYCLE_TIME", "2.5"),
    (["--cycle-time-ms", "3"], "LCC_CYCLE_TIME", "3"),
    (["--cache-capacity", "0"], "LCC_CACHE_CAPACITY", "0"),
    (["--compression", "none"], "LCC_COMPRESSION", "none"),
    (["--algorithm", "flat"], "LCC_ALGORITHM", "flat"),
    (["--autotune"], "LCC_AUTOTUNE", "1"),
    (["--autotune", "refresh"], "LCC_AUTOTUNE", "refresh"),
    (["--autotune=refresh"], "LCC_AUTOTUNE", "refresh"),
    (["--stall-check-time-seconds", "30"], "LCC_STALL_CHECK_TIME", "30"),
    (["--stall-shutdown-time-seconds", "90.5"], "LCC_STALL_SHUTDOWN_TIME", "90.5"),
    (["--log-level", "debug"], "LCC_LOG_LEVEL", "debug"),
    (["--num-links", "4"], "LCC_NUM_LINKS", "4"),
    (["--local-size", "2"], "LCC_LOCAL_SIZE", "2"),
])
def test_each_flag_sets_its_variable(flags, env_name, value):
    launch = build(["-np", "2", *flags, "python", "x.py"])
    assert launch.env[env_name] == value
    assert launch.changed[env_name] == value
    assert env_name in pairs(launch.argv, "-x")
    knob = next(k for k in KNOBS if k.env == env_name)
    assert knob.check(knob.parse(value)) is None  # what init() would accept


def test_path_flags_become_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    launch = build(["-np", "1", "--timeline-filename", "t.json", "--autotune-log-file",
                    "a.csv", "python", "x.py"])
    assert launch.env["LCC_TIMELINE"] == str(tmp_path / "t.json")
    assert launch.env["LCC_AUTOTUNE_LOG"] == str(tmp_path / "a.csv")


def test_autotune_does_not_swallow_the_command():
    launch = build(["-np", "2", "--autotune", "python", "x.py"])
    assert launch.env["LCC_AUTOTUNE"] == "1"
    assert launch.argv[-3:] == ["-m", command.WRAPPER_MODULE, "x.py"]


def test_option_values_may_start_with_a_dash_and_the_command_is_untouched():
    launch = build(["-np", "2", "--mpi-args", "--map-by ppr:1:node", "python", "x.py",
                    "--mpi-args", "keep", "--autotune", "-np", "9"])
    assert pairs(launch.argv, "--map-by") == ["ppr:1:node"]
    assert launch.argv[-6:] == ["x.py", "--mpi-args", "keep", "--autotune", "-np", "9"]
    assert "LCC_AUTOTUNE" not in launch.env and pairs(launch.argv, "-np")[0] == "2"
    with pytest.raises(UsageError, match="-np must be >= 1, got -1"):
        build(["-np", "-1", "python", "x.py"])
    with pytest.raises(UsageError, match="expected one argument"):
        build(["-np"])


def test_num_links_default_comes_from_knobs():
    launch = build(["-np", "2", "python", "x.py"])
    assert launch.env["LCC_NUM_LINKS"] == str(KNOB_DEFAULT["LCC_NUM_LINKS"])
    assert mca(launch.argv)["btl_tcp_links"] == str(KNOB_DEFAULT["LCC_NUM_LINKS"])
    launch = build(["-np", "2", "--num-links", "5", "python", "x.py"])
    assert mca(launch.argv)["btl_tcp_links"] == "5"


def test_unset_flags_leave_knob_variables_alone():
    launch = build(["-np", "2", "python", "x.py"])
    assert sorted(n for n in launch.env if n.startswith("LCC_")) == ["LCC_NUM_LINKS"]


def test_help_shows_defaults_from_knobs():
    text = rargs.build_parser().format_help()
    mb = KNOB_DEFAULT["LCC_FUSION_THRESHOLD"] // (1024 * 1024)
    assert f"default {mb} MB" in text
    for kf in rargs.KNOB_FLAGS:
        assert kf.flag in text and kf.env in text


# ---------------------------------------------------------------- bad arguments
@pytest.mark.parametrize("argv,fragment", [
    (["-np", "0", "python", "x.py"], "-np must be >= 1"),
    (["-np", "-3", "python", "x.py"], "-np must be >= 1"),
    (["-np", "two", "python", "x.py"], "invalid int value"),
    (["python", "x.py"], "-np N is required"),
    (["-np", "2"], "no command given"),
    (["-np", "2", "-H", "a:2,,b:2", "python", "x.py"], "empty entry"),
    (["-np", "2", "-H", "a:x", "python", "x.py"], "not an integer"),
    (["-np", "2", "-H", "a:0", "python", "x.py"], "slots must be >= 1"),
    (["-np", "2", "-H", ":2", "python", "x.py"], "not a valid host name"),
    (["-np", "2", "-H", "a:1:2", "python", "x.py"], "more than one ':'"),
    (["-np", "2", "-H", "a,a", "python", "x.py"], "more than once"),
    (["-np", "5", "-H", "a:2,b:2", "python", "x.py"], "exceeds the 4 slots"),
    (["-np", "2", "--hostfile", "/nonexistent/hosts", "python", "x.py"], "no such file"),
    (["-np", "2", "-H", "a", "--hostfile", "h", "python", "x.py"], "not both"),
    (["-np", "2", "--compression", "nosuchcodec", "python", "x.py"], "unknown compressor"),
    (["-np", "2", "--algorithm", "nosuchalgo", "python", "x.py"], "unknown algorithm"),
    (["-np", "2", "--log-level", "loud", "python", "x.py"], "must be one of"),
    (["-np", "2", "--fusion-threshold-mb", "-1", "python", "x.py"], "must be >= 0"),
    (["-np", "2", "--num-links", "0", "python", "x.py"], "must be >= 1"),
    (["-np", "2", "--ssh-port", "70000", "python", "x.py"], "1..65535"),
    (["-np", "2", "--ssh-identity-file", "/nonexistent/key", "python", "x.py"], "no such file"),
    (["-np", "2", "--network-interface", "eth0;rm", "python", "x.py"], "expected names"),
    (["-np", "2", "-x", "1BAD", "python", "x.py"], "NAME or NAME=VALUE"),
    (["-np", "2", "--mpi-args", "'unclosed", "python", "x.py"], "--mpi-args"),
    (["-np", "2", "--no-such-flag", "python", "x.py"], "unrecognized arguments"),
])
def test_bad_arguments_are_refused(argv, fragment):
    with pytest.raises(UsageError, match=None) as info:
        build(argv)
    assert fragment in str(info.value)


def test_unset_forwarded_variable_is_refused():
    with pytest.raises(UsageError, match="not set in the environment"):
        build(["-np", "2", "-x", "LCC_SURELY_UNSET_VAR", "python", "x.py"])


def test_invalid_inherited_lcc_variable_is_refused():
    with pytest.raises(UsageError, match="LCC_CYCLE_TIME='abc' .from the environment"):
        build(["-np", "2", "python", "x.py"], env={**BASE_ENV, "LCC_CYCLE_TIME": "abc"})


@pytest.mark.parametrize("argv", [
    ["-np", "0", "python", "x.py"],
    ["-np", "2", sys.executable, "nonexistent_script_abc.py"],
    ["-np", "2", "no-such-program-xyz"],
    ["-np", "2", "-H", "a:b", "python", "x.py"],
    ["-np", "2", "--compression", "zzz", "python", "x.py"],
])
def test_cli_usage_errors_are_one_line_exit_2(argv, capsys, monkeypatch):
    monkeypatch.setattr(cli, "run", lambda *a, **k: pytest.fail("must not launch"))
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("lccrun: error: ") and captured.err.count("\n") == 1


def test_missing_script_names_it(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["-np", "2", sys.executable, "nonexistent.py"]) == 2
    assert "'nonexistent.py' not found" in capsys.readouterr().err


# ---------------------------------------------------------------- hosts
def test_host_list_parsing():
    assert parse_host_list("a:2,b:4") == [Host("a", 2), Host("b", 4)]
    assert parse_host_list("node-1.example.com, 10.0.0.2:3") == [
        Host("node-1.example.com", 1), Host("10.0.0.2", 3)]


def test_hostfile_parsing(tmp_path):
    text = "# cluster\nnode1 slots=4\n\nnode2 slots=2 max_slots=8  # big\nnode3\n"
    assert parse_hostfile_text(text) == [Host("node1", 4), Host("node2", 2), Host("node3", 1)]
    path = tmp_path / "hosts"
    path.write_text(text)
    assert parse_hostfile(path)[0] == Host("node1", 4)


@pytest.mark.parametrize("text,fragment", [
    ("node1 slots=x\n", "line 1: slots 'x' is not an integer"),
    ("node1\nnode2 cpus=2\n", "line 2: unknown field 'cpus'"),
    ("node1 4\n", "expected 'host slots=N'"),
    ("# only comments\n\n", "no hosts listed"),
    ("a slots=1\na slots=2\n", "more than once"),
    ("bad/name slots=1\n", "not a valid host name"),
])
def test_bad_hostfiles(text, fragment):
    with pytest.raises(ConfigError) as info:
        parse_hostfile_text(text)
    assert fragment in str(info.value)


def test_hosts_on_the_command_line(tmp_path):
    launch = build(["-np", "4", "-H", "a:2,b:2", "python", "x.py"])
    argv = launch.argv
    assert pairs(argv, "-H") == ["a:2,b:2"]
    assert "--tag-output" in argv and "--oversubscribe" not in argv
    assert pairs(argv, "-np") == ["4"]
    # -np defaults to all slots; a hostfile is passed by absolute path
    hf = tmp_path / "hosts"
    hf.write_text("a slots=3\nb slots=1\n")
    launch = build(["--hostfile", str(hf), "python", "x.py"])
    assert pairs(launch.argv, "-np") == ["4"] and pairs(launch.argv, "--hostfile") == [str(hf)]


def test_local_aliases_count_as_one_machine():
    assert distinct_machines([Host("localhost", 1), Host("127.0.0.1", 1)]) == 1
    launch = build(["-np", "2", "-H", "localhost:2", "python", "x.py"])
    assert "--tag-output" not in launch.argv
    assert "--tag-output" in build(["-np", "2", "--verbose", "python", "x.py"]).argv


# ---------------------------------------------------------------- the mpirun line
def test_root_oversubscribe_binding_mapping():
    as_user = build(["-np", "2", "python", "x.py"], euid=1000, cores=4).argv
    assert as_user[0] == MPIRUN and "--allow-run-as-root" not in as_user
    assert "--oversubscribe" not in as_user
    assert pairs(as_user, "--bind-to") == ["none"] and pairs(as_user, "--map-by") == ["slot"]
    as_root = build(["-np", "5", "python", "x.py"], euid=0, cores=4).argv
    assert "--allow-run-as-root" in as_root and "--oversubscribe" in as_root


def test_mpi_args_pass_through_and_replace_defaults():
    argv = build(["-np", "2", "--mpi-args", "--map-by ppr:1:node --mca foo 'a b'",
                  "python", "x.py"]).argv
    assert pairs(argv, "--map-by") == ["ppr:1:node"]
    assert mca(argv)["foo"] == "a b"
    assert argv.index("--mca", argv.index("ppr:1:node")) < argv.index(command.WRAPPER_MODULE)


def test_network_interface_and_ssh():
    argv = build(["-np", "2", "--network-interface", "eth0, ib0", "-p", "2222",
                  "python", "x.py"]).argv
    m = mca(argv)
    assert m["btl_tcp_if_include"] == "eth0,ib0" and m["oob_tcp_if_include"] == "eth0,ib0"
    assert m["plm_ssh_args"] == "-p 2222"
    old = build(["-np", "2", "--ssh-port", "22", "python", "x.py"], mpi_major=4).argv
    assert mca(old)["plm_rsh_args"] == "-p 22"


def test_ssh_identity_file(tmp_path):
    key = tmp_path / "id_key"
    key.write_text("k")
    argv = build(["-np", "2", "-i", str(key), "python", "x.py"]).argv
    assert mca(argv)["plm_ssh_args"] == f"-i {key}"


def test_environment_forwarding():
    env = {**BASE_ENV, "LCC_CACHE_CAPACITY": "9", "VIRTUAL_ENV": "/venv",
           "LD_LIBRARY_PATH": "/lib", "PYTHONPATH": "/mine", "OTHER": "1",
           "LCC_RUNNER_STATUS_DIR": "/stale"}
    launch = build(["-np", "2", "--cache-capacity", "5", "-x", "FOO=bar", "-x", "OTHER",
                    "python", "x.py"], env=env)
    xs = pairs(launch.argv, "-x")
    for name in ("LCC_CACHE_CAPACITY", "LCC_NUM_LINKS", "PYTHONPATH", "PATH", "VIRTUAL_ENV",
                 "LD_LIBRARY_PATH", "FOO", "OTHER"):
        assert name in xs, name
    assert "HOME" not in xs and "LCC_RUNNER_STATUS_DIR" not in xs
    assert "LCC_RUNNER_STATUS_DIR" not in launch.env
    assert launch.env["LCC_CACHE_CAPACITY"] == "5"  # the flag beats the inherited value
    assert launch.env["FOO"] == "bar"
    assert "/mine" in launch.env["PYTHONPATH"].split(":")
    assert len(xs) == len(set(xs))


def test_torch_rendezvous_variables():
    """MASTER_ADDR/MASTER_PORT for torchrun-style scripts: set, forwarded, never overridden."""
    launch = build(["-np", "2", "python", "x.py"], master_port=41234)
    assert launch.env["MASTER_ADDR"] == "127.0.0.1" and launch.env["MASTER_PORT"] == "41234"
    xs = pairs(launch.argv, "-x")
    assert "MASTER_ADDR" in xs and "MASTER_PORT" in xs
    launch = build(["-H", "nodeA:2,nodeB:2", "python", "x.py"], master_port=41234)
    assert launch.env["MASTER_ADDR"] == "nodeA"
    mine = {**BASE_ENV, "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "555"}
    launch = build(["-np", "2", "python", "x.py"], env=mine, master_port=41234)
    assert (launch.env["MASTER_ADDR"], launch.env["MASTER_PORT"]) == ("10.0.0.7", "555")
    assert "MASTER_PORT" not in launch.changed
    assert 0 < command.free_port() < 65536


def test_rank_wrapper_exports_torch_rank_variables():
    env = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
           "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "RANK": "9"}
    assert _rankwrap.export_torch_env(env) == {"RANK": "3", "WORLD_SIZE": "4",
                                               "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert env["RANK"] == "3"                     # lccrun's launch decides the rank
    only_pmix = {"PMIX_RANK": "2"}
    assert _rankwrap.export_torch_env(only_pmix) == {"RANK": "2"}
    assert _rankwrap.export_torch_env({}) == {}


def test_python_commands_go_through_the_wrapper():
    w = command.WRAPPER_MODULE
    assert wrap_command(["python", "t.py", "--lr", "1"]) == ["python", "-m", w, "t.py", "--lr", "1"]
    assert wrap_command(["python3", "-u", "-X", "dev", "-c", "pass", "a"]) == \
        ["python3", "-u", "-X", "dev", "-m", w, "-c", "pass", "a"]
    assert wrap_command([sys.executable, "-Wignore", "-m", "pkg.mod"]) == \
        [sys.executable, "-Wignore", "-m", w, "-m", "pkg.mod"]
    for other in (["./train.sh", "a"], ["python", "-i", "t.py"], ["python", "-"],
                  ["python", "--version"], ["python"], ["python", "-c"]):
        wrapped = wrap_command(other, python="/venv/bin/python")
        assert wrapped[:2] == ["/venv/bin/python", "-I"]
        assert wrapped[2].endswith("_rankwrap.py") and Path(wrapped[2]).is_file()
        assert wrapped[3:] == ["--exec", *other]
    assert split_python_args(["python", "-OO", "-B", "t.py"]) == (["-OO", "-B"], ["t.py"])


def test_dry_run_output(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.py").write_text("")
    assert cli.main(["--dry-run", "-np", "4", "-H", "a:2,b:2", "--fusion-threshold-mb", "32",
                     sys.executable, "x.py", "--epochs", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "export LCC_FUSION_THRESHOLD=33554432" in out
    cmd = shlex.split(out[-1])
    assert cmd[0].endswith("mpirun")
    assert pairs(cmd, "-H") == ["a:2,b:2"] and pairs(cmd, "-np") == ["4"]
    assert cmd[-6:] == [sys.executable, "-m", command.WRAPPER_MODULE, "x.py", "--epochs", "1"]


def test_version(capsys):
    assert cli.main(["--version"]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("lccrun (lightcc) ") and len(out.split()) == 3


# ---------------------------------------------------------------- check-build
def test_check_build_survives_missing_packages(monkeypatch):
    monkeypatch.setattr(check_build, "_dist_version", lambda name: None)
    monkeypatch.setattr(check_build, "find_mpirun",
                        lambda: (_ for _ in ()).throw(UsageError("mpirun not found")))
    rows = dict(check_build.collect())
    assert rows["torch"] == "not installed" and rows["CuPy"] == "not installed"
    assert rows["numba"] == "not installed" and rows["ml_dtypes"] == "not installed"
    assert rows["mpirun"].startswith("not found")
    assert "none" in rows["compressors"] and "auto" in rows["algorithms"]
    text = check_build.render(check_build.collect())
    assert text.startswith("lightcc build check")


def test_check_build_reports_errors_instead_of_crashing(monkeypatch):
    def boom():
        raise RuntimeError("broken install")
    monkeypatch.setattr(check_build, "_torch_rows", boom)
    rows = dict(check_build.collect())
    assert rows["torch"].startswith("error: RuntimeError")


# ---------------------------------------------------------------- failure summary
SIGNAL_BANNER = """--------------------------------------------------------------------------
prterun noticed that process rank 1 with PID 2845 on node vm exited on
signal 9 (Killed).
--------------------------------------------------------------------------
"""
EXIT_BANNER = """prterun detected that one or more processes exited with non-zero status,
thus causing the job to be terminated. The first process to do so was:

   Process name: [prterun-vm-2821@1,2]
   Exit code:    4
"""
ABORT_BANNER = """MPI_ABORT was invoked on rank 3 in communicator MPI_COMM_WORLD
  Proc: [[15237,1],3]
  Errorcode: 5
"""
IMPROPER_BANNER = """prterun has exited due to process rank 1 with PID 5315 on node vm exiting
improperly. There are three reasons this could occur:"""


LOST = "uncaught ShutdownError: allreduce 'g': rank 1 exited or lost its connection"


@pytest.mark.parametrize("banner,statuses,expect", [
    (SIGNAL_BANNER, [], "rank 1 killed by signal 9 (SIGKILL) on host vm"),
    (EXIT_BANNER, [], "rank 2 exited with code 4"),
    (ABORT_BANNER, [], "rank 3 called MPI_Abort with error code 5"),
    (ABORT_BANNER, [{"rank": 3, "code": 3, "what": "sys.exit", "time": 1.0}],
     "rank 3 exited with code 3"),
    (ABORT_BANNER, [{"rank": 3, "code": 1, "what": "uncaught KeyError: 'x'", "time": 1.0}],
     "rank 3 exited with code 1 (uncaught KeyError: 'x')"),
    (IMPROPER_BANNER, [], "rank 1 exited without calling MPI finalize"),
    ("", [{"rank": 0, "code": 7, "what": "sys.exit", "time": 2.0},
          {"rank": 1, "code": 2, "what": "sys.exit", "time": 1.0}], "rank 1 exited with code 2"),
    (SIGNAL_BANNER + ABORT_BANNER, [{"rank": 3, "code": 1, "what": "x", "time": 1.0}],
     "rank 1 killed by signal 9"),
    # the survivor's abort (a consequence) reached prterun before the failed rank's: the
    # records decide, not the race
    (ABORT_BANNER, [{"rank": 3, "code": 1, "what": LOST, "consequence": True, "time": 1.0},
                    {"rank": 1, "code": 1, "what": "uncaught RuntimeError: boom", "time": 2.0}],
     "rank 1 exited with code 1 (uncaught RuntimeError: boom)"),
    (ABORT_BANNER + EXIT_BANNER,
     [{"rank": 3, "code": 1, "what": LOST, "consequence": True, "time": 1.0}],
     "rank 2 exited with code 4"),
    ("", [{"rank": 0, "code": 1, "what": LOST, "consequence": True, "time": 1.0},
          {"rank": 2, "code": 3, "what": "sys.exit", "time": 2.0}], "rank 2 exited with code 3"),
    # only consequences known (the failed rank exited 0): the first of them
    (ABORT_BANNER, [{"rank": 3, "code": 1, "what": LOST, "consequence": True, "time": 1.0}],
     "rank 3 exited with code 1"),
    # a process that joined an elastic job (launch number 5) is rank 3 of its spawned job
    # in prterun's banner; its record names it
    (ABORT_BANNER, [{"rank": 5, "job_rank": 3, "code": 1, "what": "uncaught KeyError: 'x'",
                     "time": 1.0}], "rank 5 exited with code 1 (uncaught KeyError: 'x')"),
    # ... unless a launched process has that rank and a record of its own
    (ABORT_BANNER, [{"rank": 5, "job_rank": 3, "code": 1, "what": "x", "time": 1.0},
                    {"rank": 3, "code": 5, "what": "uncaught KeyError: 'y'", "time": 2.0}],
     "rank 3 exited with code 5 (uncaught KeyError: 'y')"),
])
def test_diagnose(banner, statuses, expect):
    failures = supervise.diagnose(1, banner, sorted(statuses, key=lambda r: r["time"]))
    assert expect in failures[-1].describe()


def test_diagnose_nothing_failed():
    assert supervise.diagnose(0, "all good\n", []) == []


def test_summary_lines(capsys):
    rc = supervise._summarise(137, SIGNAL_BANNER, [], [])
    assert rc == 137
    assert capsys.readouterr().err.strip().splitlines()[-1] == \
        "lccrun: rank 1 killed by signal 9 (SIGKILL) on host vm"
    assert supervise._summarise(5, "", [], []) == 5
    assert "named no failed rank" in capsys.readouterr().err
    assert supervise._summarise(0, "", [], [2]) == 130


def test_read_statuses(tmp_path):
    (tmp_path / "rank-1.json").write_text(json.dumps({"rank": 1, "code": 3, "time": 2.0}))
    (tmp_path / "rank-0.json").write_text(json.dumps({"rank": 0, "code": 1, "time": 1.0}))
    (tmp_path / "rank-2.json").write_text("{torn")
    assert [r["rank"] for r in supervise.read_statuses(str(tmp_path))] == [0, 1]
    assert supervise.read_statuses(None) == []


# ---------------------------------------------------------------- rank wrapper
def test_wrapper_exit_codes():
    assert _rankwrap._exit_code(SystemExit(None)) == (0, "")
    assert _rankwrap._exit_code(SystemExit(3)) == (3, "sys.exit")
    assert _rankwrap._exit_code(KeyboardInterrupt()) == (130, "KeyboardInterrupt")
    assert _rankwrap._exit_code(ValueError("bad")) == (1, "uncaught ValueError: bad")


def test_wrapper_runs_code_and_records_failure(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LCC_RUNNER_STATUS_DIR", str(tmp_path))
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "5")
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", None)  # no MPI: plain exit
    assert _rankwrap.main(["-c", "import sys; assert sys.argv == ['-c', 'a']", "a"]) == 0
    assert not list(tmp_path.iterdir())
    assert _rankwrap.main(["-c", "raise KeyError('k')"]) == 1
    record = json.loads((tmp_path / "rank-5.json").read_text())
    assert record["rank"] == 5 and record["code"] == 1 and "KeyError" in record["what"]
    err = capsys.readouterr().err
    assert "KeyError: 'k'" in err and "runpy" not in err and "_rankwrap" not in err
    script = tmp_path / "s.py"
    script.write_text("import sys\nif __name__ == '__main__':\n    sys.exit(int(sys.argv[1]))\n")
    assert _rankwrap.main([str(script), "4"]) == 4
    assert json.loads((tmp_path / "rank-5.json").read_text())["code"] == 4


def _exec_wrapper(tmp_path, script: str, extra_env=None):
    env = {"PATH": "/usr/bin:/bin", "LCC_RUNNER_STATUS_DIR": str(tmp_path),
           "OMPI_COMM_WORLD_RANK": "2", **(extra_env or {})}
    wrapper = Path(_rankwrap.__file__)
    return subprocess.run([sys.executable, "-I", str(wrapper), "--exec", "sh", "-c", script],
                          env=env, capture_output=True, text=True, timeout=30)


def test_exec_wrapper_passes_on_exit_codes_and_signals(tmp_path):
    assert _exec_wrapper(tmp_path, "exit 0").returncode == 0
    assert not list(tmp_path.glob("rank-*.json"))
    assert _exec_wrapper(tmp_path, "exit 5").returncode == 5
    record = json.loads((tmp_path / "rank-2.json").read_text())
    assert record["code"] == 5 and "signal" not in record
    done = _exec_wrapper(tmp_path, "kill -SEGV $$")
    assert done.returncode == -11  # the wrapper dies of the same signal
    record = json.loads((tmp_path / "rank-2.json").read_text())
    assert record["signal"] == 11
    assert "rank 2 killed by signal 11 (SIGSEGV)" in supervise.diagnose(
        139, "", [record])[-1].describe()


def test_exec_wrapper_does_not_blame_a_rank_that_was_told_to_stop(tmp_path):
    # the wrapper forwards SIGTERM to its child; the child's death is teardown, not a failure
    done = _exec_wrapper(tmp_path, "kill -TERM $PPID; sleep 5")
    assert done.returncode == -15
    assert not list(tmp_path.glob("rank-*.json"))


def test_wrapper_aborts_when_mpi_is_initialised(monkeypatch):
    calls = []

    class FakeWorld:
        def Abort(self, code):
            calls.append(code)

    class FakeMPI:
        COMM_WORLD = FakeWorld()

        @staticmethod
        def Is_initialized():
            return True

        @staticmethod
        def Is_finalized():
            return False

    monkeypatch.setitem(sys.modules, "mpi4py.MPI", FakeMPI)
    monkeypatch.delenv("LCC_RUNNER_STATUS_DIR", raising=False)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    assert _rankwrap.main(["-c", "import sys; sys.exit(3)"]) == 3
    assert calls == [3]
    assert _rankwrap.main(["-c", "pass"]) == 0 and calls == [3]


def test_dry_run_only_warns_about_a_missing_script(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["--dry-run", "-np", "2", sys.executable, "elsewhere.py"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# warning: script 'elsewhere.py' not found")
    assert shlex.split(out.splitlines()[-1])[-1] == "elsewhere.py"


def test_docs_list_every_flag_next_to_its_variable():
    doc = Path(__file__).resolve().parents[2] / "docs" / "launcher.md"
    if not doc.exists():
        pytest.skip("docs/launcher.md not present")
    rows = [line for line in doc.read_text().splitlines() if line.startswith("| `--")]
    for kf in rargs.KNOB_FLAGS:
        assert any(kf.flag + " " in row and f"`{kf.env}`" in row for row in rows), kf.flag
    for flag in ("-np", "--hostfile", "--network-interface", "--ssh-port", "--mpi-args",
                 "--dry-run", "--check-build", "--verbose", "--version"):
        assert f"`{flag}" in doc.read_text() or f"{flag} " in doc.read_text(), flag


def test_errors_that_only_report_a_lost_rank_wait_before_aborting():
    from lightcc.common.exceptions import LightCCError, ShutdownError

    assert _rankwrap.is_consequence(ShutdownError(
        "allreduce 'grad.0': rank 1 exited or lost its connection before submitting it"))
    assert _rankwrap.is_consequence(ShutdownError(
        "unnamed allreduce #3 (float32 (1,) sum): rank 2 shut down or exited without making "
        "the matching call"))
    assert _rankwrap.is_consequence(ShutdownError(
        "lightcc was shut down on all ranks: rank 0 (the coordinator) closed its connection"))
    assert not _rankwrap.is_consequence(RuntimeError("rank 1 exited or lost its connection"))
    assert not _rankwrap.is_consequence(LightCCError("allreduce 'x': rank 1 has shape (3,)"))


def test_a_consequence_is_recorded_and_waits_for_its_cause(tmp_path, monkeypatch, capsys):
    """A rank whose error only reports another rank's failure says so in its record, and waits
    (before MPI_Abort) until a record of a failure of its own appears: at once when there is
    one, never for another consequence."""
    import threading
    import time

    monkeypatch.setenv("LCC_RUNNER_STATUS_DIR", str(tmp_path))
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", None)
    waits = []
    real_wait = _rankwrap.wait_for_cause
    monkeypatch.setattr(_rankwrap, "wait_for_cause", lambda: waits.append(real_wait(0.2)))
    code = ("from lightcc.common.exceptions import ShutdownError\n"
            "raise ShutdownError(\"allreduce 'g': rank 1 exited or lost its connection\")")
    assert _rankwrap.main(["-c", code]) == 1
    record = json.loads((tmp_path / "rank-0.json").read_text())
    assert record["consequence"] is True and waits == [False]      # nobody else recorded
    assert _rankwrap.main(["-c", "raise KeyError('k')"]) == 1
    assert "consequence" not in json.loads((tmp_path / "rank-0.json").read_text())
    assert waits == [False]                                          # no wait for a real error
    capsys.readouterr()
    (tmp_path / "rank-2.json").write_text(json.dumps({"rank": 2, "code": 1, "time": 1.0,
                                                      "consequence": True}))
    assert real_wait(0.3) is False                                   # a consequence is no cause
    later = threading.Timer(0.2, lambda: (tmp_path / "rank-1.json").write_text(
        json.dumps({"rank": 1, "code": 3, "what": "sys.exit", "time": 2.0})))
    later.start()
    t0 = time.monotonic()
    assert real_wait(30.0) is True                                   # the cause's record
    assert time.monotonic() - t0 < 25.0
    later.join()
    assert _rankwrap.CONSEQUENCE_WAIT_S > supervise.FAILURE_GRACE_S
