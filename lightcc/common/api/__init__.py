"""The framework-agnostic public API on NumPy and GPU arrays (re-exported by ``lightcc``).

GPU arrays (CuPy, torch CUDA tensors, DLPack / ``__cuda_array_interface__``) enter zero-copy as
``gpu_arrays.DeviceTensor``s and run through ``execution/gpu.py``; host arrays are never checked
for it beyond one type test (docs/gpu.md).

Every collective has an ``*_async`` form that returns a :class:`~.engine.Handle` at once and
a blocking form (``synchronize(*_async(...))``). Names identify a tensor across ranks; when
omitted, one is generated from a per-process-set counter, so ranks must then issue unnamed
collectives in the same order. Allreduce and reducescatter average by default, as in Horovod.

``ordered=True`` (every collective) puts the call on its process set's *ordered stream*: the
caller promises that every member issues its ordered calls, of all collective types together,
in the same order (the torch.distributed contract). They are matched by position, not by name
(``name`` then only labels the call in errors and the timeline), which skips name negotiation;
ranks still check that shape, dtype and op agree.

Split by concern: ``state.py`` (the running engine, process-set objects, queries),
``lifecycle.py`` (init, shutdown, timeline, process-set registration), ``checks.py``
(validation, written once), ``collectives.py`` and ``door.py`` (what framework adapters use).
"""
from __future__ import annotations

from ..engine import Handle
from .checks import _as_array, _pset_id, _root_index  # noqa: F401  (lightcc.torch until the door)
from .collectives import (GroupHandle, allgather, allgather_async, allreduce, allreduce_async,
                          allreduce_direct, alltoall, alltoall_async, barrier, barrier_async,
                          broadcast, broadcast_async, grouped_allreduce, grouped_allreduce_async,
                          join, poll, reducescatter, reducescatter_async, synchronize)
from .door import (Prepared, auto_name, compressor, prepare_allreduce, process_set_rank,
                   process_set_ranks, root_index)
from .lifecycle import (add_process_set, init, p2p_communicator, remove_process_set, shutdown,
                        start_timeline, stop_timeline, transport)
from .state import (Adasum, Average, BitwiseAnd, BitwiseOr, BitwiseXor, Max, Min, ProcessSet,
                    Product, Sum, config, cross_rank, cross_size, engine, global_process_set,
                    is_homogeneous, is_initialized, local_rank, local_size, metrics, rank, size,
                    stats)

__all__ = ["Adasum", "Average", "BitwiseAnd", "BitwiseOr", "BitwiseXor", "GroupHandle", "Handle",
           "Max", "Min", "Prepared", "ProcessSet", "Product", "Sum", "add_process_set",
           "allgather", "allgather_async", "allreduce", "allreduce_async", "allreduce_direct",
           "alltoall", "alltoall_async", "auto_name", "barrier", "barrier_async", "broadcast",
           "broadcast_async", "compressor", "config", "cross_rank", "cross_size", "engine",
           "global_process_set", "grouped_allreduce", "grouped_allreduce_async", "init",
           "is_homogeneous", "is_initialized", "join", "local_rank", "local_size", "metrics",
           "p2p_communicator", "poll", "prepare_allreduce", "process_set_rank",
           "process_set_ranks", "rank",
           "reducescatter", "reducescatter_async", "remove_process_set", "root_index",
           "shutdown", "size", "start_timeline", "stats", "stop_timeline", "synchronize", "transport"]
