#!/usr/bin/env bash
# Every device check of issue 39 in one prepared run (<= 8 minutes on one H200 with 16 cores):
#   bash benchmarks/device_run.sh [--budget-s S] [--only a,b] [--cores-per-rank K]
# from a source checkout, with the machine's own python (CuPy, NCCL, a CUDA torch, mpi4py,
# mpirun); nothing is installed. Report under $OUT/device-run (else ./device-run-report).
# Without a GPU (or with anything missing) it prints one line naming what is missing and
# exits 2 within seconds. See docs/gpu.md and lightcc/gpucheck/device_run.py.
set -u
cd "$(dirname "$0")/.." || exit 2
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    for c in .venv/bin/python python3 python; do
        if command -v "$c" >/dev/null 2>&1; then PY="$c"; break; fi
    done
fi
if [ -z "$PY" ]; then
    echo "device_run: cannot run here: missing python3" >&2
    exit 2
fi
# lightcc's own dependencies, checked before lightcc is imported (one line, not a traceback)
if ! "$PY" - <<'PYEOF'
import importlib, sys
need = ["numpy", "mpi4py", "ml_dtypes", "numba", "psutil"]
gone = []
for name in need:
    try:
        importlib.import_module(name)
    except Exception as exc:
        gone.append(f"{name} ({type(exc).__name__}: {exc})")
if gone:
    print(f"device_run: cannot run here: missing Python packages: {'; '.join(gone)} "
          f"(python {sys.executable})", file=sys.stderr)
    sys.exit(2)
PYEOF
then
    exit 2
fi
exec "$PY" -m lightcc.gpucheck.device_run "$@"
