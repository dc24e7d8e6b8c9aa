"""Seed sweeps and full example trainings: the accuracy studies behind CI's short checks.

CI (``tests/``) keeps one short accuracy check per compressor (2 seeds, the same bars); the
studies here run the same workers with every seed and the examples for all their epochs, to
measure the mean drop, its spread and the margin to each bar. Each study is one job on a
loaded machine of minutes (the full set: ~30 minutes on 2 shared cores):

    python benchmarks/convergence/run.py                  # every study
    python benchmarks/convergence/run.py compressors ddp-hooks

Studies (each prints its worker's table; exit status 1 when a bar is missed):

- ``compressors``: every compressor's ``allreduce`` on a 64-128-10 NumPy MLP, 300 steps,
  12 seeds (tests/parallel/workers_compression/convergence_worker.py);
- ``optimizer``: fp8 and bf16 through ``lightcc.torch.DistributedOptimizer``, 12 seeds
  (workers_compression/optimizer_convergence.py);
- ``ddp-hooks``: lightcc's DDP comm hooks, 4-20 seeds a hook (workers_torch/
  c10d_hooks_convergence.py);
- ``examples``: examples/mnist.py (8 epochs on digits, >= 96 %), examples/ddp_mnist.py without
  a hook (>= 96 %) and with TopK (>= 94.5 %), examples/horovod_style_mnist.py (3 epochs).
"""
from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.mpi_harness import run_mpi  # noqa: E402

WC = "tests/parallel/workers_compression/"
WT = "tests/parallel/workers_torch/"
QUIET = {"PYTHONWARNINGS": "ignore::FutureWarning,ignore::UserWarning", "NUMBA_NUM_THREADS": "1"}


def _last_accuracy(out: str) -> float:
    found = re.findall(r"test accuracy ([\d.]+)%", out)
    return float(found[-1]) if found else float("nan")


def _example(args: list[str], least: float) -> tuple[bool, str]:
    out = run_mpi(2, args, env=QUIET, timeout=1800, expect_rc=None).stdout
    acc = _last_accuracy(out)
    return acc >= least, f"{' '.join(args)}: final test accuracy {acc:.2f} % (bar {least})"


def study_compressors() -> tuple[bool, str]:
    out = run_mpi(2, [WC + "convergence_worker.py"], env={**QUIET, "CONV_SEEDS": "12"},
                  timeout=3600, expect_rc=None).stdout
    return "OK convergence" in out, out


def study_optimizer() -> tuple[bool, str]:
    out = run_mpi(2, [WC + "optimizer_convergence.py", "fp8=0.3", "bf16=0.5"],
                  env={**QUIET, "CONV_SEEDS": "12"}, timeout=3600, expect_rc=None).stdout
    return out.count("OK optimizer convergence") == 2, out


def study_ddp_hooks() -> tuple[bool, str]:
    out = run_mpi(2, [WT + "c10d_hooks_convergence.py"], env={**QUIET, "CONV_SEED_SCALE": "1"},
                  timeout=3600, expect_rc=None).stdout
    return out.count("OK 3 cases") == 2, out


def study_examples() -> tuple[bool, str]:
    runs = [_example(["examples/mnist.py", "--data-dir", "/nonexistent"], 96.0),
            _example(["examples/ddp_mnist.py", "--data-dir", "/nonexistent"], 96.0),
            _example(["examples/ddp_mnist.py", "--data-dir", "/nonexistent",
                      "--comm-hook", "topk"], 94.5)]
    out = run_mpi(2, ["examples/horovod_style_mnist.py", "--data-dir", "/nonexistent"],
                  env=QUIET, timeout=1800, expect_rc=None).stdout
    hvd = re.findall(r"Test set: Average loss: [\d.]+, Accuracy: ([\d.]+)%", out)
    runs.append((bool(hvd), f"horovod_style_mnist.py: test accuracy per epoch {hvd}"))
    return all(ok for ok, _ in runs), "\n".join(line for _, line in runs)


STUDIES = {"compressors": study_compressors, "optimizer": study_optimizer,
           "ddp-hooks": study_ddp_hooks, "examples": study_examples}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("studies", nargs="*", help=f"any of {', '.join(STUDIES)} (default: all)")
    names = parser.parse_args().studies or list(STUDIES)
    unknown = [n for n in names if n not in STUDIES]
    if unknown:
        parser.error(f"unknown studies {unknown}; choose from {list(STUDIES)}")
    failed = []
    for name in names:
        t0 = time.perf_counter()
        ok, text = STUDIES[name]()
        print(f"== {name}: {'ok' if ok else 'FAILED'} in {time.perf_counter() - t0:.0f} s\n"
              f"{text.strip()}\n", flush=True)
        if not ok:
            failed.append(name)
    print("all studies within their bars" if not failed else f"bars missed: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
