"""A CuPy double backed by NumPy, strict where CuPy is strict, that records what was asked.

What it follows from CuPy (so wrong calls fail here as they would on a GPU):

* ``ndarray`` never converts implicitly to NumPy (``np.asarray(x)`` raises TypeError), refuses
  NumPy arrays as operands, indices or assigned values, and NumPy functions on it
  (``__array_function__``); reading values back (``get``, ``bool``, ``int``, ``float``,
  ``item``, ``tolist``) is a host synchronization and is logged as one;
* ``empty`` returns garbage (0xCD bytes), not zeros;
* streams and events: ``Stream(non_blocking=...)``, ``ExternalStream(ptr, device_id)``,
  ``get_current_stream()`` (per thread; ``with stream:`` makes it current), ``Stream.record``,
  ``wait_event``, ``synchronize``, ``done``; ``Event(block, disable_timing, interprocess)``,
  ``record(stream=None)``, ``synchronize``, ``done``; ``Device(id)`` as a context;
* ``runtime.memcpyAsync(dst, src, size, kind, stream)`` checks that ``dst``/``src`` lie in
  memory of the kind ``kind`` says (device, pinned or other host memory) and within bounds;
* ``alloc_pinned_memory(n)`` returns a buffer ``np.frombuffer`` accepts, with ``.ptr``.

Differences: kernels, NCCL calls and copies into device memory execute at once (ordering is
checked through :data:`LOG`, not through data races). The one asynchrony modelled is the one a
host reader can get wrong: a device-to-host copy reads the device memory when queued but lands
in host memory only when the host synchronizes with its stream (``Stream.synchronize``, an
``Event.synchronize`` of an event recorded after it, ``Device.synchronize``); until then the
destination holds garbage. Arrays export DLPack as host memory (so a CPU-only torch can import
them). Device memory is host memory registered in :data:`MEMORY`.
"""
from __future__ import annotations

import ctypes
import itertools
import operator
import threading
import types
import weakref
from typing import Any

import numpy as np


# ---- the log of everything that matters for ordering -------------------------------------------
class Log:
    """Records ``(kind, stream_ptr, info)``; kinds: launch, copy, nccl, record, wait, sync."""

    def __init__(self) -> None:
        self.records: list[tuple[str, int, Any]] = []
        self.lock = threading.Lock()

    def add(self, kind: str, stream: int, info: Any = None) -> int:
        with self.lock:
            self.records.append((kind, int(stream), info))
            return len(self.records) - 1

    def of(self, kind: str | None = None, stream: int | None = None) -> list:
        return [r for r in self.records if (kind is None or r[0] == kind)
                and (stream is None or r[1] == stream)]

    def clear(self) -> None:
        self.records.clear()


LOG = Log()


# ---- memory ---------------------------------------------------------------------------------
class Memory:
    """Address ranges of live fake allocations and their kind (device, pinned)."""

    def __init__(self) -> None:
        self.blocks: dict[int, tuple[int, str, Any]] = {}

    def add(self, owner: Any, start: int, nbytes: int, kind: str) -> None:
        self.blocks[start] = (nbytes, kind, weakref.ref(owner))

    def kind_of(self, ptr: int, nbytes: int) -> str:
        """The kind of memory ``[ptr, ptr + nbytes)`` lies in; 'host' when unregistered."""
        for start, (size, kind, ref) in list(self.blocks.items()):
            if ref() is None:
                del self.blocks[start]
            elif start <= ptr < start + max(size, 1):
                assert ptr + nbytes <= start + size, \
                    f"{nbytes} bytes at {ptr:#x} overrun a {kind} block of {size} bytes"
                return kind
        return "host"


MEMORY = Memory()


def raw(ptr: int, nbytes: int) -> np.ndarray:
    """A uint8 view of ``nbytes`` bytes at address ``ptr`` (any registered or host memory)."""
    if nbytes == 0:
        return np.empty(0, np.uint8)
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(int(ptr)))


