"""Validation of the API's arguments, written once: every collective checks its input through
these functions on the caller's thread, before anything is sent, so a bad argument raises the
same error on every rank that passes it and never leaves the others waiting."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .. import dtypes, gpu_arrays
from ..algorithms import adasum
from ..control.messages import SHARED_STREAM, Coll, Request
from ..gpu_arrays import DeviceTensor
from ..engine import Engine
from ..exceptions import InvalidArgumentError, UnsupportedDTypeError
from .state import Adasum, Average, ProcessSet, _get


def _pset_id(process_set: Any) -> int:
    if process_set is None:
        return 0
    if isinstance(process_set, ProcessSet):
        if process_set.process_set_id is None:
            raise process_set.not_added()
        return process_set.process_set_id
    if isinstance(process_set, int):
        return process_set
    raise InvalidArgumentError(f"process_set must be a ProcessSet, got {type(process_set)}")


def _as_array(value: Any, what: str) -> np.ndarray:
    if getattr(value, "requires_grad", False) is True:
        raise InvalidArgumentError(f"{what}: the tensor requires grad, and the core API takes "
                                   f"plain arrays; pass tensor.detach(), or use lightcc.torch, "
                                   f"whose collectives are differentiable")
    if isinstance(value, np.ndarray):
        arr = value
    elif isinstance(value, (list, tuple, int, float, bool, np.generic)):
        arr = np.asarray(value)
    elif gpu_arrays.is_device_array(value):    # GPU memory: a zero-copy CuPy view
        dt = gpu_arrays.adopt(value, what)
        dtypes.name_of(dt.dtype)
        return dt
    elif hasattr(value, "__array__") or hasattr(value, "__array_interface__"):
        arr = np.asarray(value)
    else:
        raise UnsupportedDTypeError(f"{what}: expected a NumPy array, got "
                                    f"{type(value).__name__}")
    if arr.dtype == object:
        _bad_dtype(arr, what)
    dtypes.name_of(arr.dtype)
    return arr


def _bad_dtype(arr: np.ndarray, what: str) -> None:
    raise UnsupportedDTypeError(f"{what}: dtype {arr.dtype} is not supported; supported: "
                                f"{', '.join(sorted(dtypes.SUPPORTED))}")


def _name(eng: Engine, coll: Coll, name: str | None, pset: int,
          ordered: bool = False) -> tuple[str, int | None, str | None]:
    """``(name for messages, ordered stream or None, label)``.

    Named calls are matched by name. ``ordered=True`` puts the call on the process set's shared
    ordered stream (``name`` is then only a label). Unnamed calls go on the ordered stream of
    their collective type: Horovod generates their names from per-type counters, so they must
    be issued in the same order on every rank anyway, and matching them by position keeps them
    in the caches instead of negotiating a new name every time.
    """
    if name is not None and not isinstance(name, str):
        raise InvalidArgumentError(f"name must be a str, got {type(name).__name__}")
    if ordered:
        return (name or "ordered"), SHARED_STREAM, name
    if name is None:
        return f"{coll.name.lower()}.noname", int(coll), None
    return name, None, None


def _op(op: Any, default: str, what: str, dtype: str, adasum: bool = False) -> str:
    op = default if op is None else op
    if op == Adasum:
        if adasum:      # checked with the process set by the caller (algorithms/adasum.py)
            return op
        raise InvalidArgumentError(f"{what}: Adasum is supported by allreduce only")
    if not isinstance(op, str):
        raise InvalidArgumentError(f"{what}: op must be one of Sum, Average, Min, Max, Product, "
                                   f"BitwiseAnd, BitwiseOr, BitwiseXor")
    dtypes.check_op(op, dtype, what)
    return op


def _scales(pre: float, post: float, dtype: str, what: str) -> tuple[float, float]:
    pre, post = float(pre), float(post)
    dtypes.check_scaling(pre, post, dtype, what)    # integers scale as in Horovod; not bool
    return pre, post


_VALID_SPECS: set[str] = {"none"}


def _check_out(out: Any, arr: np.ndarray, what: str) -> None:
    """``out`` must be a writeable array of the input's shape and dtype (checked before
    anything is sent, so a bad ``out`` on one rank cannot leave the others waiting)."""
    if out is None:
        return
    if not isinstance(out, np.ndarray):
        raise InvalidArgumentError(f"{what}: out must be a NumPy array, got {type(out).__name__}")
    if out.shape != arr.shape or out.dtype != arr.dtype:
        raise InvalidArgumentError(f"{what}: out has shape {out.shape} {out.dtype}, input "
                                   f"{arr.shape} {arr.dtype}")
    if not out.flags.writeable:
        raise InvalidArgumentError(f"{what}: out is read-only")


def _on_device(req: Request, arr: DeviceTensor, out: Any, what: str) -> tuple[Request, Any]:
    """The request for a GPU tensor (executed by execution/gpu.py), and ``out`` checked for it;
    the process set is tied to the tensor's GPU on this rank."""
    gpu_arrays.bind(_get().pset(req.pset), arr, what)
    if out is not None:
        out = gpu_arrays.check_out(out, arr, what)
    return req._replace(device=True), out


