"""The collectives: allreduce (also grouped and, for blocking unnamed calls, the direct path),
allgather, broadcast, alltoall, reducescatter, barrier, join; and the handles they return."""
from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np

from .. import dtypes
from ..control.messages import Coll, Request
from ..gpu_arrays import DeviceTensor
from ..engine import Handle
from ..exceptions import InvalidArgumentError
from ..execution import direct
from .checks import (_allreduce_request, _as_array, _check_out, _compression_spec, _name,
                     _on_device, _op, _prologue, _pset_id, _root_index, _scales, _wake_of)
from .state import Adasum, Average, _get


def allreduce_async(array: Any, op: str | None = None, name: str | None = None,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: Any = None, compression: Any = None,
                    out: np.ndarray | None = None, *, ordered: bool = False,
                    wake: bool = True, _wake: bool | None = None) -> Handle:
    """Start reducing ``array`` over the process set (default op: Average).

    With ``out`` (same shape and dtype), the result is written there (``out`` may be
    ``array`` itself for an in-place reduction) and the handle returns it. ``wake=False``: the
    caller waits for the handle right after this call and drives progress itself, so the
    background thread is not woken (saves a thread switch); ``_wake`` is its deprecated alias.
    """
    call, req, what = _allreduce_request(array, op, name, prescale_factor, postscale_factor,
                                         process_set, compression, ordered)
    if type(call.arr) is DeviceTensor:
        req, out = _on_device(req, call.arr, out, what)
    else:
        _check_out(out, call.arr, what)
    return call.eng.submit(req, call.arr, out, wake=_wake_of(wake, _wake), stream=call.stream,
                           label=call.label)


def allreduce(array: Any, op: str | None = None, name: str | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: Any = None, compression: Any = None,
              out: np.ndarray | None = None, *, ordered: bool = False) -> np.ndarray:
    """Reduce ``array`` over the process set and return the result (default op: Average).

    With ``out`` the result is written there (``out`` may be ``array``) and returned. Without
    a name, the ranks' calls are checked against each other on this thread first, and a small
    host array is reduced there too (the direct path: ``direct.py``, ``LCC_DIRECT_BYTES``).
    """
    if name is None and not ordered:
        result = allreduce_direct(array, op, prescale_factor, postscale_factor, process_set,
                                  compression, out)
        if result is not None:
            return result
    return synchronize(allreduce_async(array, op, name, prescale_factor, postscale_factor,
                                       process_set, compression, out, ordered=ordered,
                                       wake=False))


def allreduce_direct(array: Any, op: str | None, prescale_factor: float,
                     postscale_factor: float, process_set: Any, compression: Any,
                     out: Any) -> Any:
    """A blocking unnamed allreduce, first checked against the other ranks' on the calling
    thread (see ``direct.py``): the result when it qualifies for the direct path (host memory,
    at most LCC_DIRECT_BYTES, no compressor that would apply), else None after the check
    (the caller then submits it to the engine), or None at once when the process set has no
    direct path. Raises for bad input as the engine would, and MismatchError on every rank
    when the ranks' calls differ."""
    eng = _get()
    group = eng.groups.get(_pset_id(process_set))
    if group is None or group.direct is None:
        return None
    arr = _as_array(array, "allreduce")
    eng.status.check()
    dt = dtypes.name_of(arr.dtype)
    what = "unnamed allreduce"
    op_ = _op(op, Average, what, dt, adasum=True)
    if op_ == Adasum:       # never direct: the engine runs it (allreduce_async checks it)
        return None
    pre, post = _scales(prescale_factor, postscale_factor, dt, what)
    spec = _compression_spec(compression)
    host = type(arr) is not DeviceTensor
    if host:
        _check_out(out, arr, what)
    here = host and direct.eligible(arr.nbytes, spec, group.min_compress_bytes,
                                    eng.config.direct_bytes, dt, op_)
    tracer = group.tracer
    t0 = time.perf_counter() if tracer.enabled else 0.0
    result = group.direct.allreduce(arr, op_, dt, pre, post, spec, out, eng, here,
                                    "host" if host else "GPU")
    if tracer.enabled and here:
        tracer.span("allreduce.direct", "DIRECT_ALLREDUCE", t0, time.perf_counter(),
                    bytes=int(arr.nbytes), dtype=dt, op=op_)
    return result


class GroupHandle:
    """Handles of a grouped collective; completes when all members do."""

    def __init__(self, handles: list[Handle]) -> None:
        self.handles = handles

    def done(self) -> bool:
        return all(h.done() for h in self.handles)

    def wait(self, timeout: float | None = None) -> list[Any]:
        return [h.wait(timeout) for h in self.handles]


