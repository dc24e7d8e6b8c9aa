"""The framework-agnostic public API on NumPy and GPU arrays (re-exported by ``lightcc``).

GPU arrays (CuPy, torch CUDA tensors, DLPack / ``__cuda_array_interface__``) enter zero-copy as
``device.DeviceTensor``s and run through ``device_exec.py``; host arrays are never checked for
it beyond one type test (docs/gpu.md).

Every collective has an ``*_async`` form that returns a :class:`~.engine.Handle` at once and
a blocking form (``synchronize(*_async(...))``). Names identify a tensor across ranks; when
omitted, one is generated from a per-process-set counter, so ranks must then issue unnamed
collectives in the same order. Allreduce and reducescatter average by default, as in Horovod.

``ordered=True`` (every collective) puts the call on its process set's *ordered stream*: the
caller promises that every member issues its ordered calls, of all collective types together,
in the same order (the torch.distributed contract). They are matched by position, not by name
(``name`` then only labels the call in errors and the timeline), which skips name negotiation;
ranks still check that shape, dtype and op agree.
"""
from __future__ import annotations

import atexit
import logging
import threading
import time
from typing import Any, Sequence

import numpy as np

from . import config as config_mod
from . import device, direct, dtypes, mca
from .algorithms import adasum
from .device import DeviceTensor
from .engine import Engine, Handle
from .exceptions import (InvalidArgumentError, LightCCError, NotInitializedError,
                         UnsupportedDTypeError)
from .messages import SHARED_STREAM, Coll, Request

Sum = "sum"
Average = "average"
Min = "min"
Max = "max"
Product = "prod"
BitwiseAnd = "band"     # integer and bool tensors only
BitwiseOr = "bor"
BitwiseXor = "bxor"
Adasum = "adasum"

log = logging.getLogger("lightcc")
mca.apply_from_environment()      # before the script starts MPI, if it has not yet
_lock = threading.RLock()
_engine: Engine | None = None
_atexit_registered = False


class ProcessSet:
    """A subset of ranks that runs collectives on its own (Horovod's ``ProcessSet``).

    Create it with the member ranks, then register it on every rank with
    :func:`add_process_set` (or pass it to ``init(process_sets=[...])``).
    """

    def __init__(self, ranks: Sequence[int] | None = None) -> None:
        self.ranks: list[int] | None = None if ranks is None else sorted(int(r) for r in ranks)
        self.process_set_id: int | None = None

    def _require(self) -> tuple[Engine, int]:
        eng = _get()
        if self.process_set_id is None:
            raise InvalidArgumentError("this ProcessSet has not been added; call "
                                       "add_process_set() on every rank first")
        return eng, self.process_set_id

    def size(self) -> int:
        eng, pid = self._require()
        return len(eng.pset(pid).ranks)

    def rank(self) -> int:
        """This process's rank within the set (-1 when not a member)."""
        eng, pid = self._require()
        idx = eng.pset(pid).index(eng.rank)
        return -1 if idx is None else idx

    def included(self) -> bool:
        eng, pid = self._require()
        return eng.rank in eng.pset(pid).ranks

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet()
global_process_set.process_set_id = 0


# ---- lifecycle ------------------------------------------------------------------------------
def init(comm: Any = None, process_sets: Sequence[ProcessSet] | None = None,
         **overrides: Any) -> None:
    """Start lightcc on this process (collective over ``comm``, default MPI.COMM_WORLD).

    ``overrides`` take precedence over ``LCC_*`` variables, by field name
    (``init(fusion_threshold=8 << 20, algorithm="ring")``). Calling it again while initialized
    does nothing; after ``shutdown()`` it starts a fresh runtime.
    """
    global _engine, _atexit_registered
    with _lock:
        if _engine is not None:
            return
        cfg = config_mod.load(overrides)
        _setup_logging(cfg.log_level)
        mca.apply(cfg.num_links)
        from mpi4py import MPI

        if MPI.Query_thread() < MPI.THREAD_SERIALIZED:
            raise LightCCError("MPI was initialized without thread support; lightcc needs "
                               "MPI_THREAD_SERIALIZED or better (do not set "
                               "mpi4py.rc.thread_level below 'serialized')")
        if comm is None:
            comm = MPI.COMM_WORLD
        elif isinstance(comm, (list, tuple)):
            comm = MPI.COMM_WORLD.Create_group(MPI.COMM_WORLD.Get_group().Incl(list(comm)))
        hostnames = comm.allgather(MPI.Get_processor_name())
        _engine = Engine(cfg, comm, hostnames)
        from .kernels import _threads

        _threads.configure(cfg.codec_threads, hostnames.count(hostnames[_engine.rank]))
        _install_rank_prefix(_engine.rank)
        mca.warn_if_too_late(cfg.num_links, _engine.topo.num_nodes, _engine.rank)
        _start_extras(_engine, cfg)
        global_process_set.ranks = list(range(_engine.size))
        if not _atexit_registered:
            atexit.register(shutdown)
            _atexit_registered = True
    for ps in process_sets or ():
        add_process_set(ps)


