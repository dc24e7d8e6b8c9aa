"""``DistributedOptimizer(op=Adasum)``: Horovod's Adasum optimizer, which reduces the wrapped
optimizer's parameter *update* (delta), not the gradient.

Horovod's documented step (docs/adasum_user_guide.rst, "The Distributed Optimizer for AdaSum"),
per parameter ``p``, as soon as its gradient of the last backward pass has been accumulated:

1. ``start = p``; the wrapped optimizer steps ``p`` alone with this rank's own gradient (its
   state, e.g. momentum, stays local to the rank);
2. ``delta = p - start`` is reduced with ``op=Adasum`` over the ranks (through a per-tensor
   compressor's ``compress``/``decompress`` when one is given);
3. in ``step()``: ``p = start + adasum(delta)``.

Adasum works on the full magnitude of the update, which is why the delta, not the gradient, is
reduced; there is no averaging and no learning-rate scaling by the number of ranks. Parameters
whose gradient never arrived are stepped (with a zero gradient when they have none) and reduced
in ``step()``. ``synchronize()`` does nothing and ``skip_synchronize()`` raises, as in Horovod.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from ...common.api import Adasum, global_process_set
from ...common.exceptions import InvalidArgumentError
from .. import mpi_ops as _ops
from ..compression import Compression, per_tensor, spec_of
from .barrier import BarrierOptimizer


@dataclass(eq=False, slots=True)
class _Delta:
    """The Adasum reduction of one parameter's update: the torch API's handle and the
    per-tensor compressor's context (None without one)."""

    handle: int
    ctx: Any


class _DistributedAdasumOptimizer(BarrierOptimizer):
    """See the module docstring and :func:`lightcc.torch.DistributedOptimizer`."""

    def __init__(self, optimizer: torch.optim.Optimizer, named_parameters: Any,
                 compression: Any, backward_passes_per_step: int) -> None:
        self._start: dict = {}           # parameter -> its value before the local step
        self._deltas: dict = {}          # parameter -> its _Delta, started this step
        super().__init__(optimizer, named_parameters, compression, backward_passes_per_step,
                         Adasum, 1.0, None, False, global_process_set)

    @property
    def step_pending(self) -> bool:
        return bool(self._deltas) or super().step_pending

    def on_gradient(self, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook: after the last backward pass, step ``p`` locally and
        start the Adasum reduction of its update."""
        if p in self._deltas:
            raise AssertionError("Gradients were computed more than backward_passes_per_step "
                                 "times before call to step(). Increase "
                                 "backward_passes_per_step to accumulate gradients locally.")
        if self.count_pass(p):
            self._deltas[p] = self._submit_delta(p)

    def _step_alone(self, p: torch.Tensor) -> None:
        """The wrapped optimizer's step on ``p`` only (the other parameters hidden from it)."""
        saved = [group["params"] for group in self.param_groups]
        try:
            for group in self.param_groups:
                group["params"] = [p] if any(q is p for q in group["params"]) else []
            self.wrapped.step()
        finally:
            for group, params in zip(self.param_groups, saved):
                group["params"] = params

    def _submit_delta(self, p: torch.Tensor) -> _Delta:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        start = self._start.get(p)
        if start is None:
            start = self._start[p] = torch.empty_like(p, requires_grad=False)
        start.copy_(p.data)
        self._step_alone(p)
        p.data.sub_(start)                     # p holds the delta until step()
        reducer = self.reducer
        if reducer.spec is None:               # Horovod-style per-tensor compressor
            delta, ctx = reducer.compression.compress(p.data)
        else:
            delta, ctx = p.data, None
        return _Delta(_ops.allreduce_async_(delta, name=reducer.names[p], op=Adasum), ctx)

    def synchronize(self) -> None:
        """Nothing to do: Adasum's reductions are finished by ``step()`` (as in Horovod)."""

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        raise AssertionError("Skipping synchronization is not supported when using Adasum "
                             "optimizer.")
        yield  # pragma: no cover - makes this a generator

    def step(self, closure: Any = None) -> Any:
        """Reduce every parameter's update with Adasum and apply it (``p = start + delta``)."""
        loss = closure() if closure is not None else None
        deltas, reducer = self._deltas, self.reducer
        try:
            for p in self.watched:
                if p not in deltas:            # no gradient (or too few passes) yet: do it now
                    deltas[p] = self._submit_delta(p)
            for p, pending in deltas.items():
                delta = _ops.synchronize(pending.handle)
                if reducer.spec is None:
                    delta = reducer.compression.decompress(delta, pending.ctx)
                start = self._start[p]
                start.add_(delta.to(start.dtype))
                p.data.copy_(start)
        finally:
            deltas.clear()
            self.restart_counts()
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        self._deltas.clear()
        super().load_state_dict(state_dict)


def adasum_optimizer(optimizer: torch.optim.Optimizer, named_parameters: Any, compression: Any,
                     backward_passes_per_step: int, process_set: Any,
                     groups: Any) -> _DistributedAdasumOptimizer:
    """``DistributedOptimizer(op=Adasum)`` on more than one rank (checks what it supports)."""
    if process_set is not global_process_set:
        raise InvalidArgumentError("DistributedOptimizer(op=Adasum) supports the global process "
                                   "set only (as in Horovod)")
    if groups is not None:
        raise InvalidArgumentError("DistributedOptimizer(op=Adasum) reduces each parameter "
                                   "alone: groups/num_groups are not supported")
    spec = spec_of(compression)
    if spec in ("fp16", "bf16"):    # a cast, applied per tensor as Horovod applies it
        compression = per_tensor(getattr(Compression, spec))
    elif spec not in (None, "none"):
        raise InvalidArgumentError(
            f"DistributedOptimizer(op=Adasum): compression must be Compression.none, .fp16, "
            f".bf16 or a per-tensor Horovod-style compressor, got {compression!r}")
    return _DistributedAdasumOptimizer(optimizer, named_parameters, compression,
                                       backward_passes_per_step)

