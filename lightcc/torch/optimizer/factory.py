"""``DistributedOptimizer(...)``: horovod.torch's factory, its checks and its defaults.

The optimizer it returns is a :class:`~.barrier.BarrierOptimizer` (how gradients are reduced
while backward runs is described there), a :class:`~.cross_barrier.CrossBarrierOptimizer`
(``cross_barrier=True``) or, for ``op=Adasum`` on more than one rank, :mod:`.adasum`'s.
"""
from __future__ import annotations

import warnings
from typing import Any

import torch

from ...common import api as _api
from ...common.api import Adasum, Average, global_process_set
from ...common.exceptions import InvalidArgumentError
from ..compression import Compression
from .barrier import BarrierOptimizer


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters: Any = None,
                         compression: Any = None, backward_passes_per_step: int = 1,
                         op: Any = Average, gradient_predivide_factor: float = 1.0,
                         num_groups: int = 0, groups: Any = None, sparse_as_dense: bool = False,
                         process_set: Any = global_process_set, cross_barrier: bool = False,
                         model: Any = None) -> BarrierOptimizer:
    """Wrap ``optimizer`` so that ``step()`` applies gradients averaged over all ranks.

    Arguments follow ``horovod.torch.DistributedOptimizer``: ``named_parameters`` (names for
    the allreduces, usually ``model.named_parameters()``; must be unique and cover every
    parameter), ``compression`` (a ``Compression`` value, applied by the engine per fused
    bucket, or a Horovod-style compressor applied per tensor; when not given, the default set
    by ``LCC_COMPRESSION`` / ``lccrun --compression``, else none), ``backward_passes_per_step`` (local accumulation before reducing; gradients are
    summed over passes, not averaged), ``op`` (Average or Sum; Adasum reduces parameter
    updates instead, see ``torch/optimizer/adasum.py``), ``gradient_predivide_factor``
    (scale by 1/f before the sum and f/size after; Average only), ``groups``/``num_groups``
    (reduce these parameters together), ``sparse_as_dense`` and ``process_set``. Call
    ``synchronize()`` before modifying gradients (clipping, ``GradScaler.unscale_``), then
    ``step()`` inside ``skip_synchronize()``. ``cross_barrier=True`` (needs ``model``, the
    module whose forward reads the parameters) lets the next forward start before every
    reduction finished: each module's update is applied just before its forward, exactly as
    ``step()`` would have applied it (docs/cross-barrier.md).
    """
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be "
                      "removed.", DeprecationWarning, stacklevel=2)
        if groups is None:
            groups = num_groups
    if groups is not None:
        _check_groups(groups)
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    if isinstance(optimizer, BarrierOptimizer):
        raise ValueError("optimizer is already a DistributedOptimizer")
    if compression is None:
        compression = default_compression()
    if cross_barrier:
        if not isinstance(model, torch.nn.Module):
            raise InvalidArgumentError("cross_barrier=True needs model=<the torch.nn.Module "
                                       "whose forward reads these parameters>: its modules' "
                                       f"forward pre-hooks apply the updates (got {model!r})")
        if op == Adasum:
            raise InvalidArgumentError("cross_barrier=True does not support op=Adasum (Adasum "
                                       "reduces the optimizer's parameter deltas at step())")
        from .cross_barrier import CrossBarrierOptimizer
        return CrossBarrierOptimizer(optimizer, model, named_parameters, compression,
                                     backward_passes_per_step, op, gradient_predivide_factor,
                                     groups, sparse_as_dense, process_set)
    if model is not None:
        raise InvalidArgumentError("model= is only used with cross_barrier=True")
    if op == Adasum and _api.size() > 1:      # reduces parameter deltas: adasum.py
        from .adasum import adasum_optimizer
        return adasum_optimizer(optimizer, named_parameters, compression,
                                backward_passes_per_step, process_set, groups)
    return BarrierOptimizer(optimizer, named_parameters, compression,
                                 backward_passes_per_step, op, gradient_predivide_factor, groups,
                                 sparse_as_dense, process_set)


def default_compression() -> Any:
    """The compressor ``DistributedOptimizer`` uses when given none: ``LCC_COMPRESSION`` (or
    ``lccrun --compression``, or ``init(compression=...)``) as a spec string, else
    ``Compression.none``."""
    spec = _api.config().compression
    return Compression.none if spec in ("", "none") else spec


def _check_groups(groups: Any) -> None:
    if isinstance(groups, list):
        seen = set()
        for group in groups:
            for p in group:
                if not isinstance(p, torch.Tensor):
                    raise ValueError("groups must consist of torch.Tensor.")
                if id(p) in seen:
                    raise ValueError("A parameter can only appear once in groups.")
                seen.add(id(p))
    elif not (isinstance(groups, int) and groups > 0):
        raise ValueError("groups should be a non-negative integer or a list of list of "
                         "torch.Tensor.")