_added_sets: list["ProcessSet"] = []


def shutdown() -> None:
    """Stop the background thread; pending collectives fail with ``ShutdownError``.

    Process sets added since ``init()`` become unusable (their ids belong to this runtime).
    """
    global _engine
    with _lock:
        eng, _engine = _engine, None
        for ps in _added_sets:
            ps.process_set_id = None
        _added_sets.clear()
    if eng is not None:
        _stop_extras(eng)
        eng.shutdown(eng.config.shutdown_timeout)


def _start_extras(eng: Engine, cfg: config_mod.Config) -> None:
    """Timeline (``LCC_TIMELINE``) and autotuner (``LCC_AUTOTUNE``), right after the engine."""
    if cfg.timeline:
        from . import timeline

        try:
            timeline.start(eng, cfg.timeline, mark_cycles=True,
                           all_ranks=bool(getattr(cfg, "timeline_all_ranks", False)))
        except OSError as exc:   # a bad path must not leave the other ranks waiting
            log.error("LCC_TIMELINE=%s: cannot write the timeline: %s", cfg.timeline, exc)
    if cfg.autotune != "0":
        from . import autotune

        autotune.start(eng, cfg)


def _stop_extras(eng: Engine) -> None:
    from . import autotune, timeline

    autotune.stop(eng)
    timeline.stop(eng)


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start writing a Chrome/Perfetto trace to ``file_path`` (Horovod's name and arguments).

    Rank 0 writes ``file_path``; other ranks write ``file_path.rank<N>`` only when
    ``LCC_TIMELINE_ALL_RANKS=1``. ``mark_cycles`` adds a marker per engine cycle.
    """
    from . import timeline

    eng = _get()
    timeline.start(eng, str(file_path), mark_cycles=mark_cycles,
                   all_ranks=bool(getattr(eng.config, "timeline_all_ranks", False)))


def stop_timeline() -> None:
    """Stop the timeline started by :func:`start_timeline` (or ``LCC_TIMELINE``), close it."""
    from . import timeline

    timeline.stop(_get())


def is_initialized() -> bool:
    return _engine is not None


def _get() -> Engine:
    eng = _engine
    if eng is None:
        raise NotInitializedError("lightcc is not initialized: call lightcc.init() first "
                                  "(or it was shut down)")
    return eng


def engine() -> Engine:
    """The running engine (for the torch layer, the timeline and the autotuner)."""
    return _get()


def config() -> config_mod.Config:
    return _get().config


def rank() -> int:
    return _get().rank


def size() -> int:
    return _get().size


def local_rank() -> int:
    return _get().topo.local_rank


def local_size() -> int:
    return _get().topo.local_size


def cross_rank() -> int:
    return _get().topo.cross_rank


def cross_size() -> int:
    return _get().topo.cross_size


def is_homogeneous() -> bool:
    return _get().topo.is_homogeneous


def stats() -> dict[str, Any]:
    """Wire bytes and call counts per communicator, plus totals, since ``init()``."""
    eng = _get()
    comms = {"world": eng.topo.world, "local": eng.topo.local, "cross": eng.topo.cross}
    for pid, group in eng.groups.items():
        if pid and group.topo is not None:
            comms[f"pset{pid}"] = group.topo.world
        if group.device is not None:       # NCCL communicators count their own bytes
            for c in group.device.comms():
                if all(c.stats is not h.stats for h in comms.values()):
                    comms[f"{'' if not pid else f'pset{pid}.'}device.{c.name}"] = c
    out: dict[str, Any] = {name: c.stats.snapshot() for name, c in comms.items()}
    out["bytes_sent"] = sum(v["bytes_sent"] for v in out.values())
    out["bytes_received"] = sum(v["bytes_received"] for k, v in out.items()
                                if isinstance(v, dict))
    return out


# ---- helpers --------------------------------------------------------------------------------
def _setup_logging(level: str) -> None:
    mapping = {"trace": logging.DEBUG, "debug": logging.DEBUG, "info": logging.INFO,
               "warning": logging.WARNING, "error": logging.ERROR, "fatal": logging.CRITICAL}
    log.setLevel(mapping[level])
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[lightcc %(rank)s] %(levelname)s: %(message)s"))
        log.addHandler(handler)
        log.propagate = False


class _RankFilter(logging.Filter):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = f"rank {self.rank}"
        return True


def _install_rank_prefix(rank_: int) -> None:
    for f in list(log.filters):
        if isinstance(f, _RankFilter):
            log.removeFilter(f)
    log.addFilter(_RankFilter(rank_))


def _pset_id(process_set: Any) -> int:
    if process_set is None:
        return 0
    if isinstance(process_set, ProcessSet):
        if process_set.process_set_id is None:
            raise InvalidArgumentError("process set was not added with add_process_set()")
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
    elif device.is_device_array(value):    # GPU memory: a zero-copy CuPy view
        dt = device.adopt(value, what)
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
        if adasum:      # checked with the process set in allreduce_async (algorithms/adasum.py)
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
    """The request for a GPU tensor (executed by device_exec.py), and ``out`` checked for it;
    the process set is tied to the tensor's GPU on this rank."""
    device.bind(_get().pset(req.pset), arr, what)
    if out is not None:
        out = device.check_out(out, arr, what)
    return req._replace(device=True), out


def _compression_spec(compression: Any) -> str:
    if compression is None:
        return "none"
    spec = getattr(compression, "spec", compression)
    if not isinstance(spec, str):
        raise InvalidArgumentError(f"compression must be a Compression value or spec string, "
                                   f"got {compression!r}")
    if spec not in _VALID_SPECS:
        from . import compression as comp_mod

        try:
            comp_mod.make(spec)  # validates the spec now, on the user's thread
        except ValueError as exc:
            raise InvalidArgumentError(str(exc)) from None
        _VALID_SPECS.add(spec)
    return spec


# ---- collectives ----------------------------------------------------------------------------
def allreduce_async(array: Any, op: str | None = None, name: str | None = None,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: Any = None, compression: Any = None,
                    out: np.ndarray | None = None, *, ordered: bool = False,
                    _wake: bool = True) -> Handle:
    """Start reducing ``array`` over the process set (default op: Average).

    With ``out`` (same shape and dtype), the result is written there (``out`` may be
    ``array`` itself for an in-place reduction) and the handle returns it.
    """
    eng = _get()
    arr = _as_array(array, "allreduce")
    dt = dtypes.name_of(arr.dtype)
    pset = _pset_id(process_set)
    eng.pset(pset)
    nm, stream, label = _name(eng, Coll.ALLREDUCE, name, pset, ordered)
    what = f"allreduce '{nm}'"
    op_ = _op(op, Average, what, dt, adasum=True)
    pre, post = _scales(prescale_factor, postscale_factor, dt, what)
    req = Request(Coll.ALLREDUCE, nm, dt, tuple(arr.shape), op_, -1, pre, post, (),
                  _compression_spec(compression), pset)
    if op_ == Adasum:
        adasum.check(len(eng.pset(pset).ranks), dt, type(arr) is DeviceTensor, req.compression,
                     what)
    if type(arr) is DeviceTensor:
        req, out = _on_device(req, arr, out, what)
    else:
        _check_out(out, arr, what)
    return eng.submit(req, arr, out, wake=_wake, stream=stream, label=label)


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
                                       _wake=False))


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
    eng._check_alive()
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
                                    eng.config.direct_bytes)
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
                    ordered: bool = False, _wake: bool = True) -> Handle:
    """Start concatenating every rank's ``array`` along the first dimension (sizes may differ)."""
    eng = _get()
    arr = _as_array(array, "allgather")
    dt = dtypes.name_of(arr.dtype)
    pset = _pset_id(process_set)
    eng.pset(pset)
    nm, stream, label = _name(eng, Coll.ALLGATHER, name, pset, ordered)
    if arr.ndim == 0:
        raise InvalidArgumentError(f"allgather '{nm}': needs at least one dimension, got a "
                                   f"0-d array (reshape it to (1,))")
    req = Request(Coll.ALLGATHER, nm, dt, tuple(arr.shape), pset=pset)
    if type(arr) is DeviceTensor:
        req, _ = _on_device(req, arr, None, f"allgather '{nm}'")
    return eng.submit(req, arr, wake=_wake, stream=stream, label=label)