def grouped_allreduce_async(arrays: Sequence[Any], op: str | None = None,
                            name: str | None = None, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0, process_set: Any = None,
                            compression: Any = None,
                            outs: Sequence[np.ndarray] | None = None) -> GroupHandle:
    """Allreduce a list of arrays as one group (fused together when they fit)."""
    _get()
    outs = list(outs) if outs is not None else [None] * len(arrays)
    names = [None if name is None else f"{name}.{i}" for i in range(len(arrays))]
    return GroupHandle([allreduce_async(a, op, nm, prescale_factor, postscale_factor,
                                        process_set, compression, o)
                        for nm, a, o in zip(names, arrays, outs)])


def grouped_allreduce(arrays: Sequence[Any], op: str | None = None, name: str | None = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: Any = None, compression: Any = None) -> list[np.ndarray]:
    return synchronize(grouped_allreduce_async(arrays, op, name, prescale_factor,
                                               postscale_factor, process_set, compression))


def allgather_async(array: Any, name: str | None = None, process_set: Any = None, *,
                    ordered: bool = False, wake: bool = True,
                    _wake: bool | None = None) -> Handle:
    """Start concatenating every rank's ``array`` along the first dimension (sizes may differ)."""
    c = _prologue(Coll.ALLGATHER, array, name, process_set, ordered)
    eng, arr, dt, pset, nm, stream, label = c.eng, c.arr, c.dt, c.pset, c.name, c.stream, c.label
    if arr.ndim == 0:
        raise InvalidArgumentError(f"allgather '{nm}': needs at least one dimension, got a "
                                   f"0-d array (reshape it to (1,))")
    req = Request(Coll.ALLGATHER, nm, dt, tuple(arr.shape), pset=pset)
    if type(arr) is DeviceTensor:
        req, _ = _on_device(req, arr, None, f"allgather '{nm}'")
    return eng.submit(req, arr, wake=_wake_of(wake, _wake), stream=stream, label=label)


def allgather(array: Any, name: str | None = None, process_set: Any = None, *,
              ordered: bool = False) -> np.ndarray:
    return synchronize(allgather_async(array, name, process_set, ordered=ordered,
                                       wake=False))


def broadcast_async(array: Any, root_rank: int, name: str | None = None,
                    process_set: Any = None, out: np.ndarray | None = None, *,
                    ordered: bool = False, wake: bool = True,
                    _wake: bool | None = None) -> Handle:
    """Start copying ``root_rank``'s ``array`` to every member of the process set.

    ``root_rank`` is a *global* rank (a member of the set), as in Horovod for every framework.
    """
    eng = _get()
    arr = _as_array(array, "broadcast")
    dt = dtypes.name_of(arr.dtype)
    pset = _pset_id(process_set)
    members = eng.pset(pset).ranks
    root = _root_index(root_rank, members, eng.size,   # before a name is generated
                       "broadcast" if name is None else f"broadcast '{name}'")
    nm, stream, label = _name(eng, Coll.BROADCAST, name, pset, ordered)
    req = Request(Coll.BROADCAST, nm, dt, tuple(arr.shape), root=root, pset=pset)
    if type(arr) is DeviceTensor:
        req, out = _on_device(req, arr, out, f"broadcast '{nm}'")
    else:
        _check_out(out, arr, f"broadcast '{nm}'")
    return eng.submit(req, arr, out, wake=_wake_of(wake, _wake), stream=stream, label=label)


def broadcast(array: Any, root_rank: int, name: str | None = None,
              process_set: Any = None, *, ordered: bool = False) -> np.ndarray:
    return synchronize(broadcast_async(array, root_rank, name, process_set, ordered=ordered,
                                       wake=False))


