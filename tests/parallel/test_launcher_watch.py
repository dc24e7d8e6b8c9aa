"""Real ``lccrun`` runs of what a user watches at start-up and of horovodrun's output flags.

A host that never comes up is played by a launch agent (Open MPI's ``plm_ssh_agent``, which
lccrun also uses to probe hosts) that hangs for one host name and runs the command here for
the others; the same job on simulated hosts (network namespaces) is
tests/netns/test_netns_startup.py.
"""
from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from tests.parallel.test_launcher import finish, psutil, start_lccrun

AGENT = """#!/bin/sh
while [ $# -gt 0 ]; do case "$1" in -x|-T|-n|-a|-q) shift ;; -o|-p|-l|-i) shift 2 ;;
*) break ;; esac; done
host="$1"; shift
if [ "$host" = "deadhost" ]; then exec sleep {marker}; fi
exec /bin/sh -c "$*"
"""


def _agent(tmp_path: Path) -> tuple[str, str]:
    marker = str(3000 + uuid.uuid4().int % 1000)   # how long the hung agent sleeps: its mark
    path = tmp_path / "agent.sh"
    path.write_text(AGENT.format(marker=marker))
    path.chmod(0o755)
    return str(path), marker


def _sleepers(marker: str) -> list:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        if (p.info["cmdline"] or [])[-2:] == ["sleep", marker]:
            found.append(p)
    return found


def test_a_host_that_never_comes_up_ends_the_job_at_start_timeout(tmp_path):
    agent, marker = _agent(tmp_path)
    proc = start_lccrun(["-H", "localhost:1,deadhost:1", "--start-timeout", "8",
                         "--mpi-args", f"--prtemca plm_ssh_agent {agent}",
                         "python", "-c", "print('a rank started')"])
    rc, out, err = finish(proc, timeout=60)
    lines = [ln for ln in err.splitlines() if ln.startswith("lccrun:")]
    assert rc == 124, err
    assert "a rank started" not in out
    assert lines[-1].startswith("lccrun: error: --start-timeout 8 s expired: 0/2 ranks up"), err
    assert "waiting for localhost (rank 0), deadhost (rank 1); deadhost does not answer the " \
           "launch agent (ssh)" in lines[-1], err
    assert any(ln.startswith("lccrun: 0/2 ranks up after 5 s; waiting for") for ln in lines), err
    assert not _sleepers(marker), "the hung launch agent was left running"


def test_a_fast_start_prints_no_progress_line():
    rc, out, err = finish(start_lccrun(["-np", "2", "--start-timeout", "60", "python", "-c",
                                        "print('up')"]))
    assert rc == 0, err
    assert out.count("up") == 2
    assert "ranks up" not in err


def test_output_filename_writes_one_file_per_rank(tmp_path):
    logs = tmp_path / "logs"
    rc, out, err = finish(start_lccrun(
        ["-np", "2", "--output-filename", str(logs), "--prefix-output-with-timestamp",
         "python", "-c", "import os; print('hello from', os.environ['RANK'])"]))
    assert rc == 0, err
    files = sorted(logs.rglob("stdout"))
    assert [f.parent.name for f in files] == ["rank.0", "rank.1"], files
    for rank, f in enumerate(files):
        text = f.read_text()
        assert f"hello from {rank}" in text, text
        assert text.startswith("["), text      # the timestamp prefix


@pytest.mark.parametrize("flag", ["--hierarchical-allreduce", "--no-stall-check"])
def test_horovod_flags_reach_the_ranks(flag):
    code = ("import os; print('ALG', os.environ.get('LCC_ALGORITHM'), 'STALL', "
            "os.environ.get('LCC_STALL_SHUTDOWN_TIME'))")
    rc, out, err = finish(start_lccrun(["-np", "1", flag, "python", "-c", code]))
    assert rc == 0, err
    want = "ALG hierarchical STALL None" if flag == "--hierarchical-allreduce" \
        else "ALG None STALL 0"
    assert want in out, out


