"""Tensor <-> array adapters: hand the core a view of a tensor's memory, never a copy when the
tensor allows it.

A contiguous CPU tensor becomes ``t.detach().numpy()`` (same memory); bfloat16 goes through an
int16 view re-typed as ``ml_dtypes.bfloat16``. A contiguous CUDA tensor becomes a
:class:`~lightcc.common.gpu_arrays.DeviceTensor` (a zero-copy CuPy view; bfloat16 as int16 bits,
bool as uint8) whose ready event is recorded on torch's current stream, so the engine's stream
waits for the kernels that produced it. A non-contiguous tensor is staged through a contiguous
copy on its own device; :class:`Staged` remembers where the result must be copied back. Tensors
of other devices go through a CPU copy.

Waiting for a CUDA result happens inside :func:`torch_stream`, which makes torch's current
stream CuPy's current stream, so the core makes *that* stream wait for the engine's work.

:func:`stage` is the one staging step of both torch paths: the Horovod API (``mpi_ops``,
``DistributedOptimizer``) stages with the defaults; the torch.distributed backend (``c10d/``,
``ddp_hooks``) uses :func:`host_stage`, which keeps CPU storages resizable and takes CUDA
tensors through host memory.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..common import dtypes, gpu_arrays
from ..common.exceptions import UnsupportedDTypeError

_BF16 = dtypes.BFLOAT16

# torch dtypes lightcc reduces (Horovod's set plus bfloat16 and bool).
SUPPORTED_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.bool)


class TensorTypeError(UnsupportedDTypeError, ValueError):
    """A tensor dtype lightcc cannot communicate (Horovod raises ``ValueError`` here)."""


def check_dtype(t: torch.Tensor, what: str) -> None:
    if t.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES)
        raise TensorTypeError(f"{what}: tensor type {t.dtype} is not supported; "
                              f"supported: {names}")


def as_array(t: torch.Tensor) -> np.ndarray:
    """A NumPy view of the contiguous CPU tensor ``t`` (shares memory; ``Tensor.numpy()``, the
    fastest view, which marks the storage as never resizable again)."""
    if t.requires_grad:
        t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(_BF16)
    return t.numpy()


_NP = {torch.uint8: np.uint8, torch.int8: np.int8, torch.int16: np.int16,
       torch.int32: np.int32, torch.int64: np.int64, torch.float16: np.float16,
       torch.float32: np.float32, torch.float64: np.float64, torch.bool: np.bool_,
       torch.bfloat16: _BF16}
_NP = {k: np.dtype(v) for k, v in _NP.items()}


def host_view(t: torch.Tensor) -> np.ndarray:
    """A NumPy array on the memory of the contiguous CPU tensor ``t`` (no copy).

    Built from the data pointer rather than ``Tensor.numpy()``, which marks the tensor's
    storage as never resizable again (DDP's bucket buffers are resized by torch's batched
    PowerSGD hook); about 1.5 us slower. The array keeps ``t`` alive, as ``numpy()`` does.
    """
    dt = _NP[t.dtype]
    nbytes = t.numel() * dt.itemsize
    if nbytes == 0:
        return np.empty(tuple(t.shape), dt)
    raw = (ctypes.c_uint8 * nbytes).from_address(t.data_ptr())
    raw._tensor = t           # the array's base holds the tensor
    return np.frombuffer(raw, dtype=dt).reshape(tuple(t.shape))


def from_array(a: np.ndarray) -> torch.Tensor:
    """A tensor sharing ``a``'s memory (bfloat16 arrays included)."""
    if _BF16 is not None and a.dtype == _BF16:
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
    if not a.flags.writeable:
        a = a.copy()
    return torch.from_numpy(a)


@dataclass
class Staged:
    """An array the core may read and write, plus the tensor it stands for.

    ``copy_back`` is True when ``array`` is a staging copy (non-contiguous or non-CPU tensor)
    whose contents must be written back into ``tensor`` after an in-place collective;
    ``gpu`` when ``array`` is a DeviceTensor (``work`` then lives on the tensor's GPU).
    """

    tensor: torch.Tensor
    work: torch.Tensor      # contiguous tensor backing ``array`` (CPU, or the tensor's GPU)
    array: Any              # np.ndarray, or a DeviceTensor for CUDA tensors
    copy_back: bool
    gpu: bool = False

    def finish(self) -> torch.Tensor:
        """Write the result into ``tensor`` when it was staged; returns ``tensor``."""
        if self.copy_back:
            with torch.no_grad():
                self.tensor.copy_(self.work)
        return self.tensor


def stage(t: torch.Tensor, what: str, cuda: bool = True, resizable: bool = False) -> Staged:
    """Prepare ``t`` for the core: a view when possible, else a contiguous copy.

    ``cuda``: a CUDA tensor becomes a zero-copy DeviceTensor (a non-contiguous one is copied
    on its GPU); False stages it through a CPU copy, like tensors of other devices.
    ``resizable``: CPU views come from :func:`host_view` (the storage stays resizable) instead
    of :func:`as_array`.
    """
    if type(t) is torch.Tensor and t.is_cpu and t.dtype in _NP \
            and t.layout == torch.strided and t.is_contiguous():     # the common case, fast
        return Staged(t, t, host_view(t) if resizable else as_array(t), False)
    if not isinstance(t, torch.Tensor):
        raise TensorTypeError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    check_dtype(t, what)
    if t.is_sparse:
        raise TensorTypeError(f"{what}: sparse tensors are not supported here (use "
                              f"DistributedOptimizer's sparse handling or to_dense())")
    view = host_view if resizable else as_array
    if t.device.type == "cpu" and t.is_contiguous():
        return Staged(t, t, view(t), False)
    if cuda and t.device.type == "cuda":  # zero copy; a non-contiguous one is copied on the GPU
        work = t if t.is_contiguous() else t.detach().contiguous()
        return Staged(t, work, device_array(work, ready=True), work is not t, True)
    work = t.detach().to("cpu", copy=True).contiguous()
    return Staged(t, work, view(work), True)


