"""Argument translation for the lightcc process group: reduce ops, options, tensor lists.

Everything here runs on the calling thread before anything is submitted, so a bad argument
raises at once (naming the collective and the option) instead of failing later on one rank.
"""
from __future__ import annotations

import ctypes
from datetime import timedelta
from typing import Any, Sequence

import numpy as np
import torch
import torch.distributed as dist

from ...common import dtypes
from ...common.exceptions import InvalidArgumentError, UnsupportedDTypeError
from .._tensor import Staged, TensorTypeError, check_dtype

_R = dist.ReduceOp.RedOpType
_BASIC = {_R.SUM: "sum", _R.AVG: "average", _R.MIN: "min", _R.MAX: "max",
          _R.PRODUCT: "prod", _R.BAND: "band", _R.BOR: "bor", _R.BXOR: "bxor"}
_NAMES = {v: k.name for k, v in _BASIC.items()}


def reduce_op(op: Any, dtype: torch.dtype, what: str) -> tuple[str, float]:
    """(lightcc op, prescale factor) for a torch ``ReduceOp`` on tensors of ``dtype``."""
    kind = getattr(op, "op", op)            # a ReduceOp object, or a bare RedOpType
    if kind == _R.PREMUL_SUM:
        factor = op.factor
        if isinstance(factor, torch.Tensor):
            if factor.numel() != 1:
                raise InvalidArgumentError(f"{what}: PREMUL_SUM needs a scalar factor, got a "
                                           f"tensor of shape {tuple(factor.shape)}")
            factor = factor.item()
        if not dtype.is_floating_point:
            raise UnsupportedDTypeError(f"{what}: PREMUL_SUM needs a floating-point tensor, "
                                        f"got {dtype}")
        return "sum", float(factor)
    name = _BASIC.get(kind)
    if name is None:
        raise InvalidArgumentError(f"{what}: reduce op {kind} is not supported by lightcc")
    if name in ("band", "bor", "bxor") and (dtype.is_floating_point or dtype.is_complex):
        raise UnsupportedDTypeError(f"{what}: ReduceOp.{_NAMES[name]} needs an integer or "
                                    f"bool tensor, got {dtype}")
    if name == "average" and dtype == torch.bool:
        raise UnsupportedDTypeError(f"{what}: ReduceOp.AVG is not defined for bool tensors")
    return name, 1.0


def one(tensors: Sequence[torch.Tensor], what: str) -> torch.Tensor:
    """The single tensor of a per-device list (lists of several tensors are not supported)."""
    if len(tensors) != 1:
        raise InvalidArgumentError(f"{what}: expected a list of exactly one tensor, got "
                                   f"{len(tensors)} (one tensor per process)")
    t = tensors[0]
    if not isinstance(t, torch.Tensor):
        raise InvalidArgumentError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    return t


def same_dtype(tensors: Sequence[torch.Tensor], dtype: torch.dtype, what: str) -> None:
    for i, t in enumerate(tensors):
        if t.dtype != dtype:
            raise InvalidArgumentError(f"{what}: tensor {i} has dtype {t.dtype}, the input has "
                                       f"{dtype}")


def root(rank: int, size: int, option: str, what: str) -> int:
    rank = int(rank)
    if not 0 <= rank < size:
        raise InvalidArgumentError(f"{what}: {option} {rank} is out of range for a group of "
                                   f"{size} ranks")
    return rank


def root_tensor(opts: Any, what: str) -> None:
    if getattr(opts, "rootTensor", 0) != 0:
        raise InvalidArgumentError(f"{what}: rootTensor={opts.rootTensor} is not supported "
                                   f"(one tensor per process)")


def timeout_of(opts: Any, default: float) -> float:
    """The option's timeout in seconds, or the group's when unset (torch passes -1 ms)."""
    t = getattr(opts, "timeout", None)
    if isinstance(t, timedelta) and t.total_seconds() > 0:
        return t.total_seconds()
    return default


_NP = {torch.uint8: np.uint8, torch.int8: np.int8, torch.int16: np.int16,
       torch.int32: np.int32, torch.int64: np.int64, torch.float16: np.float16,
       torch.float32: np.float32, torch.float64: np.float64, torch.bool: np.bool_,
       torch.bfloat16: dtypes.BFLOAT16}
_NP = {k: np.dtype(v) for k, v in _NP.items()}


def view(t: torch.Tensor) -> np.ndarray:
    """A NumPy array on the memory of the contiguous CPU tensor ``t`` (no copy).

    Built from the data pointer rather than ``Tensor.numpy()``, which marks the tensor's
    storage as never resizable again (DDP's bucket buffers are resized by torch's batched
    PowerSGD hook). The array keeps ``t`` alive, as ``numpy()`` does.
    """
    dt = _NP[t.dtype]
    nbytes = t.numel() * dt.itemsize
    if nbytes == 0:
        return np.empty(tuple(t.shape), dt)
    raw = (ctypes.c_uint8 * nbytes).from_address(t.data_ptr())
    raw._tensor = t           # the array's base holds the tensor
    return np.frombuffer(raw, dtype=dt).reshape(tuple(t.shape))


def stage(t: torch.Tensor, what: str) -> Staged:
    """``t`` for the core: a view when it is a contiguous CPU tensor, else a CPU copy that
    ``Staged.finish()`` writes back."""
    if type(t) is torch.Tensor and t.dtype in _NP and t.layout == torch.strided \
            and not t.is_cuda and t.is_contiguous():          # the common case, checked fast
        return Staged(t, t, view(t), False)
    if not isinstance(t, torch.Tensor):
        raise TensorTypeError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    check_dtype(t, what)
    if t.is_sparse:
        raise TensorTypeError(f"{what}: sparse tensors are not supported")
    if t.device.type == "cpu" and t.is_contiguous():
        return Staged(t, t, view(t), False)
    work = t.detach().to("cpu", copy=True).contiguous()
    return Staged(t, work, view(work), True)


def cpu_flat(t: torch.Tensor, what: str) -> np.ndarray:
    """``t`` as a 1-D array: a view of a contiguous CPU tensor, else a contiguous CPU copy."""
    return stage(t, what).array.reshape(-1)


def copy_into(dst: torch.Tensor, src: np.ndarray) -> None:
    """``dst[...] = src`` (same number of elements) for any device and layout of ``dst``."""
    from .._tensor import from_array

    with torch.no_grad():
        dst.copy_(from_array(np.ascontiguousarray(src)).reshape(dst.shape))