def _compression_spec(compression: Any) -> str:
    if compression is None:
        return "none"
    spec = getattr(compression, "spec", compression)
    if not isinstance(spec, str):
        raise InvalidArgumentError(f"compression must be a Compression value or spec string, "
                                   f"got {compression!r}")
    if spec == "auto":   # the accuracy is part of the spec, so ranks that differ mismatch
        spec = f"auto:{_get().config.compression_accuracy}"
    if spec not in _VALID_SPECS:
        from .. import compression as comp_mod

        try:
            comp_mod.make(spec)  # validates the spec now, on the user's thread
        except ValueError as exc:
            raise InvalidArgumentError(str(exc)) from None
        _VALID_SPECS.add(spec)
    return spec


def _wake_of(wake: bool, _wake: bool | None) -> bool:
    """``wake``, or the deprecated ``_wake`` keyword when a caller still passes it."""
    return bool(wake if _wake is None else _wake)


class Call:
    """A collective call's validated prologue: engine, array, dtype name, process set id, the
    name it is matched by, its ordered stream (None: by name) and label."""

    __slots__ = ("eng", "arr", "dt", "pset", "name", "stream", "label")

    def __init__(self, coll: Coll, array: Any, name: str | None, process_set: Any,
                 ordered: bool) -> None:
        self.eng = eng = _get()
        self.arr = arr = _as_array(array, coll.name.lower())
        self.dt = dtypes.name_of(arr.dtype)
        self.pset = _pset_id(process_set)
        eng.pset(self.pset)
        self.name, self.stream, self.label = _name(eng, coll, name, self.pset, ordered)

    def what(self, coll: str) -> str:
        return f"{coll} '{self.name}'"


def _prologue(coll: Coll, array: Any, name: str | None, process_set: Any,
              ordered: bool) -> Call:
    """The checks every collective on an array starts with (see :class:`Call`)."""
    return Call(coll, array, name, process_set, ordered)


def _allreduce_request(array: Any, op: Any, name: str | None, prescale_factor: float,
                       postscale_factor: float, process_set: Any, compression: Any,
                       ordered: bool) -> tuple[Call, Request, str]:
    """An allreduce's validated call and request (the one place that builds it for
    ``allreduce_async`` and ``prepare_allreduce``); the string names it in errors."""
    call = _prologue(Coll.ALLREDUCE, array, name, process_set, ordered)
    what = call.what("allreduce")
    op_ = _op(op, Average, what, call.dt, adasum=True)
    pre, post = _scales(prescale_factor, postscale_factor, call.dt, what)
    req = Request(Coll.ALLREDUCE, call.name, call.dt, tuple(call.arr.shape), op_, -1, pre, post,
                  (), _compression_spec(compression), call.pset)
    if op_ == Adasum:
        adasum.check(len(call.eng.pset(call.pset).ranks), call.dt,
                     type(call.arr) is DeviceTensor, req.compression, what)
    return call, req, what


def _root_index(root_rank: Any, members: Sequence[int], world_size: int, what: str) -> int:
    """The position within the process set of the global rank ``root_rank``.

    Checked on the caller's thread before anything is sent: every member that passes the same
    wrong root raises the same error, and no member is left waiting for a root that never
    comes.
    """
    if isinstance(root_rank, (bool, np.bool_)) or not isinstance(root_rank, (int, np.integer)):
        raise InvalidArgumentError(f"{what}: root_rank must be an int, got {root_rank!r}")
    root = int(root_rank)
    if not 0 <= root < world_size:
        raise InvalidArgumentError(f"{what}: root_rank {root} is out of range for {world_size} "
                                   f"ranks")
    if root not in members:
        raise InvalidArgumentError(f"{what}: root_rank {root} is not a member of the process "
                                   f"set (global ranks {list(members)}); root_rank is a global "
                                   f"rank, as in Horovod")
    return list(members).index(root)
