"""``TorchState``: models, optimizers, learning-rate schedulers and ``ElasticSampler``s tracked
by elastic training (Horovod's documented semantics on lightcc's core ``ObjectState``)."""
from __future__ import annotations

import copy
from typing import Any

import torch

from ...common.elastic import ObjectState
from ..functions import broadcast_optimizer_state, broadcast_parameters
from ..objects import broadcast_object
from .sampler import ElasticSampler


class _Handler:
    """Commit / restore / sync of one tracked object through its ``state_dict``."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self.save()

    def save(self) -> None:
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self._saved)

    def sync(self) -> None:
        self.value.load_state_dict(broadcast_object(self.value.state_dict(),
                                                    name="elastic.state_dict"))


class _ModelHandler(_Handler):
    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class _OptimizerHandler(_Handler):
    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=0)


_HANDLERS: list[tuple[type, type]] = [
    (torch.nn.Module, _ModelHandler),
    (torch.optim.Optimizer, _OptimizerHandler),
    (torch.optim.lr_scheduler.LRScheduler, _Handler),
    (ElasticSampler, _Handler),
]


def _handler(value: Any) -> _Handler | None:
    for kind, handler in _HANDLERS:
        if isinstance(value, kind):
            return handler(value)
    # lightcc's DistributedOptimizer wraps a torch optimizer without subclassing it
    if hasattr(value, "synchronize") and hasattr(value, "load_state_dict") \
            and hasattr(value, "param_groups"):
        return _OptimizerHandler(value)
    return None


class TorchState(ObjectState):
    """The state of a PyTorch training process (Horovod's ``TorchState``).

    ``TorchState(model, optimizer, sampler=..., epoch=0, batch=0)``: every keyword becomes an
    attribute. Models, optimizers, LR schedulers and ``ElasticSampler``s are committed as
    deep copies of their ``state_dict`` and synced from rank 0 (parameters and optimizer state
    by broadcast, the others pickled); anything else is a plain object (``ObjectState``).
    Assigning a new model or optimizer to the attribute commits it.
    """

    def __init__(self, model: Any = None, optimizer: Any = None, **kwargs: Any) -> None:
        kwargs.update(model=model, optimizer=optimizer)
        handlers, plain = {}, {}
        for name, value in kwargs.items():
            h = _handler(value) if value is not None else None
            if h is None:
                plain[name] = value
            else:
                handlers[name] = h
        object.__setattr__(self, "_handlers", handlers)
        for name, h in handlers.items():
            object.__setattr__(self, name, h.value)
        super().__init__(bcast_object=lambda obj: broadcast_object(obj, name="elastic.objects"),
                         **plain)

    def save(self) -> None:
        for h in self._handlers.values():
            h.save()
        super().save()

    def restore(self) -> None:
        for h in self._handlers.values():
            h.restore()
        super().restore()

    def sync(self) -> None:
        for h in self._handlers.values():
            h.sync()
        super().sync()

    def __setattr__(self, name: str, value: Any) -> None:
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers:
            handlers[name].value = value
            handlers[name].save()
        super().__setattr__(name, value)