def allgather(array: Any, name: str | None = None, process_set: Any = None, *,
              ordered: bool = False) -> np.ndarray:
    return synchronize(allgather_async(array, name, process_set, ordered=ordered,
                                       _wake=False))


def broadcast_async(array: Any, root_rank: int, name: str | None = None,
                    process_set: Any = None, out: np.ndarray | None = None, *,
                    ordered: bool = False, _wake: bool = True) -> Handle:
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
    return eng.submit(req, arr, out, wake=_wake, stream=stream, label=label)


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


def broadcast(array: Any, root_rank: int, name: str | None = None,
              process_set: Any = None, *, ordered: bool = False) -> np.ndarray:
    return synchronize(broadcast_async(array, root_rank, name, process_set, ordered=ordered,
                                       _wake=False))


def alltoall_async(array: Any, splits: Sequence[int] | None = None, name: str | None = None,
                   process_set: Any = None, *, ordered: bool = False,
                   _wake: bool = True) -> Handle:
    """Start an all-to-all: rows ``splits[r]`` of ``array`` go to rank r (even split if None).

    The result is ``(output, received_splits)`` when ``splits`` is given, else ``output``.
    """
    eng = _get()
    arr = _as_array(array, "alltoall")
    dt = dtypes.name_of(arr.dtype)
    pset = _pset_id(process_set)
    n = len(eng.pset(pset).ranks)
    nm, stream, label = _name(eng, Coll.ALLTOALL, name, pset, ordered)
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
    handle = eng.submit(req, arr, wake=_wake, stream=stream, label=label)
    if splits is None:
        return _Derived(handle, lambda res: res[0])
    return handle


