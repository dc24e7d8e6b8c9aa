"""lightcc: collective communication for distributed deep-learning training.

``import lightcc as lcc`` gives the framework-agnostic API on NumPy and GPU (CuPy) arrays;
PyTorch users import ``lightcc.torch`` (Horovod-compatible). See README.md and docs/.
"""
from __future__ import annotations

from ._version import __version__

from .common.api import (Adasum, Average, BitwiseAnd, BitwiseOr, BitwiseXor, GroupHandle, Max,
                         Min, ProcessSet, Product, Sum, add_process_set, allgather,
                         allgather_async, allreduce, allreduce_async, alltoall, alltoall_async,
                         barrier, barrier_async, broadcast, broadcast_async, config, cross_rank,
                         cross_size, global_process_set, grouped_allreduce,
                         grouped_allreduce_async, init, is_homogeneous, is_initialized, join,
                         local_rank, local_size, metrics, poll, rank, reducescatter,
                         reducescatter_async, remove_process_set, shutdown, size,
                         start_timeline, stats, stop_timeline, synchronize)
from .common.compression.api import Compression
from .common.engine import Handle
from .common.exceptions import (CollectiveError, ConfigError, DuplicateNameError,
                                HorovodInternalError, InvalidArgumentError, LightCCError,
                                MismatchError, NotInitializedError, ShutdownError, StallError,
                                UnsupportedDTypeError)

__all__ = [n for n in dir() if not n.startswith("_")]
