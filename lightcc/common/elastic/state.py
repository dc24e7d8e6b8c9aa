"""Horovod's elastic state objects on lightcc's core (NumPy arrays and Python objects).

A *state* is what training resumes from after the group changed: ``commit()`` copies it into
host memory, ``restore()`` puts the last commit back (after a failed step), ``sync()`` gives
every rank rank 0's copy (after the group was re-formed). The torch layer
(``lightcc.torch.elastic``) adds models, optimizers, schedulers and the ``ElasticSampler``.
"""
from __future__ import annotations

import copy
import os
import pickle
from typing import Any, Callable

import numpy as np

from ... import _exit
from ..api import collectives, state as api_state
from . import hosts

STATUS_DIR_ENV = _exit.STATUS_DIR_ENV       # lccrun's status directory (hosts.json)


class HostsUpdatedInterrupt(RuntimeError):
    """Raised by :meth:`State.check_host_updates` when the job's hosts changed (Horovod's name).

    ``skip_sync``: every rank still holds the same state, so ``run`` skips the sync after the
    reset."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("the job's hosts changed")
        self.skip_sync = skip_sync


def broadcast_object(obj: Any, root_rank: int = 0, name: str = "elastic.object") -> Any:
    """Rank ``root_rank``'s picklable ``obj`` on every rank (two broadcasts: size, bytes)."""
    is_root = api_state.rank() == root_rank
    payload = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8) \
        if is_root else None
    size = np.array([payload.size if is_root else 0], np.int64)
    size = collectives.broadcast(size, root_rank, f"{name}.size")
    data = payload.copy() if is_root else np.empty(int(size[0]), np.uint8)
    data = collectives.broadcast(data, root_rank, f"{name}.bytes")
    return obj if is_root else pickle.loads(data.tobytes())


class State:
    """What elastic training tracks across membership changes (Horovod's ``State``).

    Subclasses implement ``save``, ``restore`` and ``sync``. ``bcast_object`` and ``get_rank``
    default to lightcc's own.
    """

    def __init__(self, bcast_object: Callable[..., Any] | None = None,
                 get_rank: Callable[[], int] | None = None) -> None:
        self._bcast_object = bcast_object or broadcast_object
        self._rank = get_rank or api_state.rank
        self._reset_callbacks: list[Callable[[], Any]] = []
        self._host_updates: list[float] = []
        self._last_updated = 0.0

    def register_reset_callbacks(self, callbacks: list[Callable[[], Any]]) -> None:
        """Functions called (in order) after every reset, i.e. once the group was re-formed:
        e.g. scale the learning rate to the new ``size()``."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Called by ``run`` after a reset: forget pending host notices, run the callbacks."""
        self._host_updates.clear()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp: float) -> None:
        """Record a host-change notice (checked at the next ``check_host_updates``)."""
        self._host_updates.append(timestamp)

    def commit(self) -> None:
        """Copy the state into host memory (what a failure rolls back to), then
        :meth:`check_host_updates`. A copy costs time: commit every few steps, not each."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise :class:`HostsUpdatedInterrupt` on every rank, at the same commit, when any
        rank was told of a host change since the last check: a notice posted with
        :meth:`on_hosts_updated`, or a new host list published by lccrun (polling
        ``--host-discovery-script``; docs/elastic.md).

        One small max-allreduce of (new notice on this rank, newest host-list version seen),
        so that every rank decides alike, even one that joined since (Horovod broadcasts rank
        0's notices, so a notice seen only by another rank was lost)."""
        fresh = any(t > self._last_updated for t in self._host_updates)
        self._last_updated = max([self._last_updated, *self._host_updates])
        self._host_updates.clear()
        version = hosts.published(os.environ.get(STATUS_DIR_ENV))
        if api_state.is_initialized() and api_state.size() > 1:
            fresh, version = collectives.allreduce(np.array([float(fresh), float(version)]),
                                                   op=api_state.Max)
        if fresh or version > hosts.Seen.version:
            raise HostsUpdatedInterrupt(skip_sync=False)

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError


class ObjectState(State):
    """State made of keyword arguments, each exposed as an attribute (Horovod's
    ``ObjectState``): ``ObjectState(epoch=0, weights=np.zeros(10))``.

    ``save`` deep-copies the attributes (so a NumPy array updated in place after the commit
    does not change the commit: Horovod keeps references); ``sync`` broadcasts rank 0's
    committed values, pickled.
    """

    def __init__(self, bcast_object: Callable[..., Any] | None = None,
                 get_rank: Callable[[], int] | None = None, **kwargs: Any) -> None:
        self._saved_state = copy.deepcopy(kwargs)
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self) -> None:
        self._saved_state = {k: copy.deepcopy(getattr(self, k)) for k in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self.save()
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for name, value in self._saved_state.items():
            setattr(self, name, copy.deepcopy(value))
