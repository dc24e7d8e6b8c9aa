"""The CUDA runtime side of the CuPy double: the log, device memory, devices, streams, events,
pinned memory and ``memcpyAsync`` (see :mod:`.fake_cupy` for what is followed and how).
"""
from __future__ import annotations

import ctypes
import itertools
import os
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

    @property
    def pci_bus_id(self) -> str:
        """The doubles give every rank (thread or process) a GPU of its own, as NCCL needs;
        a test that wants two ranks on one GPU patches factory.device_key."""
        return f"fake:{os.getpid()}:{threading.get_ident()}:{self.id}"

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
