"""Asynchronous and in-place collectives on tensors, with horovod.torch's names and defaults.

Every ``*_async`` function submits to the core engine and returns an integer handle; the table
``_handles`` maps it to the core handle and to the post-processing that turns the core's
result into tensors (copying staged inputs back for in-place ops), so ``synchronize(handle)``
returns tensors, as in Horovod. CUDA tensors travel zero-copy (``_tensor.stage``); waiting for
them makes torch's current stream wait for the engine's work, not the host.
``poll(handle)`` never blocks. The differentiable blocking forms (``allreduce``,
``allgather``, ...) live in :mod:`.autograd`, which builds on this module; :mod:`.mpi_ops`
(Horovod's module name) offers both.
"""
from __future__ import annotations

import itertools
import warnings
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..common import api as _api
from ..common.api import Average, Sum, global_process_set
from . import basics
from ._tensor import core_result, from_array, result_like, stage, to_device, torch_stream


# ---- handle table -----------------------------------------------------------------------------
class _Pending:
    __slots__ = ("core", "finish", "gpu")

    def __init__(self, core: Any, finish: Callable[[Any], Any], gpu: Any = None) -> None:
        self.core, self.finish, self.gpu = core, finish, gpu


_handles: dict[int, _Pending] = {}
_counter = itertools.count(1)


def _reset() -> None:
    _handles.clear()


basics._reset_hooks.append(_reset)


def _register(core: Any, finish: Callable[[Any], Any], gpu: Any = None) -> int:
    """A handle for ``core``; ``gpu`` is the torch device of CUDA tensors (None for CPU)."""
    handle = next(_counter)
    _handles[handle] = _Pending(core, finish, gpu)
    return handle


def _gpu(tensors: Sequence[torch.Tensor]) -> Any:
    """The device of the first CUDA tensor, or None."""
    return next((t.device for t in tensors if t.device.type == "cuda"), None)


def poll(handle: int) -> bool:
    """True when the operation behind ``handle`` has finished; never blocks."""
    pending = _handles.get(handle)
    if pending is None:
        raise ValueError(f"poll: unknown handle {handle!r} (already synchronized?)")
    return pending.core.done()


def synchronize(handle: int) -> Any:
    """Wait for ``handle``; returns its tensor(s) or raises the collective's error.

    An unknown handle (already synchronized) returns None, as in Horovod.
    """
    pending = _handles.pop(handle, None)
    if pending is None:
        return None
    if pending.gpu is None:
        return pending.finish(pending.core.wait())
    with torch_stream(pending.gpu):      # torch's current stream waits for the GPU work
        return pending.finish(pending.core.wait())


# ---- argument helpers -------------------------------------------------------------------------
def handle_average_backwards_compatibility(op: Any, average: Any) -> Any:
    """Resolve Horovod's deprecated ``average=`` against ``op=`` (op wins; both is an error)."""
    if op is not None:
        if average is not None:
            raise ValueError("The op parameter supersedes average. Please provide only one "
                             "of them.")
        return op
    if average is not None:
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed",
                      DeprecationWarning, stacklevel=3)
        return Average if average else Sum
    return Average


def _base_name(coll: str, name: str | None, process_set: Any) -> str:
    """``name``, or the next generated one (``allgather.noname.7``) for a grouped call."""
    return name if name is not None else _api.auto_name(coll, process_set)


# ---- allreduce --------------------------------------------------------------------------------
def _allreduce_submit(tensor: torch.Tensor, inplace: bool, name: str | None, op: Any,
                      prescale_factor: float, postscale_factor: float, process_set: Any,
                      compression: Any = None, s: Any = None) -> int:
    s = stage(tensor, "allreduce") if s is None else s
    gpu = tensor.device if s.gpu else None
    if inplace:
        core = _api.allreduce_async(s.array, op, name, prescale_factor, postscale_factor,
                                    process_set, compression, out=s.array)
        return _register(core, lambda _res: s.finish(), gpu)
    out, out_arr = result_like(s.work)
    core = _api.allreduce_async(s.array, op, name, prescale_factor, postscale_factor,
                                process_set, compression, out=out_arr)
    return _register(core, lambda _res: out if s.gpu else to_device(out, tensor), gpu)