# The torch.distributed flavour: storages stay resizable, CUDA tensors go through host memory.
host_stage = functools.partial(stage, cuda=False, resizable=True)


def copy_into(dst: torch.Tensor, src: np.ndarray) -> None:
    """``dst[...] = src`` (same number of elements) for any device and layout of ``dst``."""
    with torch.no_grad():
        dst.copy_(from_array(np.ascontiguousarray(src)).reshape(dst.shape))


def result_like(t: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """A fresh contiguous tensor shaped like ``t`` on its device (CPU or GPU) and its array
    view (an ``out=`` target)."""
    if t.device.type == "cuda":
        out = torch.empty_like(t, memory_format=torch.contiguous_format)
        return out, device_array(out)
    out = empty_host(t.shape, t.dtype)
    return out, as_array(out)


# Transparent huge pages for large fresh host tensors. NumPy asks the kernel for them on every
# allocation of 4 MB or more (madvise(MADV_HUGEPAGE)); torch's CPU allocator does not unless the
# user sets THP_MEM_ALLOC_ENABLE=1. Without them a fresh 64 MB result is faulted in 4 KB page
# by page (16,384 faults, inside MPI_Allreduce): lightcc.torch.allreduce of 64 MB out of place
# took 90 ms where the NumPy API took 30 ms (2 ranks, one machine, docs/memory.md).
_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


@functools.lru_cache(maxsize=1)
def _madvise() -> Any:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


def empty_host(shape: Any, dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype)`` on the CPU; from 4 MB on, the huge-page-aligned part
    of its memory is advised to the kernel as huge-page memory before anything touches it (as
    NumPy does for its arrays). Where the kernel has no transparent huge pages, or in
    ``never`` mode, the advice changes nothing."""
    out = torch.empty(shape, dtype=dtype)
    nbytes = out.numel() * out.element_size()
    madvise = _madvise() if nbytes >= 2 * _HUGE_PAGE else None
    if madvise is not None:
        start = (out.data_ptr() + _HUGE_PAGE - 1) & ~(_HUGE_PAGE - 1)
        end = (out.data_ptr() + nbytes) & ~(_HUGE_PAGE - 1)
        if end > start:
            madvise(start, end - start, _MADV_HUGEPAGE)   # advice: a failure changes nothing
    return out


# ---- CUDA tensors ---------------------------------------------------------------------------
def _cupy() -> Any:
    from ..common.kernels import cuda as kc

    return kc.cupy_or_raise()


def device_array(t: torch.Tensor, ready: bool = False) -> gpu_arrays.DeviceTensor:
    """A DeviceTensor viewing the contiguous CUDA tensor ``t`` (no copy).

    With ``ready``, its ready event is recorded now on torch's current stream of ``t``'s
    device: the engine's stream waits on it before reading ``t``.
    """
    from ..common.kernels import cuda as kc

    t = t.detach()
    if t.dtype in (torch.bfloat16, torch.bool):    # CuPy has neither: integer bits
        dt = gpu_arrays.torch_view(t)
    else:
        dt = gpu_arrays.DeviceTensor(kc.as_cupy(t))
    if ready:
        cupy = _cupy()
        dt.ready = gpu_arrays.record_event(dt.device, cupy.cuda.ExternalStream(
            torch.cuda.current_stream(t.device).cuda_stream, dt.device))
    return dt


def from_device(result: Any, like: torch.Tensor) -> torch.Tensor:
    """The torch tensor of a CuPy result (zero copy), re-typed like ``like`` (bf16, bool)."""
    out = torch.from_dlpack(result)
    if like.dtype in (torch.bfloat16, torch.bool) and out.dtype != like.dtype:
        out = out.view(like.dtype)
    return out


def torch_stream(dev: torch.device | None) -> Any:
    """While active, CuPy's current stream is torch's current stream of ``dev`` (nothing for
    None or when they already agree), so waiting for a CUDA result orders torch's stream."""
    if dev is None:
        return contextlib.nullcontext()
    cupy = _cupy()
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    ptr = torch.cuda.current_stream(dev).cuda_stream
    if index == cupy.cuda.runtime.getDevice() and ptr == cupy.cuda.get_current_stream().ptr:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(cupy.cuda.Device(index))     # CuPy enters a stream on its own device
    stack.enter_context(cupy.cuda.ExternalStream(ptr, index))
    return stack


def to_device(result: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Move a CPU result to ``like``'s device (no-op on CPU)."""
    return result if like.device.type == "cpu" else result.to(like.device)


def core_result(result: Any, like: torch.Tensor) -> torch.Tensor:
    """The tensor for a core result made for ``like``: a CUDA (CuPy) result as a zero-copy
    tensor, a host result moved to ``like``'s device (tensors of other devices)."""
    if like.device.type == "cuda":
        return from_device(result, like)
    return to_device(from_array(result), like)
