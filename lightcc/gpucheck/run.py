"""``python -m lightcc.gpucheck``: everything that needs a GPU, in one run, into one report.

Steps (each a subprocess with its own time limit, inside one overall budget that fits a
10-minute slot on one GPU; a step that no longer fits is reported as not run):

1. ``tests/gpu`` (pytest ``-m gpu``): the kernels' numerics against the CPU codecs, the NCCL
   communicator, the engine's device path and the torch layer on CUDA tensors;
2. the engine on one rank over NCCL (``engine_check``): every algorithm x compressor, the
   other collectives, the torch layer, and ``LCC_CPU_REDUCE``;
3. ``benchmarks/gpu.py``: kernel rates against torch and allreduce against raw NCCL;
4. ``examples/mnist.py --cuda`` for one epoch;
5. the engine and MNIST on two ranks sharing the GPU (``LCC_BACKEND=mpi``: NCCL refuses two
   ranks on one GPU), so the compressors and DistributedOptimizer really exchange data.

Writes ``report.md``, ``report.json`` and ``logs/`` under ``--out`` (default
``./gpucheck-report``); ``--tar PATH`` also packs that folder into one ``.tar.gz`` (for machines
that hand back only a few files). Without CuPy or a GPU it says so and exits with status 2 at
once. Exit status 0 when every step ran and passed, else 1 (a step that did not run makes the
verdict "incomplete"). Needs a source checkout (tests/, examples/, benchmarks/ next to the
package) and runs from it as it is, with whatever torch, CuPy and MPI the machine has: nothing
is installed. One-rank steps start under ``mpirun -np 1`` when there is one (a singleton MPI
start forks a daemon under Open MPI 4.1); the two-rank steps need ``mpirun`` and are reported
as failed, with the reason, when it is missing.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from . import report

ROOT = Path(__file__).resolve().parents[2]
BUDGET_S = 570.0          # the whole run; leaves room in a 10-minute slot
MIN_STEP_S = 30.0         # a step with less time than this left is not started
clock = time.monotonic   # the budget's clock (seconds)


def probe() -> dict[str, Any]:
    """What this machine has: GPU, CuPy, NCCL, torch, MPI (``gpu`` False + ``why`` if none)."""
    env: dict[str, Any] = {"python": sys.version.split()[0], "gpu": False}
    try:
        import cupy
    except Exception as exc:  # noqa: BLE001 - any import failure means no GPU path
        env["why"] = f"CuPy does not import ({exc}); pip install cupy-cuda13x"
        return env
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - no driver, insufficient driver
        env["why"] = f"CuPy sees no CUDA driver or device ({exc})"
        return env
    if count < 1:
        env["why"] = "CuPy sees no CUDA device"
        return env
    name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
    env.update(gpu=True, gpus=count, device=name.decode() if isinstance(name, bytes) else name,
               cupy=cupy.__version__, cuda_runtime=cupy.cuda.runtime.runtimeGetVersion())
    try:
        from cupy.cuda import nccl

        env["nccl"] = nccl.get_version()
    except Exception as exc:  # noqa: BLE001
        env["nccl"] = f"unavailable ({exc})"
    try:
        import torch

        env["torch"] = torch.__version__
        env["torch_cuda"] = torch.cuda.is_available()
    except ImportError:
        env["torch"] = "not installed"
    env["mpirun"] = find_mpirun() or "not found"
    env["summary"] = (f"{env['gpus']} x {env['device']}, CuPy {env['cupy']}, NCCL "
                      f"{env['nccl']}, torch {env.get('torch')}, mpirun {env['mpirun']}")
    return env


def find_mpirun() -> str | None:
    here = Path(sys.executable).parent / "mpirun"
    return str(here) if here.exists() else shutil.which("mpirun")


def mpi_command(np_: int, args: list[str]) -> list[str]:
    """``mpirun -np N ... args``; for one rank without mpirun, ``args`` alone (singleton)."""
    launcher = find_mpirun()
    if launcher is None and np_ == 1:
        return args
    cmd = [launcher or "mpirun", "-np", str(np_), "--oversubscribe", "--bind-to", "none"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.insert(1, "--allow-run-as-root")
    return cmd + args


@dataclass
class Step:
    """One check: a command, its limit (seconds), what it writes, how to read it."""

    name: str
    title: str
    cmd: list[str]
    timeout: float
    parse: Callable[[Path], tuple[str, Any]]
    env: dict[str, str] = field(default_factory=dict)
    needs: tuple[str, ...] = ()              # files under ROOT the step runs


def junit_result(path: Path) -> tuple[str, Any]:
    files: dict[str, dict[str, Any]] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        f = files.setdefault(case.get("classname", "?").split(".")[-1],
                             {"passed": 0, "failed": 0, "skipped": 0, "failures": []})
        if case.find("failure") is not None or case.find("error") is not None:
            f["failed"] += 1
            f["failures"].append(case.get("name"))
        elif case.find("skipped") is not None:
            f["skipped"] += 1
        else:
            f["passed"] += 1
    detail = "; ".join(f"{name}: {v['passed']} passed, {v['failed']} failed, {v['skipped']} "
                       f"skipped" for name, v in files.items())
    return detail, {"files": files}


def engine_result(path: Path) -> tuple[str, Any]:
    data = json.loads(path.read_text(encoding="utf-8"))
    ok = len(data["cases"]) - data["failed"]
    backends = sorted({c["note"] for c in data["cases"] if c["note"].startswith("backend")})
    return f"{ok}/{len(data['cases'])} cases ok ({', '.join(backends)})", data


def bench_result(path: Path) -> tuple[str, Any]:
    data = json.loads(path.read_text(encoding="utf-8"))
    miss = [k["kernel"] for k in data["kernels"] if k["verdict"] == "MISS"]
    parts = [f"kernel targets missed: {', '.join(miss)}" if miss else
             f"{sum(k['verdict'] == 'ok' for k in data['kernels'])} kernel targets met"]
    big = [r for r in data["allreduce"] if r["mb"] >= 64 and r["engine_ms"] is not None]
    if big:
        parts.append("engine at >= 64 MB: " + ", ".join(
            f"{r['mb']} MB {r['engine_ms']:.2f} ms vs raw {r['raw_ms']:.2f}" for r in big))
    return "; ".join(parts), data


def _mnist(path: Path) -> tuple[str, Any]:
    data = json.loads(path.read_text(encoding="utf-8"))
    return (f"{data['ranks']} rank(s), {data['data']}, accuracy {100 * data['accuracy']:.1f} % "
            f"after {data['epochs']} epoch(s), {data['wall_s']:.1f} s"), data


def steps(out: Path, quick: bool) -> list[Step]:
    py = sys.executable
    mb = "64" if quick else "256"
    return [
        Step("gpu-tests", "GPU test suite (tests/gpu)",
             mpi_command(1, [py, "-m", "pytest", "tests/gpu", "-m", "gpu", "-q", "-p",
                      "no:cacheprovider", "-o", "addopts=",
                      f"--junitxml={out / 'gpu-tests.xml'}"]),
             240, lambda o: junit_result(o / "gpu-tests.xml"), needs=("tests/gpu",)),
        Step("engine-1rank", "engine, 1 rank, NCCL: every algorithm x compressor",
             mpi_command(1, [py, "-m", "lightcc.gpucheck.engine_check", "--cpu-reduce",
                      "--json", str(out / "engine-1rank.json")]),
             150, lambda o: engine_result(o / "engine-1rank.json"), {"LCC_BACKEND": "nccl"}),
        Step("benchmarks", "benchmarks/gpu.py",
             mpi_command(1, [py, "benchmarks/gpu.py", "--size-mb", mb, "--reps", "5",
                      "--max-allreduce-mb", mb, "--json", str(out / "benchmarks.json")]),
             150, lambda o: bench_result(o / "benchmarks.json"), needs=("benchmarks/gpu.py",)),
        Step("mnist-1rank", "examples/mnist.py --cuda, 1 epoch",
             mpi_command(1, [py, "examples/mnist.py", "--cuda", "--epochs", "1", "--json",
                      str(out / "mnist-1rank.json")]),
             100, lambda o: _mnist(o / "mnist-1rank.json"), needs=("examples/mnist.py",)),
        Step("engine-2rank", "engine, 2 ranks on 1 GPU, MPI through pinned memory",
             mpi_command(2, [py, "-m", "lightcc.gpucheck.engine_check", "--algorithms",
                      "flat,ring,hierarchical", "--json", str(out / "engine-2rank.json")]),
             150, lambda o: engine_result(o / "engine-2rank.json"), {"LCC_BACKEND": "mpi"}),
        Step("mnist-2rank", "examples/mnist.py --cuda, 2 ranks (MPI staging), 1 epoch",
             mpi_command(2, [py, "examples/mnist.py", "--cuda", "--epochs", "1", "--json",
                      str(out / "mnist-2rank.json")]),
             120, lambda o: _mnist(o / "mnist-2rank.json"), {"LCC_BACKEND": "mpi"},
             needs=("examples/mnist.py",)),
    ]


def run_step(step: Step, out: Path, limit: float) -> dict[str, Any]:
    """Run one step under ``limit`` seconds; its output goes to ``out/logs/<name>.log``."""
    missing = [n for n in step.needs if not (ROOT / n).exists()]
    row: dict[str, Any] = {"name": step.name, "title": step.title, "status": "not run",
                           "seconds": 0.0, "detail": ""}
    if missing:
        row["detail"] = f"needs a source checkout ({', '.join(missing)} not found)"
        return row
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [
        str(ROOT), os.environ.get("PYTHONPATH", "")])), PYTHONUNBUFFERED="1",
        OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.update(step.env)                      # a step may set its own PYTHONPATH
    log = out / "logs" / f"{step.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(log, "w", encoding="utf-8") as fh:
        fh.write("$ " + " ".join(step.cmd) + "\n")
        fh.flush()
        try:
            proc = subprocess.Popen(step.cmd, cwd=ROOT, env=env, stdout=fh,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as exc:                # mpirun (or python) missing, not executable
            fh.write(f"could not start: {exc}\n")
            row.update(status="FAIL", seconds=0.0, rc=None,
                       detail=f"could not start {step.cmd[0]!r}: {exc.strerror or exc}")
            return row
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    row["seconds"] = round(time.monotonic() - t0, 1)
    row["rc"] = rc
    try:
        row["detail"], row["data"] = step.parse(out)
    except Exception as exc:  # noqa: BLE001 - a step that wrote nothing usable
        row["detail"] = f"no result ({type(exc).__name__}: {exc})"
    if rc is None:
        row["detail"] = f"timed out after {limit:.0f} s; " + row["detail"]
    row["status"] = "ok" if rc == 0 and "data" in row else "FAIL"
    if row["status"] == "FAIL":
        tail = log.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-1:]
        row["detail"] += f" (rc {rc}; last log line: {tail[0][:160] if tail else ''})"
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lightcc.gpucheck",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="gpucheck-report", help="report directory")
    ap.add_argument("--budget-s", type=float, default=BUDGET_S, help="whole run, seconds")
    ap.add_argument("--only", default="", help="comma-separated step names to run")
    ap.add_argument("--quick", action="store_true", help="smaller benchmark sizes (64 MB)")
    ap.add_argument("--tar", default=None, metavar="PATH",
                    help="also pack the report folder into this .tar.gz")
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()
    env = probe()
    if not env["gpu"]:
        print(f"lightcc.gpucheck: no GPU to check here: {env['why']}. Run it on a machine with "
              f"a CUDA GPU, CuPy, NCCL and torch with CUDA.", file=sys.stderr)
        report.write(out, dict(env, summary=f"no GPU ({env['why']})"), [])
        return 2
    deadline = clock() + args.budget_s
    only = {s for s in args.only.split(",") if s}
    rows: list[dict[str, Any]] = []
    for step in steps(out, args.quick):
        if only and step.name not in only:
            continue
        left = deadline - clock()
        if left < MIN_STEP_S:
            rows.append({"name": step.name, "title": step.title, "status": "not run",
                         "seconds": 0.0, "detail": "no time left in the budget"})
            continue
        print(f"gpucheck: {step.title} ...", flush=True)
        rows.append(run_step(step, out, min(step.timeout, left)))
        print(f"gpucheck: {rows[-1]['status']} {rows[-1]['detail']}", flush=True)
        report.write(out, env, rows)          # a run cut short still leaves a report
    doc = report.write(out, env, rows)
    print(report.markdown(doc))
    print(f"gpucheck: report in {out / 'report.md'} and {out / 'report.json'}")
    if args.tar:
        print(f"gpucheck: packed into {pack(out, Path(args.tar))}")
    return 0 if doc["verdict"] == "pass" else 1


def pack(folder: Path, dest: Path) -> Path:
    """``folder`` as one gzipped tar at ``dest`` (its entries under the folder's name)."""
    import tarfile

    dest = dest.resolve()
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(dest, "w:gz") as tar:
        tar.add(folder, arcname=folder.name)
    return dest
