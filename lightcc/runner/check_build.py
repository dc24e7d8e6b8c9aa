"""``lccrun --check-build``: what this installation can do, one row per capability.

Every probe is guarded: a missing or broken optional package shows as ``not installed`` (or the
error) instead of crashing the table.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import platform
import sys
from typing import Callable

from .command import find_mpirun, mpirun_version
from .version import lightcc_version

Row = tuple[str, str]


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _guard(probe: Callable[[], list[Row]], label: str) -> list[Row]:
    try:
        return probe()
    except Exception as exc:  # noqa: BLE001 - the table must always print
        return [(label, f"error: {type(exc).__name__}: {str(exc)[:120]}")]


def _mpi_rows() -> list[Row]:
    rows: list[Row] = []
    try:
        mpirun = find_mpirun()
    except Exception as exc:  # noqa: BLE001
        mpirun, impl, version = None, "", ""
        rows.append(("mpirun", f"not found ({exc})"))
    else:
        impl, version = mpirun_version(mpirun)
        rows.append(("mpirun", f"{impl} {version} ({mpirun})"))
    try:
        import mpi4py
        mpi4py.rc.initialize = False  # never start MPI in the launcher
        mpi4py.rc.finalize = False
        from mpi4py import MPI
    except ImportError:
        rows.append(("mpi4py", "not installed"))
        return rows
    library = MPI.Get_library_version().strip().splitlines()[0].split(",")[0]
    rows.append(("mpi4py", f"{mpi4py.__version__} (MPI {'.'.join(map(str, MPI.Get_version()))})"))
    rows.append(("MPI library", library))
    if mpirun is not None:
        match = version and version in library and impl.split()[0] in library
        rows.append(("mpirun = mpi4py MPI", "yes" if match else
                     f"NO: mpirun is {impl} {version}, mpi4py uses {library}; "
                     f"ranks may fail to start"))
    return rows


def _torch_rows() -> list[Row]:
    version = _dist_version("torch")
    if version is None:
        return [("torch", "not installed")]
    torch = importlib.import_module("torch")
    cuda = torch.version.cuda or "no"
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [("torch", f"{torch.__version__} (CUDA {cuda}, {gpus} GPU(s) visible)")]


def _cupy_rows() -> list[Row]:
    dist = next((d for d in ("cupy", "cupy-cuda12x", "cupy-cuda11x", "cupy-cuda13x")
                 if _dist_version(d)), None)
    if dist is None:
        return [("CuPy", "not installed"), ("NCCL", "not installed (needs CuPy)"),
                ("GPUs", "0 (no CuPy)")]
    cupy = importlib.import_module("cupy")
    rows: list[Row] = [("CuPy", f"{cupy.__version__} ({dist})")]
    try:
        from cupy.cuda import nccl
        v = nccl.get_version()
        rows.append(("NCCL", f"{v // 10000}.{v // 100 % 100}.{v % 100}"))
    except Exception as exc:  # noqa: BLE001
        rows.append(("NCCL", f"not available ({type(exc).__name__})"))
    try:
        rows.append(("GPUs", str(cupy.cuda.runtime.getDeviceCount())))
    except Exception as exc:  # noqa: BLE001
        rows.append(("GPUs", f"0 ({type(exc).__name__}: {str(exc)[:80]})"))
    return rows


def _simple(dist: str, label: str) -> list[Row]:
    return [(label, _dist_version(dist) or "not installed")]


def _registry_rows() -> list[Row]:
    from ..common.algorithms import available_algorithms
    from ..common.compression import available_compressors

    return [("compressors", ", ".join(available_compressors())),
            ("algorithms", ", ".join(available_algorithms()))]


def collect() -> list[Row]:
    rows: list[Row] = [
        ("lightcc", lightcc_version()),
        ("Python", f"{platform.python_version()} ({sys.executable})"),
    ]
    rows += _guard(_mpi_rows, "MPI")
    rows += _guard(_torch_rows, "torch")
    rows += _guard(_cupy_rows, "CuPy")
    rows += _guard(lambda: _simple("numba", "numba"), "numba")
    rows += _guard(lambda: _simple("ml_dtypes", "ml_dtypes"), "ml_dtypes")
    rows += _guard(lambda: _simple("numpy", "numpy"), "numpy")
    rows += _guard(_registry_rows, "registries")
    return rows


def render(rows: list[Row]) -> str:
    width = max(len(label) for label, _ in rows)
    lines = ["lightcc build check", "-" * (width + 40)]
    lines += [f"{label.ljust(width)}  {value}" for label, value in rows]
    return "\n".join(lines) + "\n"
