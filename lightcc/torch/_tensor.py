"""Tensor <-> NumPy adapters: hand the core a view of a tensor's memory, never a copy when the
tensor allows it.

A contiguous CPU tensor becomes ``t.detach().numpy()`` (same memory); bfloat16 goes through an
int16 view re-typed as ``ml_dtypes.bfloat16``. Non-contiguous and CUDA tensors are staged
through a contiguous CPU copy; :class:`Staged` remembers where the result must be copied back.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..common import dtypes
from ..common.exceptions import UnsupportedDTypeError

_BF16 = dtypes.BFLOAT16

# torch dtypes lightcc reduces (Horovod's set plus bfloat16 and bool).
SUPPORTED_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.bool)


class TensorTypeError(UnsupportedDTypeError, ValueError):
    """A tensor dtype lightcc cannot communicate (Horovod raises ``ValueError`` here)."""


def check_dtype(t: torch.Tensor, what: str) -> None:
    if t.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES)
        raise TensorTypeError(f"{what}: tensor type {t.dtype} is not supported; "
                              f"supported: {names}")


def as_array(t: torch.Tensor) -> np.ndarray:
    """A NumPy view of the contiguous CPU tensor ``t`` (shares memory)."""
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(_BF16)
    return t.numpy()


def from_array(a: np.ndarray) -> torch.Tensor:
    """A tensor sharing ``a``'s memory (bfloat16 arrays included)."""
    if _BF16 is not None and a.dtype == _BF16:
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
    if not a.flags.writeable:
        a = a.copy()
    return torch.from_numpy(a)


@dataclass
class Staged:
    """An array the core may read and write, plus the tensor it stands for.

    ``copy_back`` is True when ``array`` is a staging copy (non-contiguous or non-CPU tensor)
    whose contents must be written back into ``tensor`` after an in-place collective.
    """

    tensor: torch.Tensor
    work: torch.Tensor      # contiguous CPU tensor backing ``array``
    array: np.ndarray
    copy_back: bool

    def finish(self) -> torch.Tensor:
        """Write the result into ``tensor`` when it was staged; returns ``tensor``."""
        if self.copy_back:
            with torch.no_grad():
                self.tensor.copy_(self.work)
        return self.tensor


def stage(t: torch.Tensor, what: str) -> Staged:
    """Prepare ``t`` for the core: a view when possible, else a contiguous CPU copy."""
    if not isinstance(t, torch.Tensor):
        raise TensorTypeError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    check_dtype(t, what)
    if t.is_sparse:
        raise TensorTypeError(f"{what}: sparse tensors are not supported here (use "
                              f"DistributedOptimizer's sparse handling or to_dense())")
    if t.device.type == "cpu" and t.is_contiguous():
        return Staged(t, t, as_array(t), False)
    work = t.detach().to("cpu", copy=True).contiguous()
    return Staged(t, work, as_array(work), True)


def result_like(t: torch.Tensor) -> tuple[torch.Tensor, np.ndarray]:
    """A fresh contiguous CPU tensor shaped like ``t`` and its array view (an ``out=`` target)."""
    out = torch.empty(t.shape, dtype=t.dtype)
    return out, as_array(out)


def to_device(result: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Move a CPU result to ``like``'s device (no-op on CPU)."""
    return result if like.device.type == "cpu" else result.to(like.device)
