"""The part of ``torch.cuda`` lightcc uses, and CPU tensors that say they live on ``cuda:0``.

:class:`TorchCuda` stands in for ``torch.cuda.current_stream(device)`` (an object with the raw
``cuda_stream`` pointer; per thread; the legacy default stream 0 unless a test sets another).
:func:`cuda_tensor` makes a CPU tensor report ``device == cuda:0`` and ``is_cuda``, so the torch
layer's CUDA branches run on it: its memory becomes the doubles' device memory when the torch
layer imports it (DLPack), and results come back through DLPack as well. Torch operations on
such a tensor return plain CPU tensors (torch functions are not overridden).
"""
from __future__ import annotations

import threading
import types
from typing import Any

import torch


class TorchCuda:
    """``torch.cuda.current_stream`` (see module docstring)."""

    def __init__(self) -> None:
        self._tls = threading.local()

    def current_stream(self, device: Any = None) -> Any:
        return types.SimpleNamespace(cuda_stream=getattr(self._tls, "ptr", 0), device=device)

    def set_stream(self, ptr: int) -> None:
        self._tls.ptr = int(ptr)


class FakeCudaTensor(torch.Tensor):
    __torch_function__ = torch._C._disabled_torch_function_impl
    device = property(lambda self: torch.device("cuda", 0))
    is_cuda = property(lambda self: True)


def cuda_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a tensor that says it lives on ``cuda:0`` (same memory)."""
    return t.as_subclass(FakeCudaTensor)
