"""``init()`` gives Open MPI ``btl_tcp_links = LCC_NUM_LINKS`` and the sleeping idle wait of
``LCC_MPI_IDLE_SLEEP_US`` when it starts MPI itself.

Each case runs in a fresh interpreter (a singleton MPI job): whether MPI was already started
is process state."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import os, sys
if sys.argv[1] == "mpi-first":
    from mpi4py import MPI
import lightcc.common.api as api
api.init()
print("LINKS", os.environ.get("OMPI_MCA_btl_tcp_links", "unset"))
print("IDLE", *(os.environ.get("OMPI_MCA_" + v, "unset") for v in (
    "mpi_yield_when_idle", "threads_pthreads_yield_strategy", "threads_pthreads_nanosleep_time")))
api.shutdown()
"""


def _run(mode: str, what: str, **env: str) -> list[str]:
    full = {k: v for k, v in os.environ.items()
            if not k.startswith("OMPI_MCA_") and k not in ("LCC_NUM_LINKS",
                                                           "LCC_MPI_IDLE_SLEEP_US")}
    full.update(env)
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True,
                         timeout=120, cwd=REPO, env=full)
    assert out.returncode == 0, out.stdout + out.stderr
    return [line for line in out.stdout.splitlines() if line.startswith(what)][-1].split()[1:]


def _links(mode: str, **env: str) -> str:
    return _run(mode, "LINKS", **env)[0]


@pytest.mark.parametrize("env,want", [({}, "2"), ({"LCC_NUM_LINKS": "3"}, "3"),
                                      ({"OMPI_MCA_btl_tcp_links": "5"}, "5"),
                                      ({"LCC_NUM_LINKS": "3", "OMPI_MCA_btl_tcp_links": "1"}, "1")])
def test_init_sets_tcp_links_unless_given(env, want):
    assert _links("lightcc-first", **env) == want


def test_mpi_started_before_init_is_left_alone():
    assert _links("mpi-first") == "unset"


@pytest.mark.parametrize("env,want", [
    ({}, ["unset", "unset", "unset"]),            # auto, one host (a singleton)
    ({"LCC_MPI_IDLE_SLEEP_US": "20"}, ["1", "nanosleep", "20000"]),
    ({"LCC_MPI_IDLE_SLEEP_US": "7"}, ["1", "nanosleep", "7000"]),
    ({"LCC_MPI_IDLE_SLEEP_US": "0"}, ["unset", "unset", "unset"]),
    ({"LCC_MPI_IDLE_SLEEP_US": "20", "OMPI_MCA_threads_pthreads_yield_strategy": "sched_yield"},
     ["1", "sched_yield", "20000"])])
def test_init_sets_sleeping_idle_wait_unless_given(env, want):
    """Open MPI's progress loop sleeps (nanosleep) instead of spinning when idle; a user's own
    OMPI_MCA_* value wins, 0 leaves Open MPI's default."""
    assert _run("lightcc-first", "IDLE", **env) == want


def test_idle_wait_not_set_after_mpi_started():
    assert _run("mpi-first", "IDLE", LCC_MPI_IDLE_SLEEP_US="20") == ["unset", "unset", "unset"]


@pytest.mark.parametrize("value,env,want", [
    ("auto", {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, 20),
    ("auto", {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}, 0),
    ("auto", {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, 0),
    ("auto", {"OMPI_COMM_WORLD_SIZE": "4"}, 0),
    ("auto", {}, 0),
    (5, {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, 5),
    (0, {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, 0)])
def test_auto_idle_sleep_only_across_hosts(value, env, want):
    """auto sleeps only on a job of several hosts with several ranks on this one."""
    from lightcc.common.mca import idle_sleep

    assert idle_sleep(value, env) == want


def test_bad_idle_sleep_is_an_error():
    from lightcc.common import config

    with pytest.raises(config.ConfigError, match="mpi_idle_sleep_us.*auto or >= 0"):
        config.load({"mpi_idle_sleep_us": -1})
