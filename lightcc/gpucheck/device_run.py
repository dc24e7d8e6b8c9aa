"""``python -m lightcc.gpucheck.device_run`` (``benchmarks/device_run.sh``): every device check
of issue 39 in one prepared run that fits 8 minutes on one GPU with 16 cores.

Steps, in order, each a subprocess under its own time limit inside ``--budget-s`` (a step with
less time left than its minimum is reported as not run, with the reason):

1. ``benchmarks``: ``benchmarks/gpu.py`` at 256 MiB: TopK 1 % (exact k) against ``torch.topk``,
   every cast against torch's, allreduce against raw NCCL;
2. ``ddp-1rank`` / ``ddp-2rank``: :mod:`lightcc.gpucheck.ddp_check` (DDP with the fp16/fp8
   hooks, FSDP2 with compressed reduce-scatter, ``torch.compile(DDP)`` on one rank, all on the
   ``lightcc`` backend; per-step time against DDP on NCCL (1 rank) and gloo (2 ranks sharing
   the GPU));
3. ``netns-x1`` / ``netns-x2``: ``benchmarks/training.py --netns`` (2 simulated hosts x 1 and
   x 2 ranks, 1 Gbit), each rank pinned to cores of its own (``benchmarks/device_pin``),
   barrier vs cross-barrier, none / fp16 / fp8, DDP / DDP fp16 hook, bounds printed;
4. ``engine-1rank`` / ``engine-2rank``: the gpucheck engine cases (NCCL; MPI staging);
5. ``gpu-tests``: ``tests/gpu`` (steps 4-5 passed on the H200 before: they come last).

Before anything runs it checks what the machine has; when something is missing it writes the
report (verdict ``no GPU``), prints one line naming every missing piece and exits with status 2
within seconds. Otherwise the exit status is 0 only when every step ran and passed.
Report: ``report.md``, ``report.json`` and ``logs/`` under ``--out`` (default
``$OUT/device-run`` when ``$OUT`` is set, else ``device-run-report``).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import site
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

from . import report, run

BUDGET_S = 420.0       # the run itself; a machine's start also counts against 8 minutes
TRAIN_CONFIGS = ("lightcc,cross_barrier,lightcc:fp16,cross_barrier:fp16,lightcc:fp8,"
                 "cross_barrier:fp8,ddp,ddp:fp16")
PIN_DIR = "benchmarks/device_pin"


def preflight(imp: Callable[[str], Any] = importlib.import_module,
              mpirun: Callable[[], str | None] = run.find_mpirun) -> list[str]:
    """Every piece the run needs that this machine lacks (empty: all there)."""
    missing: list[str] = []

    def load(name: str, what: str) -> Any:
        try:
            return imp(name)
        except Exception as exc:  # noqa: BLE001 - any import failure means it is missing
            missing.append(f"{what} ({type(exc).__name__}: {exc})")
            return None

    cupy = load("cupy", "CuPy")
    if cupy is not None:
        try:
            if cupy.cuda.runtime.getDeviceCount() < 1:
                missing.append("a CUDA GPU (CuPy sees none)")
        except Exception as exc:  # noqa: BLE001 - no driver
            missing.append(f"a CUDA GPU ({type(exc).__name__}: {exc})")
        load("cupy.cuda.nccl", "NCCL for CuPy")
    torch = load("torch", "torch")
    if torch is not None:
        if not torch.cuda.is_available():
            missing.append("torch with CUDA (torch.cuda.is_available() is False)")
        elif not torch.distributed.is_nccl_available():
            missing.append("torch with NCCL")
    load("mpi4py", "mpi4py")
    if mpirun() is None:
        missing.append("mpirun (not next to python, not on PATH)")
    return missing


def _mpi_flavour(mpirun: str | None) -> str:
    try:
        out = subprocess.run([mpirun or "mpirun", "--version"], capture_output=True, text=True,
                             timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown ({exc})"
    return out.strip().splitlines()[0] if out.strip() else "unknown"


SHIM = """#!/bin/bash
# Open MPI 4.1 for tests/netns/simhosts.py, which writes Open MPI 5 (PRRTE) options
a=()
while [ $# -gt 0 ]; do
    if [ "$1" = --prtemca ] && [ "${2:-}" = plm_ssh_agent ]; then
        a+=(--mca plm_rsh_agent "$3"); shift 3
    else
        a+=("$1"); shift
    fi
done
exec %s "${a[@]}"
"""


def open_mpi4_python(folder: Path, mpirun: str) -> Path:
    """A python (a venv over this one's packages) whose ``mpirun`` is a shim that turns the
    simulated hosts' Open MPI 5 options into Open MPI 4.1's, in front of ``mpirun``: the
    hosts take the ``mpirun`` next to ``sys.executable``."""
    python = folder / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip",
                        str(folder)], check=True, capture_output=True, timeout=60)
        purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig."
                                  "get_paths()['purelib'])"], check=True, capture_output=True,
                                 text=True, timeout=60).stdout.strip()
        # this python's own packages too, where it is itself a venv (with their .pth files)
        dirs = [d for d in site.getsitepackages() if Path(d).is_dir()]
        Path(purelib, "_lcc_parent.pth").write_text(
            f"import site; [site.addsitedir(d) for d in {dirs!r}]\n", encoding="utf-8")
    shim = folder / "bin" / "mpirun"
    shim.write_text(SHIM % mpirun, encoding="utf-8")
    shim.chmod(0o755)
    return python


def netns_reason(ranks: int, per_rank: int) -> str | None:
    """Why the simulated-hosts run cannot run here (``None``: it can)."""
    sys.path.insert(0, str(run.ROOT))
    try:
        from tests.netns.simhosts import unavailable_reason
    except ImportError as exc:
        return f"needs a source checkout ({exc})"
    reason = unavailable_reason()
    if reason:
        return reason
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
    if cores < ranks * per_rank:
        return f"{ranks} ranks x {per_rank} cores need {ranks * per_rank} cores, {cores} here"
    return None


def parse_ddp(path: Path) -> tuple[str, Any]:
    data = json.loads(path.read_text(encoding="utf-8"))
    detail = (f"{len(data['cases']) - data['failed']}/{len(data['cases'])} cases ok, "
              f"{data['size']} rank(s), native {data['native']}")
    for t in data.get("timing", []):
        detail += (f"; {t['hook']}: lightcc {t['lightcc_ms']:.2f} ms/step vs {t['native']} "
                   f"{t['native_ms']:.2f} ms ({t['overhead_pct']:+.1f} %)")
    return detail, data


def parse_training(path: Path) -> tuple[str, Any]:
    """Per model, each column's median img/s over rounds."""
    data = json.loads(path.read_text(encoding="utf-8"))
    cols: dict[tuple[str, str], list[float]] = {}
    for r in data["rows"]:
        if "img_s" in r:
            cols.setdefault((r["model"], r["config"]), []).append(r["img_s"])
    if not cols:
        raise ValueError("no timed rows")
    data["median_img_s"] = {f"{m} {c}": statistics.median(v) for (m, c), v in cols.items()}
    return "img/s (median): " + ", ".join(f"{k} {v:.0f}" for k, v in
                                          data["median_img_s"].items()), data


def training_step(out: Path, per_host: int, per_rank: int, limit: float, models: str,
                  python: str | None = None) -> run.Step:
    name = f"netns-x{per_host}"
    cmd = [python or sys.executable, "benchmarks/training.py", "--netns", "--ranks-per-host",
           str(per_host), "--rate", "1gbit", "--models", models, "--configs", TRAIN_CONFIGS,
           "--iters", "8", "--warmup", "3", "--rounds", "2", "--timeout", str(int(limit) - 10),
           "--json", str(out / f"{name}.json")]
    env = {"PYTHONPATH": os.pathsep.join([str(run.ROOT / PIN_DIR), str(run.ROOT)]),
           "DEVICE_RUN_CORES_PER_RANK": str(per_rank),
           "DEVICE_RUN_PIN_LOG": str(out / "logs" / f"{name}-pinning.txt")}
    return run.Step(name, f"training.py --netns, 2 hosts x {per_host} rank(s), 1 Gbit, "
                          f"{per_rank} cores pinned per rank", cmd, limit,
                    lambda o: parse_training(o / f"{name}.json"), env,
                    needs=("benchmarks/training.py", PIN_DIR + "/sitecustomize.py"))


def plan(out: Path, per_rank: int = 4, models: str = "resmlp",
         python: str | None = None) -> list[tuple[run.Step, float]]:
    """The steps with (ceiling in the Step, minimum time worth starting it with); ``python``
    runs training.py (see :func:`open_mpi4_python`)."""
    py = sys.executable
    ddp = [py, "-m", "lightcc.gpucheck.ddp_check"]
    return [
        (run.Step("benchmarks", "benchmarks/gpu.py 256 MiB: TopK 1 % exact k, casts vs torch",
                  run.mpi_command(1, [py, "benchmarks/gpu.py", "--size-mb", "256", "--reps", "5",
                               "--max-allreduce-mb", "256", "--json",
                               str(out / "benchmarks.json")]),
                  40, lambda o: run.bench_result(o / "benchmarks.json"), needs=("benchmarks/gpu.py",)),
         20),
        (run.Step("ddp-1rank", "DDP/FSDP2/compile(DDP) on lightcc, 1 rank, vs DDP on NCCL",
                  run.mpi_command(1, ddp + ["--json", str(out / "ddp-1rank.json")]), 90,
                  lambda o: parse_ddp(o / "ddp-1rank.json"), {"LCC_BACKEND": "nccl"}), 45),
        (run.Step("ddp-2rank", "DDP/FSDP2 on lightcc, 2 ranks on 1 GPU (staging), vs gloo",
                  run.mpi_command(2, ddp + ["--no-compile", "--port", "29562", "--json",
                                     str(out / "ddp-2rank.json")]), 60,
                  lambda o: parse_ddp(o / "ddp-2rank.json"), {"LCC_BACKEND": "mpi"}), 40),
        (training_step(out, 1, per_rank, 110, models, python), 70),
        (training_step(out, 2, per_rank, 110, models, python), 70),
        (run.Step("engine-1rank", "engine, 1 rank, NCCL: every algorithm x compressor",
                  run.mpi_command(1, [py, "-m", "lightcc.gpucheck.engine_check", "--json",
                               str(out / "engine-1rank.json")]), 40,
                  lambda o: run.engine_result(o / "engine-1rank.json"), {"LCC_BACKEND": "nccl"}), 25),
        (run.Step("engine-2rank", "engine, 2 ranks on 1 GPU, MPI through pinned memory",
                  run.mpi_command(2, [py, "-m", "lightcc.gpucheck.engine_check", "--algorithms",
                               "flat,ring,hierarchical", "--json",
                               str(out / "engine-2rank.json")]), 40,
                  lambda o: run.engine_result(o / "engine-2rank.json"), {"LCC_BACKEND": "mpi"}), 25),
        (run.Step("gpu-tests", "GPU test suite (tests/gpu)",
                  run.mpi_command(1, [py, "-m", "pytest", "tests/gpu", "-m", "gpu", "-q", "-p",
                               "no:cacheprovider", "-o", "addopts=",
                               f"--junitxml={out / 'gpu-tests.xml'}"]), 50,
                  lambda o: run.junit_result(o / "gpu-tests.xml"), needs=("tests/gpu",)), 35),
    ]


def execute(plan_: list[tuple[run.Step, float]], out: Path, budget_s: float,
            skip: dict[str, str], env: dict[str, Any]) -> list[dict[str, Any]]:
    """Run the plan inside the budget; a step in ``skip`` or without its minimum time left is
    'not run' with the reason. The report is rewritten after every step."""
    deadline = run.clock() + budget_s
    rows: list[dict[str, Any]] = []
    for step, minimum in plan_:
        left = deadline - run.clock()
        row = {"name": step.name, "title": step.title, "status": "not run", "seconds": 0.0}
        if step.name in skip:
            rows.append(dict(row, detail=skip[step.name]))
        elif left < minimum:
            rows.append(dict(row, detail=f"{left:.0f} s left in the budget, needs {minimum:.0f}"))
        else:
            print(f"device_run: {step.title} (at most {min(step.timeout, left):.0f} s) ...",
                  flush=True)
            rows.append(run.run_step(step, out, min(step.timeout, left)))
        print(f"device_run: {step.name}: {rows[-1]['status']} {rows[-1]['detail']}", flush=True)
        report.write(out, env, rows)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lightcc.gpucheck.device_run",
                                 description=__doc__.split("\n")[0])
    default_out = Path(os.environ["OUT"]) / "device-run" if os.environ.get("OUT") \
        else Path("device-run-report")
    ap.add_argument("--out", default=str(default_out), help="report directory")
    ap.add_argument("--budget-s", type=float, default=BUDGET_S, help="whole run, seconds")
    ap.add_argument("--only", default="", help="comma-separated step names to run")
    ap.add_argument("--cores-per-rank", type=int, default=4, help="netns steps: pinned cores")
    ap.add_argument("--models", default="resmlp", help="netns steps: training.py --models")
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()
    missing = preflight()
    if missing:
        why = "missing " + "; ".join(missing)
        report.write(out, {"gpu": False, "why": why, "summary": f"cannot run: {why}"}, [])
        print(f"device_run: cannot run here: {why}", file=sys.stderr)
        return 2
    env = run.probe()
    env["cores"] = os.cpu_count()
    env["mpi"] = _mpi_flavour(run.find_mpirun())
    python = None
    if "Open MPI) 4" in env["mpi"]:
        try:
            python = str(open_mpi4_python(Path(tempfile.gettempdir()) / "lcc-device-run-ompi4",
                                          run.find_mpirun() or "mpirun"))
            env["netns_python"] = f"{python} (mpirun shim for Open MPI 4)"
        except (OSError, subprocess.SubprocessError) as exc:
            env["netns_python"] = f"no Open MPI 4 shim ({exc})"
    steps = plan(out, args.cores_per_rank, args.models, python)
    only = {s for s in args.only.split(",") if s}
    skip = {s.name: "not in --only" for s, _ in steps if only and s.name not in only}
    for per_host in (1, 2):
        name = f"netns-x{per_host}"
        if name not in skip:
            reason = netns_reason(2 * per_host, args.cores_per_rank)
            if reason:
                skip[name] = f"not possible here: {reason}"
    rows = execute(steps, out, args.budget_s, skip, env)
    doc = report.write(out, env, rows)
    print(report.markdown(doc))
    print(f"device_run: report in {out / 'report.md'} and {out / 'report.json'}")
    return 0 if doc["verdict"] == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
