"""GPU arrays in the core: zero-copy adoption, the producer's ready event, the consumer's wait.

A device array (CuPy, a torch CUDA tensor, anything with ``__cuda_array_interface__`` or a CUDA
DLPack device) enters the core as a :class:`DeviceTensor`: a CuPy view of the same memory, the
dtype lightcc reduces it as (bfloat16 and bool travel as 2- and 1-byte integer views, since
CuPy has no bfloat16 and CuPy 13 crashes importing one through DLPack), and the CUDA event
recorded on the caller's current stream at submit. The engine's stream waits on that event
before reading the tensor, so the producer's kernels need no host sync.

A finished device collective completes its handle with a :class:`Completion`: the event
recorded on the engine's stream after the last kernel that writes the results. ``wait()`` /
``synchronize()`` make the caller's current CuPy stream wait on it (again no host sync) and then
return; the torch layer maps torch's current stream onto CuPy's for the duration of the call.

Only values that are not NumPy arrays are ever checked here, so host arrays pay nothing.
Importing this module does not import CuPy.
"""
from __future__ import annotations

import contextlib
from typing import Any

import numpy as np

from .exceptions import InvalidArgumentError
from .kernels import cuda as kc

#: DLPack device types that are GPU memory (kDLCUDA, kDLCUDAManaged).
CUDA_DLPACK_DEVICES = (2, 13)


def is_device_array(obj: Any) -> bool:
    """True for an array in GPU memory (see module docstring); False for anything else."""
    if isinstance(obj, DeviceTensor) or hasattr(obj, "__cuda_array_interface__"):
        return True
    where = getattr(obj, "__dlpack_device__", None)
    if where is None:
        return False
    try:
        return int(where()[0]) in CUDA_DLPACK_DEVICES
    except Exception:  # a broken __dlpack_device__ is not a GPU array
        return False


class DeviceTensor:
    """A C-contiguous CuPy view of a device tensor, with the dtype lightcc treats it as.

    ``array`` holds the memory (``storage`` dtype: int16/uint16 for bfloat16, uint8 for bool,
    else the dtype itself); ``dtype`` is the NumPy dtype the core reduces it as (ml_dtypes'
    bfloat16 for bfloat16); ``device`` the CUDA device id; ``ready`` the event after which the
    contents may be read (None until :func:`adopt` records it).
    """

    __slots__ = ("array", "dtype", "shape", "device", "ready")

    def __init__(self, array: Any, dtype: Any = None, ready: Any = None) -> None:
        self.array = array
        self.dtype = np.dtype(array.dtype if dtype is None else dtype)
        if self.dtype.itemsize != array.dtype.itemsize:
            raise InvalidArgumentError(f"a {array.dtype} view cannot hold {self.dtype} elements")
        self.shape = tuple(array.shape)
        self.device = int(array.device.id)
        self.ready = ready

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(self.array.size)

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)

    def __repr__(self) -> str:
        return f"DeviceTensor({self.shape}, {self.dtype}, cuda:{self.device})"


def on_device(cupy: Any, device_id: int) -> Any:
    """A context that makes ``device_id`` CuPy's current device (nothing when it already is)."""
    if cupy.cuda.runtime.getDevice() == device_id:
        return contextlib.nullcontext()
    return cupy.cuda.Device(device_id)


def record_event(device_id: int, stream: Any = None) -> Any:
    """A new CUDA event recorded on ``stream`` (default: the current stream of the device)."""
    cupy = kc.cupy_or_raise()
    with on_device(cupy, device_id):
        event = cupy.cuda.Event(block=False, disable_timing=True)
        event.record(stream)
    return event


#: torch dtypes CuPy cannot import through DLPack, and the integer view they travel as
_TORCH_VIEWS = {"torch.bfloat16": ("int16", "bfloat16"), "torch.bool": ("uint8", "bool")}


def torch_view(t: Any) -> DeviceTensor:
    """A torch CUDA tensor of a dtype CuPy lacks (bfloat16, bool) as an integer view."""
    import torch

    from . import dtypes

    view, name = _TORCH_VIEWS[str(t.dtype)]
    return DeviceTensor(kc.as_cupy(t.detach().view(getattr(torch, view))),
                        dtypes.SUPPORTED[name])


def adopt(obj: Any, what: str) -> DeviceTensor:
    """``obj`` as a :class:`DeviceTensor` (zero copy) with its ready event recorded now.

    InvalidArgumentError for a non-contiguous array; LightCCError when CuPy is missing or the
    import would copy (``kernels.cuda.as_cupy``).
    """
    if isinstance(obj, DeviceTensor):
        dt = obj
    elif type(obj).__module__.startswith("torch") and str(obj.dtype) in _TORCH_VIEWS:
        dt = torch_view(obj)
    else:
        arr = kc.as_cupy(obj)
        if not arr.flags.c_contiguous:
            raise InvalidArgumentError(f"{what}: device arrays must be C-contiguous (got strides "
                                       f"{arr.strides}); pass a contiguous copy")
        dt = DeviceTensor(arr)
    if dt.ready is None:
        dt.ready = record_event(dt.device)
    return dt


def check_out(out: Any, arr: DeviceTensor, what: str) -> DeviceTensor:
    """``out`` for a device input: a C-contiguous device array of the same shape and dtype."""
    if not is_device_array(out):
        raise InvalidArgumentError(f"{what}: the input is on a GPU, so out must be too "
                                   f"(got {type(out).__name__})")
    dt = out if isinstance(out, DeviceTensor) else DeviceTensor(kc.as_cupy(out))
    if dt.shape != arr.shape or dt.dtype != arr.dtype:
        raise InvalidArgumentError(f"{what}: out has shape {dt.shape} {dt.dtype}, input "
                                   f"{arr.shape} {arr.dtype}")
    if dt.device != arr.device:
        raise InvalidArgumentError(f"{what}: out is on GPU {dt.device}, input on GPU {arr.device}")
    if not dt.array.flags.c_contiguous:
        raise InvalidArgumentError(f"{what}: out must be C-contiguous")
    return dt


def bind(group: Any, dt: DeviceTensor, what: str) -> None:
    """Tie the process set to the GPU of its first device tensor on this rank; a tensor on
    another GPU is an error (one GPU per rank, as NCCL requires)."""
    if group.device_id is None:
        group.device_id = dt.device
    elif group.device_id != dt.device:
        raise InvalidArgumentError(f"{what}: tensor is on GPU {dt.device}, but process set "
                                   f"{group.pset} uses GPU {group.device_id} on this rank (one "
                                   f"GPU per rank: select it with torch.cuda.set_device / "
                                   f"cupy.cuda.Device(i).use() before the first collective)")


class Completion:
    """The engine's done event of a device collective, and the arrays it used.

    :meth:`consume` (called by ``Handle.wait``) makes the caller's current stream wait on the
    event; until then the bucket's inputs and outputs are kept alive, so their memory cannot be
    reused while the engine's stream may still touch it.
    """

    __slots__ = ("event", "device", "keep")

    def __init__(self, event: Any, device: int, keep: Any = None) -> None:
        self.event = event
        self.device = device
        self.keep = keep

    def consume(self) -> None:
        cupy = kc.cupy_or_raise()
        with on_device(cupy, self.device):
            cupy.cuda.get_current_stream().wait_event(self.event)
        self.keep = None
