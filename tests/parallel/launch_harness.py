"""Start ranks the torchrun way from pytest: under ``torchrun`` itself, or as plain processes
with torchrun's or Slurm's variables set by hand (what srun, Ray and Kubeflow do), each run
under a timeout. No MPI anywhere."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
WORKERS = Path(__file__).parent / "workers_launch"
NO_MPI = str(WORKERS / "no_mpi.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "PMI_", "PRTE_", "SLURM_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                         "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    env.update({"NUMBA_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                "PYTHONWARNINGS": "ignore::FutureWarning,ignore::UserWarning"})
    env.update(extra or {})
    return env


def torchrun(nproc: int, args: list[str], env: dict[str, str] | None = None,
             timeout: float = 180.0, extra: list[str] | None = None) -> tuple[int, str]:
    """``torchrun --standalone --nproc-per-node N`` of ``args`` (a script and its arguments):
    (exit code, merged output)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           *(extra or ["--standalone"]), *args]
    return _run([cmd], [base_env(env)], timeout)


def plain(args: list[str], env: dict[str, str] | None = None,
          timeout: float = 180.0) -> tuple[int, str]:
    """One ``python`` process with no launcher's variables (it starts its ranks itself)."""
    return _run([[sys.executable, *args]], [base_env(env)], timeout)


def by_hand(size: int, args: list[str], kind: str = "torch", env: dict[str, str] | None = None,
            timeout: float = 180.0, ranks: list[int] | None = None,
            per_rank: dict[int, dict[str, str]] | None = None) -> tuple[list[int], str]:
    """``size`` processes started with torchrun's (``kind="torch"``) or Slurm's (``"slurm"``)
    variables set by hand; ``ranks``: the rank each process claims (default 0..size-1).
    Returns every process's exit code and the merged output."""
    port = str(free_port())
    ranks = list(range(size)) if ranks is None else ranks
    envs = []
    for i, r in enumerate(ranks):
        if kind == "torch":
            v = {"RANK": str(r), "WORLD_SIZE": str(size), "LOCAL_RANK": str(r),
                 "LOCAL_WORLD_SIZE": str(size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        else:
            v = {"SLURM_PROCID": str(r), "SLURM_NTASKS": str(size), "SLURM_LOCALID": str(r),
                 "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "localhost", "MASTER_PORT": port}
        v.update(env or {})
        v.update((per_rank or {}).get(i, {}))
        envs.append(base_env(v))
    cmds = [[sys.executable, *args] for _ in ranks]
    return _run(cmds, envs, timeout, each=True)


def _run(cmds, envs, timeout, each=False):
    procs = [subprocess.Popen(c, env=e, cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
             for c, e in zip(cmds, envs)]
    deadline = time.monotonic() + timeout
    outs, codes = [], []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                try:
                    os.killpg(q.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            every = [_readable(q.communicate()[0] or "") for q in procs]
            raise AssertionError(f"timed out after {timeout:.0f} s:\n" +
                                 "\n".join(f"--- process {i}:\n{o[-3000:]}"
                                           for i, o in enumerate(every)))
        outs.append(out)
        codes.append(p.returncode)
    text = "\n".join(_readable(o) for o in outs)
    return (codes, text) if each else (codes[0], text)


def _readable(out: str) -> str:
    """The output without the C++ stack frames torch's store prints on a lost connection."""
    return "\n".join(line for line in out.splitlines()
                     if not line.startswith(("frame #", "Exception raised from")))
