"""What ``DistributedOptimizer`` sets up once: the wrapper that stands for the wrapped torch
optimizer, the allreduce name of every parameter and the explicit parameter groups.

:class:`WrappedOptimizer` subclasses ``torch.optim.Optimizer`` (so ``isinstance``, LR
schedulers and ``torch.amp.GradScaler`` accept it) without calling its ``__init__``: the
wrapped optimizer owns ``param_groups``, ``state`` and ``defaults``, and any attribute the
wrapper lacks is read from it. Names and groups follow ``horovod.torch``'s rules.
"""
from __future__ import annotations

from typing import Any

import torch

from ...common import api as _api
from ..objects import broadcast_object


class WrappedOptimizer(torch.optim.Optimizer):
    """An optimizer that delegates its state to ``self._opt`` (set by the subclass)."""

    _opt: torch.optim.Optimizer

    @property
    def wrapped(self) -> torch.optim.Optimizer:
        """The torch optimizer this wrapper stands for (its ``step()`` does no allreduce)."""
        return self._opt

    @property
    def param_groups(self) -> list[dict]:
        return self._opt.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict]) -> None:
        self._opt.param_groups = value

    @property
    def state(self) -> Any:
        return self._opt.state

    @state.setter
    def state(self, value: Any) -> None:
        self._opt.state = value

    @property
    def defaults(self) -> dict:
        return self._opt.defaults

    @defaults.setter
    def defaults(self, value: dict) -> None:
        self._opt.defaults = value

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes this wrapper lacks (torch internals such as hook dicts).
        if name == "_opt":
            raise AttributeError(name)
        return getattr(self._opt, name)

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self._opt!r})"


def parameter_names(named_parameters: Any, param_groups: list[dict]) -> dict:
    """{parameter: allreduce name}: ``named_parameters`` (unique names covering every
    parameter, else ``ValueError`` as in Horovod), or ``allreduce.noname.<group>.<index>``."""
    if named_parameters is not None:
        named = list(named_parameters)
    else:
        named = [(f"allreduce.noname.{i}.{j}", p)
                 for i, group in enumerate(param_groups)
                 for j, p in enumerate(group["params"])]
    if any(not isinstance(item, tuple) for item in named):
        raise ValueError("named_parameters should be a sequence of tuples (name, "
                         "parameter), usually produced by model.named_parameters().")
    seen, dups = set(), set()
    for name, _ in named:
        (dups if name in seen else seen).add(name)
    if dups:
        raise ValueError("Parameter names in named_parameters must be unique. Found "
                         f"duplicates: {', '.join(sorted(dups))}")
    all_ids = {id(p) for group in param_groups for p in group["params"]}
    unnamed = all_ids - {id(p) for _, p in named}
    if unnamed:
        raise ValueError("named_parameters was specified, but one or more model "
                         f"parameters were not named ({len(unnamed)} of "
                         f"{len(all_ids)}). Python object ids: "
                         f"{', '.join(str(i) for i in sorted(unnamed))}")
    return {p: name for name, p in sorted(named, key=lambda item: item[0])}


def split_groups(params: list[torch.Tensor], groups: Any, names: dict,
                 process_set: Any) -> list[tuple]:
    """Explicit groups (``groups``: a count, or lists of parameters): every rank orders
    ``params`` like the set's first member, then splits them; parameters no list names are
    groups of one."""
    order_names = broadcast_object([names[p] for p in params],
                                   root_rank=_api.process_set_ranks(process_set)[0],
                                   name="lightcc.optimizer.groups", process_set=process_set)
    order = {name: i for i, name in enumerate(order_names)}
    params = sorted(params, key=lambda p: order.get(names[p], len(order)))
    if isinstance(groups, list):
        grouped, done = [], set()
        wanted = {id(p) for p in params}
        for group in groups:
            members = tuple(p for p in group if id(p) in wanted)
            if members:
                grouped.append(members)
            done.update(id(p) for p in members)
        return grouped + [(p,) for p in params if id(p) not in done]
    k = max(1, min(int(groups), len(params)))
    bounds = [round(i * len(params) / k) for i in range(k + 1)]
    return [tuple(params[a:b]) for a, b in zip(bounds, bounds[1:]) if b > a]
