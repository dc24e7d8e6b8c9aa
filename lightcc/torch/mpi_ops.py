"""horovod.torch.mpi_ops under lightcc: every tensor collective, under Horovod's module name.

The asynchronous and in-place forms and the handle table are in :mod:`.collectives`; the
differentiable blocking forms (``allreduce``, ``allgather``, ...) in :mod:`.autograd`, which
builds on :mod:`.collectives`. This module only gathers them (it imports both; neither
imports it).
"""
from __future__ import annotations

from ..common.api import (Adasum, Average, Max, Min, ProcessSet, Product, Sum,
                          add_process_set, global_process_set, remove_process_set)
from ..common.exceptions import HorovodInternalError
from .autograd import (allgather, allreduce, alltoall, broadcast, grouped_allgather,
                       grouped_allreduce, grouped_reducescatter, reducescatter)
from .collectives import (allgather_async, allreduce_, allreduce_async, allreduce_async_,
                          alltoall_async, barrier, broadcast_, broadcast_async,
                          broadcast_async_, grouped_allgather_async, grouped_allreduce_,
                          grouped_allreduce_async, grouped_allreduce_async_,
                          grouped_reducescatter_async, handle_average_backwards_compatibility,
                          join, poll, reducescatter_async, sparse_allreduce_async, synchronize)
from .compression import spec_of

__all__ = [
    "Adasum", "Average", "HorovodInternalError", "Max", "Min", "ProcessSet", "Product", "Sum",
    "add_process_set", "allgather", "allgather_async", "allreduce", "allreduce_",
    "allreduce_async", "allreduce_async_", "alltoall", "alltoall_async", "barrier",
    "broadcast", "broadcast_", "broadcast_async", "broadcast_async_", "global_process_set",
    "grouped_allgather", "grouped_allgather_async", "grouped_allreduce", "grouped_allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_reducescatter",
    "grouped_reducescatter_async", "handle_average_backwards_compatibility", "join", "poll",
    "reducescatter", "reducescatter_async", "remove_process_set", "sparse_allreduce_async",
    "spec_of", "synchronize",
]
