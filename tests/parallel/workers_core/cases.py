"""Run several worker scripts one after another in one mpirun job (saves a launch each).

Every worker of this folder is a script that calls ``lcc.init()`` ... ``lcc.shutdown()`` and
reads its settings from ``LCC_*`` variables at ``init()``; this runner runs each case's script
in this process with the case's variables and arguments, then restores them, so one job does
what one launch per script did. ``LCC_TEST_CASES`` names a JSON file: a list of
``{"id", "script" | "code", "args", "env"}``. A case's output (stdout and stderr, the file
descriptors themselves, so logging and C-level output too) goes to ``<file's folder>/<id>.
rank<R>.out``, and ``<id>.rank<R>.rc`` holds its exit status once it ended. A case that fails
on a rank aborts the job (``MPI_Abort``): its peers may wait in a collective it never reached,
and the cases after it never run, which their tests report.
"""
from __future__ import annotations

import json
import os
import runpy
import sys
import traceback
from pathlib import Path

import lightcc  # noqa: F401 - first, as in the workers: its MCA defaults precede MPI_Init
from mpi4py import MPI  # noqa: E402

HERE = Path(__file__).resolve().parent


def run_case(case: dict) -> int:
    """The case's script (or code) under its variables and argv; its exit status."""
    script = case.get("script")
    saved_env, saved_argv, saved_path = dict(os.environ), sys.argv[:], sys.path[:]
    os.environ.update(case.get("env", {}))
    try:
        if script is not None:
            path = str(HERE / script) if not os.path.isabs(script) else script
            sys.argv = [path, *case.get("args", [])]
            sys.path.insert(0, str(Path(path).parent))
            runpy.run_path(path, run_name="__main__")
        else:
            sys.argv = ["-c", *case.get("args", [])]
            exec(compile(case["code"], "<case>", "exec"), {"__name__": "__main__"})  # noqa: S102
        lightcc.shutdown()          # what the exit hook would do: the next case starts anew
        return 0
    except SystemExit as exc:
        if exc.code is None or exc.code == 0:
            lightcc.shutdown()
            return 0
        if not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
        return exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - reported, then the job is aborted
        traceback.print_exc()
        return 1
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        sys.argv, sys.path[:] = saved_argv, saved_path


def main() -> None:
    listing = Path(os.environ["LCC_TEST_CASES"])
    cases = json.loads(listing.read_text())
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    for case in cases:
        base = listing.parent / f"{case['id']}.rank{rank}"
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        fd = os.open(f"{base}.out", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        try:
            rc = run_case(case)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for f in (fd, *saved):
                os.close(f)
        Path(f"{base}.rc").write_text(str(rc))
        print(f"rank {rank}: case {case['id']} exit {rc}", flush=True)
        if rc != 0:
            world.Abort(1)
        world.Barrier()                 # the next case starts when every rank ended this one


main()