# ---- devices, streams, events ---------------------------------------------------------------
_tls = threading.local()
_ptrs = itertools.count(0x1000)
_event_ids = itertools.count(1)
DEVICE_COUNT = {0: 1}          # [0]: GPUs visible (a test may pretend to have more)


_landing: dict[int, list] = {}        # stream ptr -> device-to-host copies not yet visible


def _land(stream: int | None = None) -> None:
    """Device-to-host copies of ``stream`` (all streams if None) become visible to the host."""
    for ptr in list(_landing) if stream is None else [stream]:
        for dst, data in _landing.pop(ptr, []):
            dst[...] = data


def current_device() -> int:
    return getattr(_tls, "device", 0)


class Device:
    def __init__(self, device: int | None = None) -> None:
        self.id = current_device() if device is None else int(device)
        assert 0 <= self.id < DEVICE_COUNT[0], f"no GPU {self.id}"

    def use(self) -> None:
        _tls.device = self.id

    def synchronize(self) -> None:
        LOG.add("sync", -1, "Device.synchronize")
        _land()

    def __enter__(self) -> "Device":
        _tls.saved_devices = getattr(_tls, "saved_devices", []) + [current_device()]
        _tls.device = self.id
        return self

    def __exit__(self, *exc: Any) -> None:
        _tls.device = _tls.saved_devices.pop()

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, Device) and other.id == self.id

    def __hash__(self) -> int:
        return hash(self.id)


class Event:
    def __init__(self, block: bool = False, disable_timing: bool = False,
                 interprocess: bool = False) -> None:
        self.id = next(_event_ids)
        self.stream: int | None = None

    def record(self, stream: "Stream | None" = None) -> None:
        s = get_current_stream() if stream is None else stream
        assert isinstance(s, Stream), f"Event.record needs a Stream, got {type(s).__name__}"
        self.stream = s.ptr
        LOG.add("record", s.ptr, self.id)

    @property
    def done(self) -> bool:
        LOG.add("sync", -1, "Event.done")
        return True

    def synchronize(self) -> None:
        LOG.add("sync", -1, "Event.synchronize")
        if self.stream is not None:
            _land(self.stream)


class Stream:
    null: "Stream"

    def __init__(self, null: bool = False, non_blocking: bool = False, ptr: int | None = None,
                 device_id: int | None = None) -> None:
        self.ptr = 0 if null else (next(_ptrs) if ptr is None else int(ptr))
        # CuPy: a new stream belongs to the current device; the null stream and an external
        # stream without device_id to whichever device is current (-1)
        self.device_id = (-1 if null or ptr is not None else current_device()) \
            if device_id is None else device_id
        self.non_blocking = non_blocking

    def record(self, event: Event | None = None) -> Event:
        event = Event() if event is None else event
        event.record(self)
        return event

    def wait_event(self, event: Event) -> None:
        assert isinstance(event, Event), f"wait_event needs an Event, got {type(event).__name__}"
        assert event.stream is not None, "waiting on an event that was never recorded"
        LOG.add("wait", self.ptr, event.id)

    def synchronize(self) -> None:
        LOG.add("sync", self.ptr, "Stream.synchronize")
        _land(self.ptr)

    @property
    def done(self) -> bool:
        LOG.add("sync", self.ptr, "Stream.done")
        return True

    def __enter__(self) -> "Stream":
        assert self.device_id in (-1, current_device()), \
            f"stream of device {self.device_id} entered on device {current_device()}"  # as CuPy
        _tls.streams = getattr(_tls, "streams", []) + [self]
        return self

    def __exit__(self, *exc: Any) -> None:
        _tls.streams.pop()


def ExternalStream(ptr: int, device_id: int = -1) -> Stream:  # noqa: N802 (CuPy's name)
    assert isinstance(ptr, int), f"ExternalStream needs an int pointer, got {type(ptr).__name__}"
    assert isinstance(device_id, int), f"device_id must be an int, got {device_id!r}"
    return Stream(ptr=ptr, device_id=device_id)


Stream.null = Stream(null=True)


def get_current_stream(device_id: int = -1) -> Stream:
    streams = getattr(_tls, "streams", None)
    return streams[-1] if streams else Stream.null


