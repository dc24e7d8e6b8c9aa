"""torchrun across two simulated hosts (network namespaces, 1 Gbit tbf-shaped links) with no
MPI: ``torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d`` started in each host's
namespace, its own host name in each (nodes come from host names). Every algorithm and the
fp16/bf16/topk exchanges cross the shaped links (workers_launch/algorithms.py)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.netns.simhosts import SimHosts, unavailable_reason

REPO = Path(__file__).resolve().parents[2]
WORKERS = REPO / "tests" / "parallel" / "workers_launch"
pytestmark = [pytest.mark.netns, pytest.mark.timeout(400)]


def test_torchrun_two_hosts_c10d_rendezvous(tmp_path):
    pytest.importorskip("torch")
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"simulated hosts unavailable: {reason}")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "PMI_", "SLURM_"))}
    env.update({"PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "NUMBA_NUM_THREADS": "1",
                "PYTHONWARNINGS": "ignore::FutureWarning,ignore::UserWarning"})
    with SimHosts(2, "1gbit", tag=f"lcctr{os.getpid()}") as sim:
        # torchrun resolves host names: each namespace sees a hosts file naming both hosts
        hosts = tmp_path / "hosts"
        hosts.write_text("127.0.0.1 localhost\n" +
                         "".join(f"{a} {h}\n" for a, h in zip(sim.addrs, sim.hosts)))
        procs = []
        for i, ns in enumerate(sim.hosts):
            cmd = ["ip", "netns", "exec", ns, "unshare", "--uts", "--mount", "/bin/sh", "-c",
                   f'hostname {ns}; mount --bind {hosts} /etc/hosts; exec "$@"', "sh",
                   sys.executable, "-m",
                   "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{sim.addrs[0]}:29477",
                   "--rdzv-id", "lcc-netns", "--local-addr", sim.addrs[i],
                   str(WORKERS / "no_mpi.py"), str(WORKERS / "algorithms.py")]
            procs.append(subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True,
                                          start_new_session=True))
        outs = []
        try:
            for p in procs:
                outs.append(p.communicate(timeout=360)[0])
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, 9)
                    p.communicate()
    out = "\n".join(outs)
    assert all(p.returncode == 0 for p in procs), out[-6000:]
    assert out.count("algorithms ok (nodes 2)") == 4, out[-6000:]
    assert out.count("no-mpi ok") == 4, out[-6000:]
