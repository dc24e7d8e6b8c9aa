"""CUDA kernels from ``csrc/*.cu``, compiled at first use by CuPy (NVRTC) and cached per process.

Nothing is compiled at install time. :func:`get_function` finds the source (see
:func:`source_dirs`), pastes its local ``#include "x.cuh"`` headers in (so NVRTC needs no path
to them), compiles it once per process and device with ``cupy.RawModule`` and returns the
kernel. CuPy's own on-disk cache (``~/.cupy/kernel_cache``) makes later processes skip NVRTC.

Importing this module never imports CuPy; every function that needs it imports it lazily and
raises :class:`LightCCError` with the reason when CuPy or a GPU is missing.
"""
from __future__ import annotations

import logging
import os
import re
import threading
from pathlib import Path
from typing import Any

import numpy as np

from ..exceptions import InvalidArgumentError, LightCCError

log = logging.getLogger("lightcc")

CSRC_ENV = "LCC_CSRC_DIR"          # optional override of where the .cu files live
NVRTC_OPTIONS: tuple[str, ...] = ("--std=c++17",)
THREADS = 256                      # threads per block of every lightcc kernel
_INCLUDE_RE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"[ \t]*$', re.MULTILINE)

_lock = threading.Lock()
_modules: dict[tuple[str, int], Any] = {}


def source_dirs() -> list[Path]:
    """Directories searched for kernel sources, in order.

    ``$LCC_CSRC_DIR`` (when set), the installed copy ``lightcc/_csrc`` (setup.py ships the
    sources there as package data), then the repository's top-level ``csrc/`` (source tree).
    """
    pkg = Path(__file__).resolve().parents[2]          # .../lightcc
    dirs = []
    if os.environ.get(CSRC_ENV):
        dirs.append(Path(os.environ[CSRC_ENV]))
    dirs += [pkg / "_csrc", pkg.parent / "csrc"]
    return dirs


def find_source(name: str) -> Path:
    """Path of kernel source ``name`` (e.g. ``"quantize.cu"``); LightCCError if not found."""
    for d in source_dirs():
        path = d / name
        if path.is_file():
            return path
    searched = ", ".join(str(d) for d in source_dirs())
    raise LightCCError(f"CUDA kernel source {name!r} not found (searched {searched}); "
                       f"reinstall lightcc or set {CSRC_ENV}")


def kernel_sources() -> dict[str, Path]:
    """Every ``*.cu`` file that :func:`find_source` can see, by file name (first dir wins)."""
    found: dict[str, Path] = {}
    for d in source_dirs():
        if d.is_dir():
            for path in sorted(d.glob("*.cu")):
                found.setdefault(path.name, path)
    return found


def expand_includes(path: Path, _seen: set[Path] | None = None) -> str:
    """The text of ``path`` with local ``#include "x"`` lines replaced by the file, once each.

    Headers are looked up next to ``path``; a name that is not there is left to the compiler.
    """
    seen = set() if _seen is None else _seen
    here = path.parent

    def repl(match: re.Match) -> str:
        inc = (here / match.group(1)).resolve()
        if not inc.is_file():
            return match.group(0)
        if inc in seen:
            return f"// (already included: {match.group(1)})"
        seen.add(inc)
        return f"// ---- begin {match.group(1)}\n{expand_includes(inc, seen)}\n// ---- end"

    return _INCLUDE_RE.sub(repl, path.read_text())


def cupy_or_raise() -> Any:
    """The ``cupy`` module, or LightCCError explaining that the GPU path needs it."""
    try:
        import cupy
    except ImportError as exc:
        raise LightCCError(f"the GPU path needs CuPy (pip install cupy-cuda13x): {exc}") from None
    return cupy


def gpu_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    try:
        cupy = cupy_or_raise()
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, no driver, no device: all mean "no GPU"
        return False


