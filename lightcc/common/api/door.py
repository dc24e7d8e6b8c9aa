"""The door for framework adapters (lightcc.torch): a prepared allreduce (validated once,
submitted many times), compressor state, and process-set queries, so an adapter never reaches
into the engine."""
from __future__ import annotations

import functools
from typing import Any

from ..control.messages import Coll, Request
from ..gpu_arrays import DeviceTensor
from ..engine import Engine, Handle
from ..exceptions import InvalidArgumentError
from . import state
from .checks import _allreduce_request, _compression_spec, _on_device, _pset_id, _root_index
from .state import _get


class Prepared:
    """An allreduce validated once by :func:`prepare_allreduce`, submitted many times.

    ``submit`` queues the same request again without checking anything: the array (and
    ``out``) must have the prepared shape, dtype and memory kind (host or GPU), which
    :meth:`fits` tells, together with whether the runtime it was prepared on still runs (not
    after ``shutdown()``, a re-``init()`` or the removal of its process set).
    """

    __slots__ = ("_engine", "_request", "_shape", "_dtype", "_kind", "submit")

    def __init__(self, eng: Engine, request: Request, stream: int | None, label: str | None,
                 arr: Any) -> None:
        self._engine, self._request = eng, request
        self._shape, self._dtype, self._kind = tuple(arr.shape), arr.dtype, type(arr)
        #: ``submit(array, out=None, *, wake=True) -> Handle``: queue the prepared allreduce of
        #: ``array`` (result in ``out`` when given). It is ``Engine.submit`` with the request
        #: bound, so a gradient's hot path has no frame of its own here.
        self.submit = functools.partial(eng.submit, request, stream=stream, label=label)

    @property
    def name(self) -> str:
        """The name the request is matched by (a generated one for unnamed calls)."""
        return self._request.name

    def fits(self, array: Any) -> bool:
        """True when ``array`` (a NumPy array or a ``device.DeviceTensor``) may be submitted."""
        eng = self._engine
        return (eng is state._engine and type(array) is self._kind and array.shape == self._shape
                and array.dtype == self._dtype and self._request.pset in eng.groups)

    def __repr__(self) -> str:
        return f"<Prepared {self._request.describe()} {self._shape} {self._dtype}>"


def prepare_allreduce(array: Any, op: str | None = None, name: str | None = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: Any = None, compression: Any = None, *,
                      ordered: bool = False, priority: int = 0) -> Prepared:
    """Validate an allreduce of ``array`` once (the errors of :func:`allreduce_async`) for
    repeated :meth:`Prepared.submit` calls: a gradient reduced every step pays for the checks at
    the first step only. ``array`` fixes the shape, dtype and memory kind; its values are not
    used here. ``priority`` (0: none; 1 goes first): see ``Request.priority``; every rank
    must give the same, or the allreduce fails on every rank."""
    call, req, what = _allreduce_request(array, op, name, prescale_factor, postscale_factor,
                                         process_set, compression, ordered)
    if priority:
        req = req._replace(priority=int(priority))
    if type(call.arr) is DeviceTensor:
        req, _ = _on_device(req, call.arr, None, what)
    return Prepared(call.eng, req, call.stream, call.label, call.arr)


def compressor(process_set: Any = None, spec: Any = None, create: bool = False) -> Any:
    """The process set's compressor for the compression ``spec`` (a ``Compression`` value or
    spec string), which holds its error-feedback residuals and PowerSGD factors; None for no
    compression, or when ``create`` is False and none was made yet."""
    spec_ = _compression_spec(spec)
    if spec_ == "none":
        return None
    group = _get().group(_pset_id(process_set))
    return group.compressor(spec_) if create else group.compressors.get(spec_)


def process_set_ranks(process_set: Any = None) -> tuple[int, ...]:
    """The world ranks of ``process_set`` (None: all ranks), in ascending order."""
    return tuple(_get().pset(_pset_id(process_set)).ranks)


def process_set_rank(process_set: Any = None) -> int:
    """This process's index within ``process_set`` (-1 when it is not a member)."""
    eng = _get()
    idx = eng.pset(_pset_id(process_set)).index(eng.rank)
    return -1 if idx is None else idx


def root_index(root_rank: Any, process_set: Any = None, what: str = "broadcast") -> int:
    """The index within ``process_set`` of the *global* rank ``root_rank``; raises
    InvalidArgumentError naming ``what`` when it is not an int, out of range or not a member
    (checked before anything is sent, so every member raises alike)."""
    eng = _get()
    return _root_index(root_rank, eng.pset(_pset_id(process_set)).ranks, eng.size, what)


def auto_name(collective: Any, process_set: Any = None) -> str:
    """The next Horovod-style generated name (``allreduce.noname.7``) of ``collective`` (a
    ``Coll`` or its lower-case name) on ``process_set``; counters are per type and set."""
    if isinstance(collective, str):
        try:
            collective = Coll[collective.upper()]
        except KeyError:
            raise InvalidArgumentError(f"unknown collective {collective!r}") from None
    elif not isinstance(collective, Coll):
        raise InvalidArgumentError(f"collective must be a Coll or its name, got {collective!r}")
    eng, pid = _get(), _pset_id(process_set)
    eng.pset(pid)
    return eng.auto_name(collective, pid)
