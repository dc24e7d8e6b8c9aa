"""Run torch's own distributed test suite (``distributed_test.py``) on a backend under mpirun.

torch's runner (``test/distributed/test_distributed_spawn.py``) starts its ranks with
``multiprocessing``; the lightcc backend needs MPI ranks. This tool runs the same test methods
(``DistributedTest._DistTestBase`` from the installed wheel's ``torch.testing._internal``) on
every rank of an ``mpirun`` job, one test after another, each in a fresh default process
group, and sums up::

    python tools/torch_suite.py                           # lightcc, 2 ranks, every test
    python tools/torch_suite.py --compare gloo            # and gloo: what passes on one only
    python tools/torch_suite.py -k 'test_all_gather_coalesced*'

A test that kills or hangs the job (``--test-timeout`` s, default 150) is recorded as a
failure and the job restarts after it. Needs ``expecttest`` (``pip install expecttest``), which
torch's testing package imports. Tests that name a backend in their own code (``if BACKEND ==
"gloo"``) run only their generic part on lightcc, and some then fail in the test's own code;
the ``--compare`` listing shows them.
"""
from __future__ import annotations

import argparse
import fnmatch
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _worker(start: int, results: str, patterns: list[str], test_timeout: int) -> None:
    """One rank: run the selected tests from index ``start``; rank 0 appends to ``results``."""
    import signal
    import unittest
    from datetime import timedelta

    import lightcc.torch  # noqa: F401 - registers the backend and the MPI rendezvous
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    tmp = comm.bcast(tempfile.mkdtemp() if rank == 0 else None, root=0)
    if rank == 0:
        for d in ("barrier", "test_dir", "init_dir"):
            os.mkdir(os.path.join(tmp, d))
    os.environ.update(WORLD_SIZE=str(size), TEMP_DIR=tmp, INIT_METHOD="env://")
    comm.Barrier()
    import torch.distributed as dist
    from torch.testing._internal.common_distributed import TEST_SKIPS
    from torch.testing._internal.common_utils import TestCase
    from torch.testing._internal.distributed.distributed_test import Barrier, DistributedTest

    skip_codes = {v.exit_code: k for k, v in TEST_SKIPS.items()}

    class Suite(DistributedTest._DistTestBase, TestCase):
        world_size = str(size)
        file_name = os.path.join(tmp, "init_dir", "f")
        init_method = "env://"
        destroy_pg_upon_exit = False

    Suite.rank = rank

    def alarm(*_):
        raise TimeoutError(f"the test ran longer than {test_timeout} s")

    signal.signal(signal.SIGALRM, alarm)
    names = sorted(n for n in dir(Suite) if n.startswith("test_")
                   and any(fnmatch.fnmatch(n, p) for p in patterns))
    for idx, name in enumerate(names[start:], start):
        if rank == 0:
            Barrier.init()
            with open(results, "a") as f:
                f.write(f"START {idx} {name}\n")
        comm.Barrier()
        Barrier.barrier_id = 0
        dist.init_process_group(os.environ["BACKEND"], timeout=timedelta(seconds=60))
        outcome, why = "PASS", ""
        signal.alarm(test_timeout)
        try:
            getattr(Suite(name), name)()
        except unittest.SkipTest as exc:
            outcome, why = "SKIP", str(exc).splitlines()[0][:80] if str(exc) else ""
        except SystemExit as exc:
            outcome, why = ("SKIP", skip_codes[exc.code]) if exc.code in skip_codes else \
                ("FAIL", f"exit {exc.code}")
        except BaseException as exc:  # noqa: BLE001 - a failing test is a result
            outcome, why = "FAIL", f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}" \
                if str(exc) else type(exc).__name__
        signal.alarm(0)
        outcomes = comm.allgather((outcome, why))
        worst = next((o for o in outcomes if o[0] == "FAIL"), None) or \
            next((o for o in outcomes if o[0] == "SKIP"), outcomes[0])
        if rank == 0:
            with open(results, "a") as f:
                f.write(f"{worst[0]} {idx} {name} {worst[1]}\n")
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - the next test starts a fresh group anyway
            pass
        comm.Barrier()
    if rank == 0:
        with open(results, "a") as f:
            f.write("DONE\n")


def run_suite(backend: str, np_: int, patterns: list[str], test_timeout: int) -> dict:
    """{name: (outcome, why)} for one backend, restarting the job after a test that kills it."""
    from tests.mpi_harness import mpi_env, mpirun_base

    results = tempfile.mktemp(prefix=f"torch_suite_{backend}_")
    open(results, "w").close()
    start = 0
    while True:
        cmd = mpirun_base(np_) + ["-x", "BACKEND", sys.executable, __file__, "--test-timeout",
                                  str(test_timeout), "--worker", str(start), results,
                                  *patterns]
        env = mpi_env({"BACKEND": backend, "PYTHONWARNINGS": "ignore"})
        try:
            subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           timeout=max(600, 4 * test_timeout), start_new_session=True)
        except subprocess.TimeoutExpired:
            pass
        lines = open(results).read().splitlines()
        if lines and lines[-1] == "DONE":
            break
        started = [ln.split() for ln in lines if ln.startswith("START ")]
        if not started:
            raise SystemExit(f"the {backend} job did not start a test (try one test with -k)")
        idx, name = int(started[-1][1]), started[-1][2]
        if not any(ln.split()[1:3] == [str(idx), name] for ln in lines
                   if not ln.startswith("START ")):
            with open(results, "a") as f:
                f.write(f"FAIL {idx} {name} killed or hung the job\n")
        start = idx + 1
    out = {}
    for ln in open(results).read().splitlines():
        parts = ln.split(" ", 3)
        if parts[0] in ("PASS", "SKIP", "FAIL"):
            out[parts[2]] = (parts[0], parts[3] if len(parts) > 3 else "")
    os.unlink(results)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="lightcc")
    parser.add_argument("--compare", default=None, help="a second backend, e.g. gloo")
    parser.add_argument("-np", "--np", dest="np_", type=int, default=2)
    parser.add_argument("-k", dest="patterns", action="append", default=None,
                        help="test name pattern (fnmatch), repeatable; default: every test")
    parser.add_argument("--test-timeout", type=int, default=150)
    parser.add_argument("--worker", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        _worker(int(args.worker[0]), args.worker[1], args.worker[2:] or ["test_*"],
                args.test_timeout)
        return 0
    patterns = args.patterns or ["test_*"]
    backends = [args.backend] + ([args.compare] if args.compare else [])
    found = {}
    for b in backends:
        t0 = time.time()
        found[b] = run_suite(b, args.np_, patterns, args.test_timeout)
        counts = {o: sum(1 for v in found[b].values() if v[0] == o)
                  for o in ("PASS", "SKIP", "FAIL")}
        print(f"{b}: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} "
              f"skipped ({time.time() - t0:.0f} s, {args.np_} ranks)")
        for name, (o, why) in sorted(found[b].items()):
            if o == "FAIL":
                print(f"  FAIL {name}: {why}")
    if args.compare:
        for x, y in ((args.backend, args.compare), (args.compare, args.backend)):
            only = sorted(n for n in found[x] if found[x][n][0] == "PASS"
                          and found[y].get(n, ("",))[0] != "PASS")
            print(f"pass on {x}, not on {y}: {len(only)}")
            for n in only:
                print(f"  {n}: {found[y].get(n, ('?', ''))[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
