"""Test doubles for the GPU path: CuPy (``fake_cupy`` arrays, ``fake_cuda`` runtime), NCCL with
thread ranks (``fake_nccl``), the CUDA kernels (``kernels``: emulation + PTX signature checks)
and the part of ``torch.cuda`` lightcc uses plus tensors that say they are on a GPU
(``fake_torch``).

:func:`install` puts them in place for one test (``monkeypatch``): ``import cupy`` then gives
the fake, kernel launches are checked against the PTX signatures and emulated, and every launch,
copy, NCCL call, event record, stream wait and host synchronization lands in ``fake_cupy.LOG``.
"""
from __future__ import annotations

import sys
import types
from typing import Any

import numpy as np

from . import fake_cupy, fake_nccl, kernels

NCCL_NAMES = ("NcclCommunicator", "NcclError", "get_unique_id", "get_version", "groupStart",
              "groupEnd")


def _module(name: str, source: Any, names: list[str]) -> types.ModuleType:
    mod = types.ModuleType(name)
    for n in names:
        setattr(mod, n, getattr(source, n))
    return mod


def build_cupy() -> types.ModuleType:
    """Fresh ``cupy``, ``cupy.cuda`` and ``cupy.cuda.nccl`` module objects over the doubles."""
    cupy = _module("cupy", fake_cupy, [
        "ndarray", "empty", "zeros", "ones", "full", "arange", "asarray", "ascontiguousarray",
        "from_dlpack", "where", "isnan", "isfinite", "abs", "sort", "cumsum", "trunc", "ldexp",
        "left_shift",
        "multiply", "maximum", "minimum", "logical_not", "concatenate", "add", "subtract",
        "copyto", "linalg"])
    cupy.__version__ = "14.0.0-fake"
    cuda = _module("cupy.cuda", fake_cupy, ["Stream", "ExternalStream", "Event", "Device",
                                            "get_current_stream", "runtime",
                                            "alloc_pinned_memory"])
    nccl = _module("cupy.cuda.nccl", fake_nccl, list(NCCL_NAMES))
    nccl.available = True
    for code, value in fake_nccl.CODES.items():
        setattr(nccl, code, value)
    cuda.nccl = nccl
    cupy.cuda = cuda
    return cupy


class _ForGood:
    """``monkeypatch``'s two calls, without undo (for worker processes)."""

    @staticmethod
    def setattr(target: Any, name: str, value: Any) -> None:
        setattr(target, name, value)

    @staticmethod
    def setitem(mapping: Any, key: Any, value: Any) -> None:
        mapping[key] = value


def install(monkeypatch: Any = None, devices: int = 1,
            torch_cuda: bool = False) -> types.SimpleNamespace:
    """Put the doubles in place for one test (for the process when ``monkeypatch`` is None);
    returns ``cupy``, ``log``, ``launches`` and (with ``torch_cuda``) the :class:`TorchCuda`
    patched into ``torch.cuda``."""
    monkeypatch = monkeypatch or _ForGood()
    from lightcc.common.backends import nccl as nccl_backend
    from lightcc.common.kernels import cuda as kc

    fake_cupy.LOG.clear()
    monkeypatch.setitem(fake_cupy.DEVICE_COUNT, 0, devices)
    cupy = build_cupy()
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupy.cuda", cupy.cuda)
    monkeypatch.setitem(sys.modules, "cupy.cuda.nccl", cupy.cuda.nccl)
    params = kernels.ptx_params()
    launches: list[tuple[str, str]] = []

    def get_function(module: str, func: str) -> Any:
        def launch(grid: Any, block: Any, args: tuple, stream: Any = None, **kw: Any) -> None:
            kernels.check_launch(params, module, func, grid, block, args,
                                 lambda a: isinstance(a, fake_cupy.ndarray), kc.THREADS)
            s = stream if stream is not None else fake_cupy.get_current_stream()
            launches.append((module, func))
            fake_cupy.LOG.add("launch", s.ptr, func)
            kernels.emulate(func, args,
                            lambda v: v._a if isinstance(v, fake_cupy.ndarray) else None,
                            lambda ptr, dtype, n: fake_cupy.raw(ptr, n * np.dtype(dtype)
                                                                .itemsize).view(dtype))
        return launch

    monkeypatch.setattr(kc, "get_function", get_function)
    world = object()
    monkeypatch.setattr(nccl_backend, "_mpi", lambda: types.SimpleNamespace(
        COMM_WORLD=world, COMM_SELF=world, Is_finalized=lambda: False))
    out = types.SimpleNamespace(cupy=cupy, log=fake_cupy.LOG, launches=launches, torch=None)
    if torch_cuda:
        import torch

        from .fake_torch import TorchCuda

        out.torch = TorchCuda()
        monkeypatch.setattr(torch.cuda, "current_stream", out.torch.current_stream)
    return out


def spy_submissions() -> list:
    """Make the engine record every request submitted in this process (for good); returns the
    list they are appended to."""
    from lightcc.common.engine import Engine

    submitted: list = []
    submit = Engine.submit

    def spy(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        submitted.append(request)
        return submit(self, request, *args, **kwargs)

    Engine.submit = spy
    return submitted
