"""lightcc for PyTorch: the ``horovod.torch`` (0.28) API on top of lightcc's engine.

``import lightcc.torch as hvd`` is meant to run a Horovod training script unchanged: the same
function names, argument names and defaults, averaging by default, in-place ``*_`` variants,
integer handles for ``poll``/``synchronize``, ``DistributedOptimizer``, the broadcast helpers
and ``SyncBatchNorm``. See docs/torch.md ("Differences from Horovod") for the few deliberate
differences and the options that restore Horovod's behaviour. Importing it also registers
the torch.distributed backend ``"lightcc"`` (docs/torch-distributed.md).
"""
from __future__ import annotations

from ..common.api import (Adasum, Average, Max, Min, ProcessSet, Product, Sum, add_process_set,
                          global_process_set, metrics, remove_process_set)
from ..common.exceptions import HorovodInternalError
from .basics import (ccl_built, cross_rank, cross_size, cuda_built, ddl_built, gloo_built,
                     gloo_enabled, init, is_homogeneous, is_initialized, local_rank, local_size,
                     mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, rank, rocm_built,
                     shutdown, size, start_timeline, stop_timeline)
from .compression import Compression
from .functions import (allgather_object, broadcast_object, broadcast_optimizer_state,
                        broadcast_parameters)
from .mpi_ops import (allgather, allgather_async, allreduce, allreduce_, allreduce_async,
                      allreduce_async_, alltoall, alltoall_async, barrier, broadcast, broadcast_,
                      broadcast_async, broadcast_async_, grouped_allgather,
                      grouped_allgather_async, grouped_allreduce, grouped_allreduce_,
                      grouped_allreduce_async, grouped_allreduce_async_, grouped_reducescatter,
                      grouped_reducescatter_async, join, poll, reducescatter,
                      reducescatter_async, sparse_allreduce_async, synchronize)
from .autograd import gradient_semantics, set_gradient_semantics
from .metrics_writer import metrics_writer
from .optimizer import DistributedOptimizer
from .sync_batch_norm import SyncBatchNorm
from . import c10d as _c10d
from . import profiler_ranges as _profiler_ranges
from . import elastic   # hvd.elastic.run, hvd.elastic.TorchState, ... as in horovod.torch

_c10d.register()   # the torch.distributed backend "lightcc"
_profiler_ranges.install()   # engine phases as torch.profiler ranges (docs/timeline.md)

__all__ = [
    "Adasum", "Average", "Compression", "DistributedOptimizer", "HorovodInternalError", "Max",
    "Min", "ProcessSet", "Product", "Sum", "SyncBatchNorm", "add_process_set",
    "allgather", "allgather_async", "allgather_object", "allreduce", "allreduce_",
    "allreduce_async", "allreduce_async_", "alltoall", "alltoall_async", "barrier",
    "broadcast", "broadcast_", "broadcast_async", "broadcast_async_", "broadcast_object",
    "broadcast_optimizer_state", "broadcast_parameters", "ccl_built", "cross_rank",
    "cross_size", "cuda_built", "ddl_built", "gloo_built", "gloo_enabled",
    "global_process_set", "gradient_semantics", "grouped_allgather", "grouped_allgather_async",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
    "grouped_allreduce_async_", "grouped_reducescatter", "grouped_reducescatter_async",
    "init", "is_homogeneous", "is_initialized", "join", "local_rank", "local_size",
    "metrics", "metrics_writer", "mpi_built", "mpi_enabled", "mpi_threads_supported",
    "nccl_built", "poll", "rank",
    "reducescatter", "reducescatter_async", "remove_process_set", "rocm_built",
    "set_gradient_semantics", "shutdown", "size", "sparse_allreduce_async", "start_timeline", "stop_timeline", "synchronize",
]
