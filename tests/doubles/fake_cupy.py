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

import operator
import types
from typing import Any

import numpy as np

from .fake_cuda import (DEVICE_COUNT, LOG, MEMORY, Device, Event, ExternalStream,  # noqa: F401
                        Stream, alloc_pinned_memory, current_device, get_current_stream, raw,
                        runtime)


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
              "maximum", "minimum", "logical_not", "concatenate", "add", "subtract", "cumsum",
              "trunc"):
    globals()[_name] = _elementwise(getattr(np, _name))


def copyto(dst: ndarray, src: Any, casting: str = "same_kind", where: Any = True) -> None:
    assert isinstance(dst, ndarray), f"copyto into {type(dst).__name__}"
    np.copyto(dst._a, _unwrap(src), casting=casting, where=_unwrap(where))


linalg = types.SimpleNamespace(qr=lambda a, mode="reduced": _wrap(np.linalg.qr(_unwrap(a),
                                                                               mode=mode)))