def alltoall(array: Any, splits: Sequence[int] | None = None, name: str | None = None,
             process_set: Any = None, *, ordered: bool = False) -> Any:
    return synchronize(alltoall_async(array, splits, name, process_set, ordered=ordered,
                                      _wake=False))


def reducescatter_async(array: Any, op: str | None = None, name: str | None = None,
                        process_set: Any = None, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0, *, ordered: bool = False,
                        _wake: bool = True) -> Handle:
    """Start reducing ``array`` and scattering its first dimension (earlier ranks get extra)."""
    eng = _get()
    arr = _as_array(array, "reducescatter")
    dt = dtypes.name_of(arr.dtype)
    pset = _pset_id(process_set)
    eng.pset(pset)
    nm, stream, label = _name(eng, Coll.REDUCESCATTER, name, pset, ordered)
    what = f"reducescatter '{nm}'"
    if arr.ndim == 0:
        raise InvalidArgumentError(f"{what}: needs at least one dimension")
    op_ = _op(op, Average, what, dt)
    pre, post = _scales(prescale_factor, postscale_factor, dt, what)
    req = Request(Coll.REDUCESCATTER, nm, dt, tuple(arr.shape), op_, -1, pre, post, pset=pset)
    if type(arr) is DeviceTensor:
        req, _ = _on_device(req, arr, None, what)
    return eng.submit(req, arr, wake=_wake, stream=stream, label=label)


def reducescatter(array: Any, op: str | None = None, name: str | None = None,
                  process_set: Any = None, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0, *, ordered: bool = False) -> np.ndarray:
    return synchronize(reducescatter_async(array, op, name, process_set, prescale_factor,
                                           postscale_factor, ordered=ordered, _wake=False))


def barrier_async(process_set: Any = None, name: str | None = None, *,
                  ordered: bool = False, _wake: bool = True) -> Handle:
    """Start a barrier; the handle completes once every rank of the process set has called it."""
    eng = _get()
    pset = _pset_id(process_set)
    eng.pset(pset)
    nm, stream, label = _name(eng, Coll.BARRIER, name, pset, ordered)
    return eng.submit(Request(Coll.BARRIER, nm, pset=pset), wake=_wake, stream=stream,
                      label=label)


def barrier(process_set: Any = None, *, ordered: bool = False) -> None:
    """Wait until every rank of the process set has called ``barrier``."""
    synchronize(barrier_async(process_set, ordered=ordered, _wake=False))


def join() -> int:
    """Stop contributing: until every rank has joined, this rank's share of allreduces is
    zeros (and of allgathers empty). Returns the last rank to join."""
    eng = _get()
    eng._joined = True
    handle = eng.submit(Request(Coll.JOIN, "join"))
    path = eng.groups[0].direct
    if path is not None:    # meanwhile, add zeros to the others' direct calls (direct.py)
        path.serve_join(eng, handle)
    return synchronize(handle)


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set (collective: every rank calls it with the same ranks)."""
    eng = _get()
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if ps.process_set_id is not None:
        raise InvalidArgumentError(f"{ps} was already added")
    ranks = tuple(ps.ranks or ())
    if not ranks or len(set(ranks)) != len(ranks) or not all(0 <= r < eng.size for r in ranks):
        raise InvalidArgumentError(f"process set ranks {list(ranks)} must be distinct ranks in "
                                   f"0..{eng.size - 1}")
    req = Request(Coll.ADD_PSET, f"add_process_set{list(ranks)}", splits=ranks)
    ps.process_set_id = int(synchronize(eng.submit(req)))
    _added_sets.append(ps)
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set (collective over all ranks). Returns True when removed."""
    eng = _get()
    pid = _pset_id(process_set)
    if pid == 0:
        raise InvalidArgumentError("the global process set cannot be removed")
    eng.pset(pid)
    synchronize(eng.submit(Request(Coll.REMOVE_PSET, f"remove_process_set.{pid}", root=pid)))
    if isinstance(process_set, ProcessSet):
        process_set.process_set_id = None
        if process_set in _added_sets:
            _added_sets.remove(process_set)
    return True


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