def cuda_include_dirs() -> list[str]:
    """Directories holding ``cuda_fp8.h`` (CUDA_PATH, CUDA_HOME, CuPy's CUDA, /usr/local/cuda)."""
    roots = [os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME")]
    try:
        from cupy import _environment

        roots.append(_environment.get_cuda_path())
    except Exception:
        pass
    roots.append("/usr/local/cuda")
    out: list[str] = []
    for root in roots:
        if root:
            inc = os.path.join(root, "include")
            if os.path.isfile(os.path.join(inc, "cuda_fp8.h")) and inc not in out:
                out.append(inc)
    return out


def compile_options() -> tuple[str, ...]:
    """NVRTC options: C++17 plus the first CUDA include directory found (for cuda_fp8.h)."""
    dirs = cuda_include_dirs()
    return NVRTC_OPTIONS + ((f"-I{dirs[0]}",) if dirs else ())


def get_module(name: str) -> Any:
    """The compiled ``cupy.RawModule`` of ``csrc/<name>`` for the current device (cached)."""
    cupy = cupy_or_raise()
    key = (name, cupy.cuda.runtime.getDevice())
    with _lock:
        mod = _modules.get(key)
        if mod is None:
            path = find_source(name)
            options = compile_options()
            try:
                mod = cupy.RawModule(code=expand_includes(path), options=options)
                mod.compile()
            except Exception as exc:  # CompileException carries NVRTC's log in str()
                raise LightCCError(f"compiling {path} with NVRTC {options} failed: {exc}") from exc
            log.debug("compiled CUDA kernels %s for device %d", path, key[1])
            _modules[key] = mod
    return mod


_functions: dict[tuple[str, str, int], Any] = {}


def get_function(name: str, func: str) -> Any:
    """Kernel ``func`` (an ``extern "C"`` name) of ``csrc/<name>`` (cached per device: a
    lookup in the compiled module costs microseconds that every launch would pay)."""
    cupy = cupy_or_raise()
    key = (name, func, cupy.cuda.runtime.getDevice())
    fn = _functions.get(key)
    if fn is None:
        fn = _functions[key] = get_module(name).get_function(func)
    return fn


def grid_for(n: int, per_thread: int = 1, threads: int = THREADS, max_blocks: int = 65536) -> int:
    """Blocks for a grid-stride kernel over ``n`` items, ``per_thread`` items per thread."""
    need = -(-max(int(n), 1) // (threads * per_thread))
    return max(1, min(need, max_blocks))


def as_cupy(obj: Any) -> Any:
    """A CuPy view of a CUDA array (torch tensor, CuPy array, anything with DLPack/CAI).

    Zero-copy: DLPack first (it carries stream ordering with the producer), then
    ``__cuda_array_interface__``. LightCCError if the result is not a view of the same memory.
    """
    cupy = cupy_or_raise()
    if isinstance(obj, cupy.ndarray):
        return obj
    if getattr(obj, "requires_grad", False) is True:     # torch refuses to export it
        raise InvalidArgumentError(f"a {type(obj).__name__} that requires grad cannot be "
                                   f"shared without a copy; pass tensor.detach()")
    if hasattr(obj, "__dlpack__"):
        arr = cupy.from_dlpack(obj)
    elif hasattr(obj, "__cuda_array_interface__"):
        arr = cupy.asarray(obj)
    else:
        raise LightCCError(f"{type(obj).__name__} is not a CUDA array (no DLPack or "
                           f"__cuda_array_interface__)")
    ptr = _data_ptr(obj)
    if ptr is not None and arr.size and ptr != arr.data.ptr:
        raise LightCCError(f"importing {type(obj).__name__} copied its memory "
                           f"({ptr:#x} -> {arr.data.ptr:#x}); expected a zero-copy view")
    return arr


def _data_ptr(obj: Any) -> int | None:
    if hasattr(obj, "data_ptr"):                     # torch.Tensor
        return int(obj.data_ptr())
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        return int(cai["data"][0])
    return None


def i64(v: int) -> np.int64:
    """A 64-bit integer kernel argument."""
    return np.int64(int(v))


def launch(module: str, func: str, grid: int, args: tuple) -> None:
    """Launch ``func`` of csrc module ``module`` on ``grid`` blocks of THREADS threads."""
    get_function(module, func)((int(grid),), (THREADS,), args)


def check_device_array(x: Any, what: str, dtype: Any = None) -> None:
    """InvalidArgumentError unless ``x`` is a C-contiguous CuPy array (of ``dtype``)."""
    cupy = cupy_or_raise()
    if not isinstance(x, cupy.ndarray):
        raise InvalidArgumentError(f"{what} must be a CuPy array, got {type(x).__name__}")
    if not x.flags.c_contiguous:
        raise InvalidArgumentError(f"{what} must be C-contiguous")
    if dtype is not None and x.dtype != np.dtype(dtype):
        raise InvalidArgumentError(f"{what} must be {np.dtype(dtype)}, got {x.dtype}")