def _allreduce_now(tensor: torch.Tensor, inplace: bool, name: str | None, op: Any,
                   prescale_factor: float, postscale_factor: float, process_set: Any,
                   compression: Any = None) -> torch.Tensor:
    """A blocking allreduce. Unnamed: checked against the other ranks' call on this thread,
    and a small CPU tensor reduced there too (the core's direct path, ``common/direct.py``);
    everything else goes through the engine."""
    if name is not None:
        return synchronize(_allreduce_submit(tensor, inplace, name, op, prescale_factor,
                                             postscale_factor, process_set, compression))
    s = stage(tensor, "allreduce")
    if inplace:
        if _api.allreduce_direct(s.array, op, prescale_factor, postscale_factor, process_set,
                                 compression, s.array) is not None:
            return s.finish()
    else:         # the direct path returns a fresh array: the result tensor shares it
        res = _api.allreduce_direct(s.array, op, prescale_factor, postscale_factor,
                                    process_set, compression, None)
        if res is not None:
            return from_array(res)
    return synchronize(_allreduce_submit(tensor, inplace, name, op, prescale_factor,
                                         postscale_factor, process_set, compression, s))


def allreduce_async(tensor: torch.Tensor, average: Any = None, name: str | None = None,
                    op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: Any = global_process_set) -> int:
    """Start averaging (default) or reducing ``tensor`` over all ranks; input unchanged."""
    op = handle_average_backwards_compatibility(op, average)
    return _allreduce_submit(tensor, False, name, op, prescale_factor, postscale_factor,
                             process_set)


def allreduce_async_(tensor: torch.Tensor, average: Any = None, name: str | None = None,
                     op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: Any = global_process_set) -> int:
    """In-place :func:`allreduce_async`: ``synchronize`` returns ``tensor`` holding the result."""
    op = handle_average_backwards_compatibility(op, average)
    return _allreduce_submit(tensor, True, name, op, prescale_factor, postscale_factor,
                             process_set)


def allreduce_(tensor: torch.Tensor, average: Any = None, name: str | None = None,
               op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: Any = global_process_set) -> torch.Tensor:
    """In-place allreduce; returns ``tensor``."""
    op = handle_average_backwards_compatibility(op, average)
    return _allreduce_now(tensor, True, name, op, prescale_factor, postscale_factor,
                          process_set)


def _grouped_allreduce_submit(tensors: Sequence[torch.Tensor], inplace: bool, name: str | None,
                              op: Any, prescale_factor: float, postscale_factor: float,
                              process_set: Any, compression: Any = None) -> int:
    staged = [stage(t, "grouped_allreduce") for t in tensors]
    if inplace:
        outs = [s.array for s in staged]
        core = _api.grouped_allreduce_async([s.array for s in staged], op, name,
                                            prescale_factor, postscale_factor, process_set,
                                            compression, outs=outs)
        return _register(core, lambda _res: [s.finish() for s in staged], _gpu(tensors))
    results = [result_like(s.work) for s in staged]
    core = _api.grouped_allreduce_async([s.array for s in staged], op, name, prescale_factor,
                                        postscale_factor, process_set, compression,
                                        outs=[a for _, a in results])
    return _register(core, lambda _res: [o if s.gpu else to_device(o, t) for (o, _), t, s
                                         in zip(results, tensors, staged)], _gpu(tensors))


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: Any = None,
                            name: str | None = None, op: Any = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: Any = global_process_set) -> int:
    """Start reducing a list of tensors as one group (fused); names are ``name.0``, ``name.1``."""
    op = handle_average_backwards_compatibility(op, average)
    return _grouped_allreduce_submit(tensors, False, name, op, prescale_factor,
                                     postscale_factor, process_set)


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: Any = None,
                             name: str | None = None, op: Any = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: Any = global_process_set) -> int:
    op = handle_average_backwards_compatibility(op, average)
    return _grouped_allreduce_submit(tensors, True, name, op, prescale_factor,
                                     postscale_factor, process_set)


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: Any = None,
                       name: str | None = None, op: Any = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0,
                       process_set: Any = global_process_set) -> list[torch.Tensor]:
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


def sparse_allreduce_async(tensor: torch.Tensor, name: str, op: Any,
                           process_set: Any = global_process_set) -> Callable[[], torch.Tensor]:
    """Reduce a sparse COO tensor by allgathering indices and values; returns a callable that
    waits and gives the (uncoalesced) result. Average divides the values by the set size."""
    t = tensor.coalesce() if not tensor.is_coalesced() else tensor
    h_idx = allgather_async(t.indices().transpose(0, 1).contiguous(), name=f"{name}.indices",
                            process_set=process_set)
    h_val = allgather_async(t.values(), name=f"{name}.values", process_set=process_set)
    n = len(_api.process_set_ranks(process_set))

    def wait() -> torch.Tensor:
        values = synchronize(h_val)
        indices = synchronize(h_idx)
        if op == Average:
            values = values / n
        return torch.sparse_coo_tensor(indices.transpose(0, 1), values, t.size(),
                                       check_invariants=False)

    return wait


