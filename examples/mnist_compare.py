"""Serial vs parallel vs each compressor on the MNIST example, as one table.

    python examples/mnist_compare.py                 # 1 rank, then 2 ranks x each compressor
    python examples/mnist_compare.py -np 4 --compressors none,fp16,topk --epochs 3
    python examples/mnist_compare.py --seeds 5      # mean accuracy over 5 seeds per row

Each configuration runs ``examples/mnist.py`` as its own job (through ``lccrun``, or
``mpirun`` with ``--launcher mpirun``) and reports: training wall time, job time (including
start-up), final test accuracy and the bytes all ranks sent over the wire. With ``--seeds N``
every configuration runs with N seeds and the table shows the mean accuracy, its range and
the difference to the uncompressed parallel run (the digits test set has only 360 images,
so one seed cannot resolve differences below about a point).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
COMPRESSORS = "none,fp16,bf16,fp8,topk,powersgd"


def launcher_cmd(kind: str, np_: int) -> list[str]:
    if kind == "lccrun":
        return [sys.executable, "-m", "lightcc.runner", "-np", str(np_)]
    mpirun = Path(sys.executable).parent / "mpirun"
    cmd = [str(mpirun) if mpirun.exists() else "mpirun", "-np", str(np_), "--oversubscribe",
           "--bind-to", "none"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.insert(1, "--allow-run-as-root")
    return cmd


def run_one(args: argparse.Namespace, np_: int, compression: str, seed: int = 42) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = launcher_cmd(args.launcher, np_) + [
            sys.executable, str(HERE / "mnist.py"), "--compression", compression,
            "--json", str(out), "--data-dir", args.data_dir, "--seed", str(seed)]
        if args.epochs:
            cmd += ["--epochs", str(args.epochs)]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE.parent),
                                                          env.get("PYTHONPATH", "")]))
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        job = time.perf_counter() - t0
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stdout + proc.stderr)[-2000:]
            return {"ranks": np_, "compression": compression, "error": tail}
        result = json.loads(out.read_text())
        result["job_s"] = job
        return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-np", type=int, default=2, help="ranks of the parallel runs")
    parser.add_argument("--compressors", default=COMPRESSORS)
    parser.add_argument("--epochs", type=int, default=0, help="default: mnist.py's")
    parser.add_argument("--data-dir", default="~/.cache/lightcc/mnist")
    parser.add_argument("--launcher", choices=["lccrun", "mpirun"], default="lccrun")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument("--seeds", type=int, default=1, help="seeds per configuration (mean)")
    args = parser.parse_args()

    configs = [(1, "none")] + [(args.np, c) for c in args.compressors.split(",") if c]
    rows = []
    for np_, comp in configs:
        print(f"running {np_} rank(s), compression {comp} ...", flush=True)
        runs = [run_one(args, np_, comp, 42 + i) for i in range(max(1, args.seeds))]
        bad = [r for r in runs if "error" in r]
        row = dict(bad[0]) if bad else dict(runs[0])
        if not bad:
            accs = [r["accuracy"] for r in runs]
            row.update(accuracy=sum(accs) / len(accs), acc_min=min(accs), acc_max=max(accs),
                       wall_s=sum(r["wall_s"] for r in runs) / len(runs),
                       job_s=sum(r["job_s"] for r in runs) / len(runs), seeds=len(runs))
        rows.append(row)
    data = next((r.get("data") for r in rows if "data" in r), "?")
    base = next((r["accuracy"] for r in rows[1:] if r.get("compression") == "none"
                 and "error" not in r), None)
    seeds = max(1, args.seeds)
    print(f"\nMNIST example ({data}), serial vs parallel vs compressors"
          + (f", mean of {seeds} seeds" if seeds > 1 else ""))
    print(f"{'ranks':>5} {'compression':<12} {'train s':>8} {'job s':>7} {'accuracy':>9} "
          f"{'range':>15} {'vs none':>8} {'bytes sent':>12}")
    for r in rows:
        if "error" in r:
            print(f"{r['ranks']:>5} {r['compression']:<12} failed: "
                  f"{r['error'].strip().splitlines()[-1] if r['error'].strip() else '?'}")
            continue
        rng = (f"{100 * r['acc_min']:.2f}-{100 * r['acc_max']:.2f}%"
               if seeds > 1 else "")
        diff = (f"{100 * (r['accuracy'] - base):+.2f}" if base is not None
                and r["ranks"] > 1 else "")
        print(f"{r['ranks']:>5} {r['compression']:<12} {r['wall_s']:>8.2f} {r['job_s']:>7.1f} "
              f"{100 * r['accuracy']:>8.2f}% {rng:>15} {diff:>8} {int(r['bytes_sent']):>12,d}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