TIMELINE_JOB = """
import numpy as np, lightcc as lcc
lcc.init()
for step in range(3):
    hs = [lcc.allreduce_async(np.ones(1000 * (i + 1), np.float32), name=f"t{i}")
          for i in range(3)]
    for h in hs:
        lcc.synchronize(h)
lcc.shutdown()
"""


def test_timeline_filename_gives_one_file_for_the_job_and_a_table(tmp_path):
    import json

    path = tmp_path / "job.json"
    rc, out, err = finish(start_lccrun(["-np", "2", "--timeline-filename", str(path),
                                        "python", "-c", TIMELINE_JOB]))
    assert rc == 0, err
    events = json.loads(path.read_text())
    assert sorted({e["pid"] for e in events}) == [0, 1]
    names = {e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert names == {"rank 0", "rank 1"}
    assert not list(tmp_path.glob("job.json.rank*"))      # merged, parts removed
    lines = [ln for ln in err.splitlines() if ln.startswith("lccrun: ")]
    assert any("2 rank files merged" in ln for ln in lines), err
    rows = [ln.split()[1:] for ln in lines if ln.split()[1:2] in (["0"], ["1"])]
    assert [r[0] for r in rows] == ["0", "1"] and all(r[1] == "9" for r in rows), err


STATUS_JOB = """
import time, torch, lightcc.torch as hvd
hvd.init()
torch.manual_seed(0)
m = torch.nn.Linear(128, 128)
opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.01),
                               named_parameters=m.named_parameters())
x = torch.randn(32, 128)
for step in range(150):
    opt.zero_grad()
    m(x).pow(2).mean().backward()
    opt.step()
    time.sleep(0.02)
hvd.shutdown()
"""


def test_status_line_shows_steps_wire_and_the_ranks():
    rc, out, err = finish(start_lccrun(["-np", "2", "--status", "1", "python", "-c",
                                        STATUS_JOB]), timeout=120)
    assert rc == 0, err
    lines = [ln for ln in err.splitlines() if ln.startswith("lccrun: status: ")]
    assert lines, err                                        # not a terminal: appended
    with_steps = [ln for ln in lines if "- steps/s" not in ln]
    assert with_steps, lines
    last = with_steps[-1]
    rate = float(last.split("lccrun: status: ")[1].split(" steps/s")[0])
    assert 0 < rate < 50, last                               # a sleep of 20 ms per step
    assert "wire " in last and "exposed comm " in last and "%" in last, last
    assert "ranks in step" in last or "behind" in last, last


STEPS_JOB = """
import torch, lightcc.torch as hvd
hvd.init()
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.01),
                               named_parameters=m.named_parameters())
hvd.broadcast_parameters(m.state_dict(), root_rank=0)
x = torch.randn(32, 256)
for step in range(6):
    opt.zero_grad()
    m(x).pow(2).mean().backward()
    opt.step()
hvd.shutdown()
"""
WIRE = {"ALLREDUCE", "COMPRESSED_ALLREDUCE", "ALLGATHER", "BROADCAST", "ALLTOALL",
        "REDUCESCATTER", "DIRECT_ALLREDUCE"}


def _covered_ms(spans, lo, hi):
    """Wall time (ms) inside [lo, hi] covered by any of ``spans`` (µs): a sweep over the
    endpoints counting open spans (written apart from timeline_merge's sort-and-extend)."""
    points = []
    for a, b in spans:
        a, b = max(a, lo), min(b, hi)
        if b > a:
            points += [(a, 1), (b, -1)]
    covered, depth, last = 0.0, 0, None
    for t, d in sorted(points):
        if depth:
            covered += t - last
        depth, last = depth + d, t
    return covered / 1000.0


def _expected_steps(events):
    """Per step and rank, straight from the event file."""
    tracks = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
              if e.get("name") == "thread_name"}
    spans = [e for e in events if e.get("ph") == "X"]
    marks = {}
    for e in spans:
        if tracks[(e["pid"], e["tid"])] == "step":
            marks.setdefault(e["args"]["step"], {}).setdefault(e["pid"], {})[e["name"]] = e
    want = {}
    for step, ranks in marks.items():
        if any("STEP" not in m for m in ranks.values()) or len(ranks) != 2:
            continue
        per = {}
        for rank, m in ranks.items():
            lo = m["STEP"]["ts"]
            hi = lo + m["STEP"]["dur"]
            sync = m["SYNCHRONIZE"]["ts"]
            mine = [e for e in spans if e["pid"] == rank]
            neg = [(e["ts"], e["ts"] + e["dur"]) for e in mine if e["name"] == "NEGOTIATE"]
            wire = [(e["ts"], e["ts"] + e["dur"]) for e in mine if e["name"] in WIRE
                    and not tracks[(rank, e["tid"])].startswith("link:")]
            first = min(e["ts"] for e in mine if e["name"] == "QUEUE" and lo < e["ts"] <= sync)
            per[rank] = {"step": (hi - lo) / 1000, "to_grad": (first - lo) / 1000,
                         "backward": (sync - first) / 1000, "neg": _covered_ms(neg, lo, hi),
                         "wire": _covered_ms(wire, lo, hi), "exposed": (hi - sync) / 1000,
                         "overlapped": _covered_ms(wire, first, sync)}
        negs = sorted((per[r]["neg"], r) for r in per)
        total = sum(p["wire"] for p in per.values())
        want[step] = {
            **{k: max(p[k] for p in per.values())
               for k in ("step", "to_grad", "backward", "wire", "exposed")},
            "neg_min": negs[0], "neg_max": negs[-1],
            "overlap": None if total == 0 else
            100 * sum(p["overlapped"] for p in per.values()) / total}
    return want