# ---- arrays ---------------------------------------------------------------------------------
def _host_array_operand(x: Any) -> bool:
    return isinstance(x, np.ndarray) and not isinstance(x, ndarray) and x.ndim > 0


def _unwrap(x: Any) -> Any:
    if isinstance(x, ndarray):
        return x._a
    if _host_array_operand(x):
        raise TypeError(f"Unsupported type {type(x)}")       # CuPy's message
    if isinstance(x, (list, tuple)):
        return type(x)(_unwrap(v) for v in x)
    return x


def _wrap(a: Any, device: int | None = None) -> Any:
    if isinstance(a, tuple):
        return tuple(_wrap(v, device) for v in a)
    if isinstance(a, np.generic):
        a = np.asarray(a)                    # CuPy reductions return 0-d arrays
    if not isinstance(a, np.ndarray):
        return a
    root = a
    while isinstance(root.base, np.ndarray):
        root = root.base
    if root.flags.owndata:
        MEMORY.add(root, root.ctypes.data, root.nbytes, "device")
    return ndarray._of(a, current_device() if device is None else device)


class ndarray:  # noqa: N801 (CuPy's name)
    """A device array (see module docstring)."""

    __slots__ = ("_a", "_dev", "__weakref__")
    __array_priority__ = 100

    @classmethod
    def _of(cls, a: np.ndarray, device: int) -> "ndarray":
        obj = object.__new__(cls)
        obj._a, obj._dev = a, device
        return obj

    # -- attributes ----------------------------------------------------------------------------
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    size = property(lambda self: self._a.size)
    ndim = property(lambda self: self._a.ndim)
    nbytes = property(lambda self: self._a.nbytes)
    itemsize = property(lambda self: self._a.itemsize)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: types.SimpleNamespace(
        c_contiguous=self._a.flags.c_contiguous, f_contiguous=self._a.flags.f_contiguous))
    data = property(lambda self: types.SimpleNamespace(ptr=self._a.ctypes.data))
    device = property(lambda self: Device(self._dev))
    T = property(lambda self: _wrap(self._a.T, self._dev))

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": self.shape, "typestr": self.dtype.str, "version": 3,
                "data": (self._a.ctypes.data, False), "strides": None}

    def __dlpack__(self, stream: Any = None) -> Any:
        return self._a.__dlpack__()

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)          # host memory underneath (see module docstring)

    # -- NumPy interop: refused as in CuPy ----------------------------------------------------
    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("Implicit conversion to a NumPy array is not allowed. Please use "
                        "`.get()` to construct a NumPy array explicitly.")

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        if "out" in kwargs:
            kwargs["out"] = tuple(_unwrap(o) for o in kwargs["out"])
        return _wrap(getattr(ufunc, method)(*_unwrap(inputs), **kwargs), self._dev)

    def __array_function__(self, func: Any, types_: Any, args: Any, kwargs: Any) -> Any:
        return NotImplemented

    # -- host synchronizations -----------------------------------------------------------------
    def get(self, stream: Any = None, order: str = "C", out: Any = None) -> np.ndarray:
        LOG.add("sync", -1, "ndarray.get")
        if out is not None:
            out[...] = self._a
            return out
        return self._a.copy()

    def set(self, arr: np.ndarray, stream: Any = None) -> None:
        self._a[...] = arr

    def _sync(self, what: str) -> np.ndarray:
        LOG.add("sync", -1, f"ndarray.{what}")
        return self._a

    def __bool__(self) -> bool:
        return bool(self._sync("__bool__"))

    def __int__(self) -> int:
        return int(self._sync("__int__"))

    def __float__(self) -> float:
        return float(self._sync("__float__"))

    def __index__(self) -> int:
        return operator.index(self._sync("__index__"))

    def item(self) -> Any:
        return self._sync("item").item()

    def tolist(self) -> Any:
        return self._sync("tolist").tolist()

    def __len__(self) -> int:
        return len(self._a)

    # -- indexing and views --------------------------------------------------------------------
    def __getitem__(self, key: Any) -> "ndarray":
        return _wrap(self._a[_unwrap(key)], self._dev)

    def __setitem__(self, key: Any, value: Any) -> None:
        self._a[_unwrap(key)] = _unwrap(value)

    def reshape(self, *shape: Any, order: str = "C") -> "ndarray":
        return _wrap(self._a.reshape(*shape, order=order), self._dev)

    def ravel(self) -> "ndarray":
        return _wrap(self._a.ravel(), self._dev)

    def view(self, dtype: Any = None) -> "ndarray":
        return _wrap(self._a.view(dtype), self._dev)

    def astype(self, dtype: Any, copy: bool = True, **kw: Any) -> "ndarray":
        return _wrap(self._a.astype(dtype, copy=copy), self._dev)

    def copy(self, order: str = "C") -> "ndarray":
        return _wrap(self._a.copy(order=order), self._dev)

    def fill(self, value: Any) -> None:
        self._a.fill(value)

    def any(self, axis: Any = None) -> "ndarray":
        return _wrap(self._a.any(axis=axis), self._dev)

    def all(self, axis: Any = None) -> "ndarray":
        return _wrap(self._a.all(axis=axis), self._dev)

    def sum(self, axis: Any = None, dtype: Any = None) -> "ndarray":
        return _wrap(self._a.sum(axis=axis, dtype=dtype), self._dev)

    def max(self, axis: Any = None) -> "ndarray":
        return _wrap(self._a.max(axis=axis), self._dev)

    def min(self, axis: Any = None) -> "ndarray":
        return _wrap(self._a.min(axis=axis), self._dev)

    def __repr__(self) -> str:
        return f"fake_cupy.ndarray({self._a!r}, device={self._dev})"


