"""Elastic training on lightcc's core (Horovod's ``elastic`` API): the state objects and
``run``; the torch layer adds ``TorchState`` and ``ElasticSampler`` (lightcc.torch.elastic).
See docs/elastic.md."""
from __future__ import annotations

from .recovery import ElasticError, is_peer_failure, launch_number, reset, run, run_fn
from .state import HostsUpdatedInterrupt, ObjectState, State, broadcast_object

__all__ = ["ElasticError", "HostsUpdatedInterrupt", "ObjectState", "State", "broadcast_object",
           "is_peer_failure", "launch_number", "reset", "run", "run_fn"]
