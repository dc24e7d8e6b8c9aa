"""lccrun's start-up watch on 3 simulated hosts (network namespaces, tests/netns/simhosts.py).

lccrun runs in host 0's namespace and reaches the others through the namespace launch agent
(``plm_ssh_agent``). With every host up, the remote ranks report to lccrun's registry over the
simulated network: the job outlives ``--start-timeout`` and ends normally. When the agent of
host 2 never returns (a host that never comes up), the job ends after ``--start-timeout``
with a line naming that host and its rank, and nothing is left running. Skips where
namespaces are unavailable (not Linux, not root, no iproute2).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.netns.simhosts import AGENT, IFACE, SimHosts, unavailable_reason

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.netns, pytest.mark.timeout(240)]

HANGING = """#!/bin/sh
for word in "$@"; do
    if [ "$word" = "{dead}" ]; then exec sleep {marker}; fi
    case "$word" in -*) ;; *) break ;; esac
done
exec {agent} "$@"
"""


def _lccrun(sim: SimHosts, agent: str, args: list[str], timeout: float = 150):
    env = dict(os.environ)
    env.update(sim.env())
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    for name in [n for n in env if n.startswith("LCC_") and n != "LCC_NETNS_HOSTS"]:
        del env[name]
    hosts = ",".join(f"{a}:1" for a in sim.addrs)
    cmd = ["ip", "netns", "exec", sim.hosts[0], "unshare", "--uts", "/bin/sh", "-c",
           f'hostname {sim.hosts[0]}; exec "$@"', "sh", sys.executable, "-m", "lightcc.runner",
           "-H", hosts, "--network-interface", IFACE,
           "--mpi-args", f"--prtemca plm_ssh_agent {agent} --mca pml ob1 --mca btl tcp,self",
           *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout,
                          cwd=str(REPO), start_new_session=True)


def _sim(tag: str) -> SimHosts:
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"simulated hosts unavailable: {reason}")
    return SimHosts(3, None, tag=f"{tag}{os.getpid()}")


def test_remote_ranks_report_to_lccrun_over_the_simulated_network():
    with _sim("lcsu") as sim:
        res = _lccrun(sim, str(AGENT), ["--start-timeout", "20", "python", "-c",
                                        "import time, os; time.sleep(25); "
                                        "print('done', os.environ['RANK'])"])
        assert res.returncode == 0, res.stderr[-3000:]
        assert sorted(re.findall(r"done \d", res.stdout)) == ["done 0", "done 1", "done 2"], \
            res.stdout                       # (multi-host output is tagged [1,N]<stdout>:)


def test_a_simulated_host_that_never_comes_up_is_named_at_start_timeout(tmp_path):
    with _sim("lcsd") as sim:
        marker = str(4000 + os.getpid() % 1000)
        agent = tmp_path / "hang.sh"
        agent.write_text(HANGING.format(dead=sim.addrs[2], marker=marker, agent=AGENT))
        agent.chmod(0o755)
        res = _lccrun(sim, str(agent), ["--start-timeout", "10", "python", "-c", "print(1)"])
        last = res.stderr.strip().splitlines()[-1]
        assert res.returncode == 124, res.stderr[-3000:]
        assert last.startswith("lccrun: error: --start-timeout 10 s expired: 0/3 ranks up"), last
        assert f"{sim.addrs[2]} (rank 2); {sim.addrs[2]} does not answer the launch agent" \
            in last, last
        left = subprocess.run(["pgrep", "-f", f"sleep {marker}"], capture_output=True,
                              text=True).stdout.split()
        assert not left, f"the hung agent is still running: {left}"