def alltoall_async(array: Any, splits: Sequence[int] | None = None, name: str | None = None,
                   process_set: Any = None, *, ordered: bool = False,
                   wake: bool = True, _wake: bool | None = None) -> Handle:
    """Start an all-to-all: rows ``splits[r]`` of ``array`` go to rank r (even split if None).

    The result is ``(output, received_splits)`` when ``splits`` is given, else ``output``.
    """
    c = _prologue(Coll.ALLTOALL, array, name, process_set, ordered)
    eng, arr, dt, pset, nm, stream, label = c.eng, c.arr, c.dt, c.pset, c.name, c.stream, c.label
    n = len(eng.pset(pset).ranks)
    what = f"alltoall '{nm}'"
    if arr.ndim == 0:
        raise InvalidArgumentError(f"{what}: needs at least one dimension")
    if splits is None:
        if arr.shape[0] % n:
            raise InvalidArgumentError(f"{what}: first dimension {arr.shape[0]} is not "
                                       f"divisible by {n} ranks; pass splits")
        split_list = (arr.shape[0] // n,) * n
    else:
        raw = np.asarray(splits).reshape(-1)
        if raw.dtype.kind not in "iu":
            raise InvalidArgumentError(f"{what}: splits must be integers, got {raw.dtype}")
        split_list = tuple(int(s) for s in raw)
        if len(split_list) != n:
            raise InvalidArgumentError(f"{what}: splits has {len(split_list)} entries, the "
                                       f"process set has {n} ranks")
        if any(s < 0 for s in split_list) or sum(split_list) != arr.shape[0]:
            raise InvalidArgumentError(f"{what}: splits {list(split_list)} must be >= 0 and "
                                       f"sum to the first dimension {arr.shape[0]}")
    req = Request(Coll.ALLTOALL, nm, dt, tuple(arr.shape), splits=split_list, pset=pset)
    if type(arr) is DeviceTensor:
        req, _ = _on_device(req, arr, None, what)
    handle = eng.submit(req, arr, wake=_wake_of(wake, _wake), stream=stream, label=label)
    if splits is None:
        return _Derived(handle, lambda res: res[0])
    return handle


def alltoall(array: Any, splits: Sequence[int] | None = None, name: str | None = None,
             process_set: Any = None, *, ordered: bool = False) -> Any:
    return synchronize(alltoall_async(array, splits, name, process_set, ordered=ordered,
                                      wake=False))


def reducescatter_async(array: Any, op: str | None = None, name: str | None = None,
                        process_set: Any = None, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0, *, ordered: bool = False,
                        wake: bool = True, _wake: bool | None = None) -> Handle:
    """Start reducing ``array`` and scattering its first dimension (earlier ranks get extra)."""
    c = _prologue(Coll.REDUCESCATTER, array, name, process_set, ordered)
    eng, arr, dt, pset, nm, stream, label = c.eng, c.arr, c.dt, c.pset, c.name, c.stream, c.label
    what = f"reducescatter '{nm}'"
    if arr.ndim == 0:
        raise InvalidArgumentError(f"{what}: needs at least one dimension")
    op_ = _op(op, Average, what, dt)
    pre, post = _scales(prescale_factor, postscale_factor, dt, what)
    req = Request(Coll.REDUCESCATTER, nm, dt, tuple(arr.shape), op_, -1, pre, post, pset=pset)
    if type(arr) is DeviceTensor:
        req, _ = _on_device(req, arr, None, what)
    return eng.submit(req, arr, wake=_wake_of(wake, _wake), stream=stream, label=label)


def reducescatter(array: Any, op: str | None = None, name: str | None = None,
                  process_set: Any = None, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0, *, ordered: bool = False) -> np.ndarray:
    return synchronize(reducescatter_async(array, op, name, process_set, prescale_factor,
                                           postscale_factor, ordered=ordered, wake=False))


def barrier_async(process_set: Any = None, name: str | None = None, *,
                  ordered: bool = False, wake: bool = True,
                    _wake: bool | None = None) -> Handle:
    """Start a barrier; the handle completes once every rank of the process set has called it."""
    eng = _get()
    pset = _pset_id(process_set)
    eng.pset(pset)
    nm, stream, label = _name(eng, Coll.BARRIER, name, pset, ordered)
    return eng.submit(Request(Coll.BARRIER, nm, pset=pset), wake=_wake_of(wake, _wake),
                      stream=stream, label=label)


def barrier(process_set: Any = None, *, ordered: bool = False) -> None:
    """Wait until every rank of the process set has called ``barrier``."""
    synchronize(barrier_async(process_set, ordered=ordered, wake=False))


def join() -> int:
    """Stop contributing: until every rank has joined, this rank's share of allreduces is
    zeros (and of allgathers empty). Returns the last rank to join."""
    eng = _get()
    eng.mark_joined()
    handle = eng.submit(Request(Coll.JOIN, "join"))
    path = eng.groups[0].direct
    if path is not None:    # meanwhile, add zeros to the others' direct calls (direct.py)
        path.serve_join(eng, handle)
    return synchronize(handle)


# ---- handles --------------------------------------------------------------------------------
class _Derived:
    """A handle whose result is a function of another's."""

    def __init__(self, inner: Handle, fn: Any) -> None:
        self.inner, self.fn = inner, fn
        self.request = inner.request

    def done(self) -> bool:
        return self.inner.done()

    def wait(self, timeout: float | None = None) -> Any:
        return self.fn(self.inner.wait(timeout))


def _check_handle(handle: Any) -> None:
    if not (isinstance(handle, (Handle, GroupHandle, _Derived))
            or (hasattr(handle, "done") and hasattr(handle, "wait"))):
        raise InvalidArgumentError(f"expected a handle returned by an *_async call, got "
                                   f"{type(handle).__name__}")


def poll(handle: Any) -> bool:
    """True when the collective behind ``handle`` has finished (never blocks)."""
    _check_handle(handle)
    return handle.done()


def synchronize(handle: Any) -> Any:
    """Wait for ``handle`` and return its result; raises the collective's error if it failed."""
    _check_handle(handle)
    return handle.wait()
