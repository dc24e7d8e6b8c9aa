"""``DistributedOptimizer``: one optimizer, its modules named for what they do.

- :mod:`.factory`: ``DistributedOptimizer(...)``, horovod.torch's checks and defaults; picks
  one of the three optimizers below;
- :mod:`.wrapper`: the wrapper that stands for the wrapped torch optimizer, the allreduce
  name of every parameter, the explicit groups;
- :mod:`.reducer`: how one gradient goes to the engine and comes back
  (``GradientReducer``, ``PendingGradient``);
- :mod:`.barrier`: ``BarrierOptimizer``, the gradient hooks, ``synchronize()`` and ``step()``
  (every reduction finished before the wrapped optimizer steps);
- :mod:`.cross_barrier`: ``cross_barrier=True``, each module's update applied just before its
  next forward, built on ``BarrierOptimizer``'s public surface;
- :mod:`.adasum`: ``op=Adasum``, which reduces parameter updates instead of gradients.
"""
from __future__ import annotations

from .factory import DistributedOptimizer, default_compression

__all__ = ["DistributedOptimizer", "default_compression"]