def _binary(op: Any, inplace: bool = False, reflected: bool = False) -> Any:
    def method(self: ndarray, other: Any) -> Any:
        o = _unwrap(other)
        if inplace:
            self._a[...] = op(self._a, o)
            return self
        return _wrap(op(o, self._a) if reflected else op(self._a, o), self._dev)
    return method


for _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor",
              "lshift", "rshift", "matmul"):
    _op = getattr(operator, _name if _name not in ("and", "or") else _name + "_")
    setattr(ndarray, f"__{_name}__", _binary(_op))
    setattr(ndarray, f"__r{_name}__", _binary(_op, reflected=True))
    setattr(ndarray, f"__i{_name}__", _binary(_op, inplace=True))
for _name in ("lt", "le", "gt", "ge", "eq", "ne"):
    setattr(ndarray, f"__{_name}__", _binary(getattr(operator, _name)))
ndarray.__neg__ = lambda self: _wrap(-self._a, self._dev)
ndarray.__abs__ = lambda self: _wrap(np.abs(self._a), self._dev)
ndarray.__invert__ = lambda self: _wrap(~self._a, self._dev)
ndarray.__module__ = "cupy._core.core"       # what array_module()/is_device_array() look at


# ---- module functions -------------------------------------------------------------------------
def empty(shape: Any, dtype: Any = float, order: str = "C") -> ndarray:
    a = np.empty(shape, dtype)
    a.view(np.uint8).reshape(-1)[...] = 0xCD if a.nbytes else 0   # garbage, like CUDA memory
    return _wrap(a)


def zeros(shape: Any, dtype: Any = float, order: str = "C") -> ndarray:
    return _wrap(np.zeros(shape, dtype))


def ones(shape: Any, dtype: Any = float) -> ndarray:
    return _wrap(np.ones(shape, dtype))


def full(shape: Any, fill_value: Any, dtype: Any = None) -> ndarray:
    return _wrap(np.full(shape, fill_value, dtype))


def arange(*args: Any, dtype: Any = None) -> ndarray:
    return _wrap(np.arange(*args, dtype=dtype))


def asarray(a: Any, dtype: Any = None) -> ndarray:
    """A host -> device copy for NumPy input (explicit, as in CuPy); a device array as is."""
    if isinstance(a, ndarray):
        return a if dtype is None or a.dtype == np.dtype(dtype) else a.astype(dtype)
    if hasattr(a, "__cuda_array_interface__"):
        raise AssertionError("the doubles only hand out fake_cupy arrays")
    return _wrap(np.array(a, dtype=dtype, copy=True))