# ---- allgather / broadcast / alltoall / reducescatter -----------------------------------------
def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: Any = global_process_set) -> int:
    """Start concatenating every rank's ``tensor`` along dimension 0 (sizes may differ)."""
    s = stage(tensor, "allgather")
    core = _api.allgather_async(s.array, name, process_set)
    return _register(core, lambda res: core_result(res, tensor), _gpu([tensor]))


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: Any = global_process_set) -> int:
    base = _base_name("allgather", name, process_set)
    staged = [stage(t, "grouped_allgather") for t in tensors]
    core = _api.GroupHandle([_api.allgather_async(s.array, f"{base}.{i}", process_set)
                             for i, s in enumerate(staged)])
    return _register(core, lambda res: [core_result(r, t) for r, t in zip(res, tensors)],
                     _gpu(tensors))


def _broadcast_submit(tensor: torch.Tensor, inplace: bool, root_rank: int, name: str | None,
                      process_set: Any) -> int:
    s = stage(tensor, "broadcast")
    gpu = tensor.device if s.gpu else None
    if inplace:
        core = _api.broadcast_async(s.array, root_rank, name, process_set, out=s.array)
        return _register(core, lambda _res: s.finish(), gpu)
    out, out_arr = result_like(s.work)
    core = _api.broadcast_async(s.array, root_rank, name, process_set, out=out_arr)
    return _register(core, lambda _res: out if s.gpu else to_device(out, tensor), gpu)


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: Any = global_process_set) -> int:
    """Start copying ``root_rank``'s tensor to every rank; ``tensor`` is not modified.

    ``root_rank`` is a global rank, also within a process set (as in Horovod); a root that is
    not a member raises ``ValueError`` on the caller before anything is sent.
    """
    return _broadcast_submit(tensor, False, root_rank, name, process_set)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: Any = global_process_set) -> int:
    """In-place :func:`broadcast_async`: ``tensor`` receives the root's values."""
    return _broadcast_submit(tensor, True, root_rank, name, process_set)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: Any = global_process_set) -> torch.Tensor:
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def _splits_list(tensor: torch.Tensor, splits: Any, process_set: Any) -> list[int] | None:
    if splits is None:
        n = len(_api.process_set_ranks(process_set))
        if tensor.dim() == 0 or tensor.shape[0] % n:
            return None     # the core reports the problem with its message
        return [tensor.shape[0] // n] * n
    if isinstance(splits, torch.Tensor):
        return [int(v) for v in splits.reshape(-1).tolist()]
    return [int(v) for v in np.asarray(splits).reshape(-1)]


def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
                   process_set: Any = global_process_set) -> int:
    """Start an all-to-all; ``synchronize`` returns ``(output, received_splits)``."""
    s = stage(tensor, "alltoall")
    core = _api.alltoall_async(s.array, _splits_list(tensor, splits, process_set), name,
                               process_set)
    dtype = splits.dtype if isinstance(splits, torch.Tensor) else torch.int32

    def finish(res: Any) -> tuple[torch.Tensor, torch.Tensor]:
        out, received = res
        return core_result(out, tensor), torch.as_tensor(np.asarray(received)).to(dtype)

    return _register(core, finish, _gpu([tensor]))


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: Any = Average,
                        process_set: Any = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> int:
    """Start reducing ``tensor`` and scattering dimension 0 (earlier ranks get the extra rows)."""
    s = stage(tensor, "reducescatter")
    core = _api.reducescatter_async(s.array, op, name, process_set, prescale_factor,
                                    postscale_factor)
    return _register(core, lambda res: core_result(res, tensor), _gpu([tensor]))


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                                op: Any = Average, process_set: Any = global_process_set,
                                prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> int:
    base = _base_name("reducescatter", name, process_set)
    staged = [stage(t, "grouped_reducescatter") for t in tensors]
    core = _api.GroupHandle([_api.reducescatter_async(s.array, op, f"{base}.{i}", process_set,
                                                      prescale_factor, postscale_factor)
                             for i, s in enumerate(staged)])
    return _register(core, lambda res: [core_result(r, t) for r, t in zip(res, tensors)],
                     _gpu(tensors))


# ---- control ----------------------------------------------------------------------------------
def join(device: int = -1) -> int:
    """Stop contributing data until every rank has joined; returns the last rank to join.

    While joined, this rank's share of other ranks' allreduces is zeros. ``device`` is
    accepted for Horovod compatibility (CPU zeros are always used).
    """
    return int(_api.join())


def barrier(process_set: Any = global_process_set) -> None:
    """Wait until every rank of ``process_set`` has called ``barrier``."""
    _api.barrier(process_set)


__all__ = [
    "allgather_async", "allreduce_", "allreduce_async", "allreduce_async_", "alltoall_async",
    "barrier", "broadcast_", "broadcast_async", "broadcast_async_", "grouped_allgather_async",
    "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "grouped_reducescatter_async", "handle_average_backwards_compatibility", "join", "poll",
    "reducescatter_async", "sparse_allreduce_async", "synchronize",
]