def test_timeline_filename_prints_a_row_per_training_step(tmp_path):
    import json
    import re

    pytest.importorskip("torch")
    path = tmp_path / "steps.json"
    rc, out, err = finish(start_lccrun(["-np", "2", "--timeline-filename", str(path),
                                        "python", "-c", STEPS_JOB]), timeout=240)
    assert rc == 0, err
    want = _expected_steps(json.loads(path.read_text()))
    assert sorted(want) == [2, 3, 4, 5, 6], want       # the first step has no start mark
    lines = [ln[len("lccrun: "):] for ln in err.splitlines() if ln.startswith("lccrun: ")]
    head = next(i for i, ln in enumerate(lines) if ln.startswith("step  step ms"))
    row = re.compile(r"\s*(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+) \(rank (\d)\) / "
                     r"([\d.]+) \(rank (\d)\)\s+([\d.]+)\s+([\d.]+)\s+(\d+|-)$")
    got = [row.fullmatch(ln) for ln in lines[head + 1:head + 1 + len(want)]]
    assert all(got), lines[head:]
    assert [int(g[1]) for g in got] == sorted(want), lines[head:]
    for g in got:
        w = want[int(g[1])]
        for col, key in zip((2, 3, 4, 9, 10), ("step", "to_grad", "backward", "wire", "exposed")):
            assert abs(float(g[col]) - w[key]) <= 0.051, (key, g[0], w)
        assert abs(float(g[5]) - w["neg_min"][0]) <= 0.051, (g[0], w)
        assert abs(float(g[7]) - w["neg_max"][0]) <= 0.051, (g[0], w)
        if w["neg_min"][0] != w["neg_max"][0]:
            assert (int(g[6]), int(g[8])) == (w["neg_min"][1], w["neg_max"][1]), (g[0], w)
        assert (g[11] == "-") if w["overlap"] is None else \
            abs(int(g[11]) - w["overlap"]) <= 0.5 + 1e-9, (g[0], w)