def ascontiguousarray(a: Any, dtype: Any = None) -> ndarray:
    return _wrap(np.ascontiguousarray(_unwrap(asarray(a)), dtype=dtype))


def from_dlpack(obj: Any) -> ndarray:
    """Zero-copy import (the doubles' "device" tensors are host tensors underneath; they
    say they live on GPU 0, see fake_torch)."""
    a = np.from_dlpack(obj)
    LOG.add("dlpack", get_current_stream().ptr, type(obj).__name__)
    if a.nbytes:
        MEMORY.add(a, a.ctypes.data, a.nbytes, "device")
    return ndarray._of(a, 0)


def _elementwise(fn: Any) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        out = kwargs.pop("out", None)
        if out is not None:
            fn(*_unwrap(args), out=_unwrap(out), **_unwrap(kwargs))
            return out
        return _wrap(fn(*_unwrap(args), **_unwrap(kwargs)))
    return call


for _name in ("where", "isnan", "isfinite", "abs", "sort", "ldexp", "left_shift", "multiply",
              "maximum", "minimum", "logical_not", "concatenate", "add", "subtract"):
    globals()[_name] = _elementwise(getattr(np, _name))


def copyto(dst: ndarray, src: Any, casting: str = "same_kind", where: Any = True) -> None:
    assert isinstance(dst, ndarray), f"copyto into {type(dst).__name__}"
    np.copyto(dst._a, _unwrap(src), casting=casting, where=_unwrap(where))


linalg = types.SimpleNamespace(qr=lambda a, mode="reduced": _wrap(np.linalg.qr(_unwrap(a),
                                                                               mode=mode)))


# ---- pinned host memory and the runtime ---------------------------------------------------------
class PinnedMemoryPointer(bytearray):
    """Page-locked host memory: a buffer ``np.frombuffer`` accepts, with its address ``ptr``."""

    @property
    def ptr(self) -> int:
        return ctypes.addressof((ctypes.c_char * len(self)).from_buffer(self))


def alloc_pinned_memory(nbytes: int) -> PinnedMemoryPointer:
    mem = PinnedMemoryPointer(int(nbytes))
    MEMORY.add(mem, mem.ptr, len(mem), "pinned")
    return mem


_KINDS = {1: ("host", "device"), 2: ("device", "host"), 3: ("device", "device")}


def memcpy_async(dst: int, src: int, size: int, kind: int, stream: int) -> None:
    """``cudaMemcpyAsync(dst, src, size, kind, stream)``, checked against the memory map."""
    for name, v in (("dst", dst), ("src", src), ("size", size), ("kind", kind),
                    ("stream", stream)):
        assert isinstance(v, (int, np.integer)), f"memcpyAsync {name} must be an int, got {v!r}"
    want_src, want_dst = _KINDS[int(kind)]
    got_src, got_dst = MEMORY.kind_of(src, size), MEMORY.kind_of(dst, size)
    for role, want, got in (("source", want_src, got_src), ("destination", want_dst, got_dst)):
        ok = got == "device" if want == "device" else got in ("host", "pinned")
        assert ok, f"memcpyAsync kind {kind}: {role} is {got} memory, expected {want}"
    if int(kind) == 2:          # lands in host memory at the next sync with the stream
        target = raw(dst, size)
        _landing.setdefault(int(stream), []).append((target, raw(src, size).copy()))
        target[...] = 0xCD
    else:
        raw(dst, size)[...] = raw(src, size)
    LOG.add("copy", stream, (int(kind), int(size), got_src if want_src == "host" else
                             got_dst if want_dst == "host" else "device"))


runtime = types.SimpleNamespace(
    getDevice=current_device, getDeviceCount=lambda: DEVICE_COUNT[0],
    memcpyHostToDevice=1, memcpyDeviceToHost=2, memcpyDeviceToDevice=3,
    memcpyAsync=memcpy_async)
