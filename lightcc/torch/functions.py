"""Model/optimizer state helpers: ``broadcast_parameters``, ``broadcast_optimizer_state``,
and (from :mod:`.objects`) ``broadcast_object`` and ``allgather_object`` (Horovod's names and
arguments).
"""
from __future__ import annotations

import collections
from typing import Any, Iterable

import torch

from ..common import api as _api
from ..common.api import global_process_set
from . import collectives as _ops
from .objects import allgather_object, broadcast_object
from .optimizer.wrapper import WrappedOptimizer


def broadcast_parameters(params: Any, root_rank: int,
                         process_set: Any = global_process_set) -> None:
    """Copy ``root_rank``'s parameters into every rank's tensors, in place.

    ``params`` is a ``model.state_dict()`` (dict, broadcast in sorted key order), a list of
    ``(name, tensor)`` pairs (``model.named_parameters()``) or of tensors. ``root_rank`` is a
    global rank; ``process_set`` (a lightcc extension) limits the copy to that set's members.
    """
    if isinstance(params, dict):
        items = sorted(params.items())
    elif isinstance(params, Iterable) and not isinstance(params, (str, torch.Tensor)):
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError(f"invalid params of type: {type(params)}")
    _api.root_index(root_rank, process_set, "broadcast_parameters")
    handles = [_ops.broadcast_async_(p, root_rank, name, process_set) for name, p in items]
    for handle in handles:
        _ops.synchronize(handle)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int,
                              model: torch.nn.Module | None = None,
                              process_set: Any = global_process_set) -> None:
    """Make every rank's optimizer state (tensors, scalars and options like ``lr``) equal
    ``root_rank``'s. A fresh optimizer gets its state created first (one step on zero
    gradients, without communication), so this works before the first ``step()``. Python
    types of options and scalar state are kept (they travel pickled). An optimizer still
    without state after that step (SGD without momentum) is left alone, options included, as
    in Horovod. ``root_rank`` is a global rank; ``process_set`` (a lightcc extension) limits
    it to that set's members."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    _api.root_index(root_rank, process_set, "broadcast_optimizer_state")
    state_dict = optimizer.state_dict()
    if len(state_dict["state"]) == 0:
        _init_state(optimizer, model)
        state_dict = optimizer.state_dict()
    if len(state_dict["state"]) == 0:
        return   # stateless optimizer (plain SGD): only the options below matter
    tensors: list[tuple[str, torch.Tensor]] = []
    scalars: dict[str, Any] = {}
    setters: dict[str, Any] = {}
    seen: dict[str, int] = collections.defaultdict(int)
    for index, group in enumerate(state_dict["param_groups"]):
        for key, value in group.items():
            if key != "params":
                scalars[f"{key}.{index}"] = value
                setters[f"{key}.{index}"] = _option_setter(optimizer, index, key)
        for pid in group["params"]:
            for name, value in state_dict["state"].get(pid, {}).items():
                seen[name] += 1
                key = f"{name}.{seen[name]}"
                if torch.is_tensor(value):
                    tensors.append((key, value))
                else:
                    scalars[key] = value
                    setters[key] = _state_setter(state_dict["state"][pid], name)
    broadcast_parameters(tensors, root_rank, process_set)
    for key, value in broadcast_object(scalars, root_rank, name="optimizer_state",
                                       process_set=process_set).items():
        setters[key](value)


def _init_state(optimizer: torch.optim.Optimizer, model: torch.nn.Module | None) -> None:
    """Create the optimizer's state by stepping the wrapped optimizer on zero gradients."""
    sparse = set()
    if model is not None:
        for m in model.modules():
            if isinstance(m, torch.nn.Embedding) and m.sparse:
                sparse.update(id(p) for p in m.parameters())
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
                if isinstance(optimizer, torch.optim.SparseAdam) or id(p) in sparse:
                    p.grad = p.grad.to_sparse()
    # A DistributedOptimizer's own step() would allreduce: step the wrapped one instead.
    inner = optimizer.wrapped if isinstance(optimizer, WrappedOptimizer) else optimizer
    inner.step()


def _option_setter(optimizer: torch.optim.Optimizer, index: int, key: str) -> Any:
    def assign(value: Any) -> None:
        optimizer.param_groups[index][key] = value
    return assign


def _state_setter(param_state: dict, name: str) -> Any:
    def assign(value: Any) -> None:
        param_state[name] = value
    return assign


__all__ = ["allgather_object", "broadcast_object", "broadcast_optimizer_state",
           "broadcast_parameters"]
