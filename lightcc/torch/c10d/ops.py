"""Argument translation for the lightcc process group: reduce ops, options, tensor lists.

Everything here runs on the calling thread before anything is submitted, so a bad argument
raises at once (naming the collective and the option) instead of failing later on one rank.
"""
from __future__ import annotations

import functools
from datetime import timedelta
from typing import Any, Sequence

import numpy as np
import torch
import torch.distributed as dist

from ...common.exceptions import InvalidArgumentError, UnsupportedDTypeError
from .._tensor import Staged, host_stage, stage

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


def cpu_flat(t: torch.Tensor, what: str) -> np.ndarray:
    """``t`` as a 1-D array: a view of a contiguous CPU tensor, else a contiguous CPU copy."""
    return host_stage(t, what).array.reshape(-1)


@functools.lru_cache(maxsize=None)
def _gpu_path() -> bool:
    from ...common.kernels import cuda as kc

    return kc.gpu_available()


def device_stage(t: torch.Tensor, what: str) -> Staged:
    """A CUDA tensor as a zero-copy device array for the engine's device path (NCCL, or MPI
    through pinned memory where NCCL is unusable; its ready event recorded on torch's current
    stream) when CuPy sees a GPU; everything else as :func:`host_stage` does."""
    if getattr(getattr(t, "device", None), "type", None) == "cuda" and _gpu_path():
        return stage(t, what, cuda=True, resizable=True)
    return host_stage(t, what)
