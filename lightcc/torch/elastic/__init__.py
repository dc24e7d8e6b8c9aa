"""Elastic training for PyTorch with Horovod's names (``import lightcc.torch.elastic`` where a
Horovod script has ``horovod.torch.elastic``; ``hvd.elastic.run`` is ``lightcc.torch.elastic.run``).

A rank that dies (``kill -9``, a lost host) no longer ends the job when it was launched with
fault tolerance (``lccrun --min-np N``, or ``mpirun --with-ft ulfm``): the survivors roll back
to the last ``state.commit()``, re-form the group among themselves (shrink in place), sync the
state from the new rank 0 and call the training function again. See docs/elastic.md.
"""
from __future__ import annotations

from ...common.elastic import (ElasticError, HostsUpdatedInterrupt, ObjectState, State,
                               reset, run_fn)
from .sampler import ElasticSampler
from .state import TorchState


def run(func):
    """Decorate ``func(state, *args, **kwargs)``, Horovod's ``hvd.elastic.run``: the state is
    synced from rank 0 first; when a rank dies inside ``func`` the survivors restore the last
    commit, re-form the group, run the reset callbacks, sync and call ``func`` again."""
    return run_fn(func, reset)


__all__ = ["ElasticError", "ElasticSampler", "HostsUpdatedInterrupt", "ObjectState", "State",
           "TorchState", "run"]
