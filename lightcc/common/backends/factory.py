"""The one place that picks a process set's device backend and builds its communicators.

Host arrays always use the set's MPI communicators. Device arrays use the communicators made
here, once per process set, when its first device bucket executes (every member executes that
bucket at the same point, so making communicators there is collective-safe):

* ``LCC_BACKEND=nccl``: NCCL (through CuPy) on every member; an error on every member if any
  of them lacks CuPy, NCCL or a GPU;
* ``LCC_BACKEND=mpi``: the set's MPI communicators, staged through pinned host memory
  (:mod:`.staged`);
* ``LCC_BACKEND=auto`` (default): NCCL when every member has it and no two members share a
  GPU, else MPI staging. The members agree (one MPI allgather), so a set never mixes
  backends.

The result, :class:`DeviceComms`, also holds the GPU and the engine's CUDA stream on it.
Importing this module does not import CuPy.
"""
from __future__ import annotations

import logging
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..exceptions import LightCCError
from ..kernels import cuda as kc
from ..topology import Topology
from .staged import PinnedBuffer, StagedCommunicator

log = logging.getLogger("lightcc")


@dataclass
class DeviceComms:
    """A process set's device side on this rank (see module docstring).

    ``topo`` has the device communicators (world/local/cross; one object may serve several
    roles); ``stream`` is the engine's non-blocking stream on ``device``; ``pinned`` the host
    buffer of ``LCC_CPU_REDUCE``.
    """

    device: int
    backend: str
    topo: Topology
    stream: Any
    pinned: PinnedBuffer = field(default_factory=PinnedBuffer)

    def comms(self) -> list:
        """Each distinct communicator once."""
        out: list = []
        for c in (self.topo.world, self.topo.local, self.topo.cross):
            if all(c is not o for o in out):
                out.append(c)
        return out

    def free(self) -> None:
        self.pinned.release()
        for c in self.comms():
            c.free()


def nccl_usable() -> bool:
    """Whether CuPy, NCCL and a GPU are usable in this process."""
    from .nccl import nccl_available

    return nccl_available()


def device_key(device: int) -> int:
    """A number naming the physical GPU ``device`` on this host (its PCI bus id), the same in
    every process that sees it whatever CUDA_VISIBLE_DEVICES renumbered; the index when the
    bus id cannot be read."""
    try:
        bus = kc.cupy_or_raise().cuda.Device(device).pci_bus_id
    except Exception:                      # no CuPy attribute, no driver: the index will do
        return int(device)
    return zlib.crc32(str(bus).lower().encode()) | (1 << 32)


def choose_backend(setting: str, host: Topology, device: int | None = None) -> str:
    """``"nccl"`` or ``"mpi"`` for ``setting`` (auto, nccl, mpi), agreed by all members.

    Collective over the set's host world unless ``setting`` is ``mpi``: one allgather of
    (NCCL usable, node, GPU) per member. NCCL needs every member to have it and refuses two
    members on one GPU ("Duplicate GPU detected"), so ``auto`` takes MPI staging when any two
    members share a GPU, and ``nccl`` raises on every member.
    """
    if setting == "mpi":
        return "mpi"
    world = host.world
    mine = nccl_usable()
    node = host.node_of_rank[world.rank] if host.node_of_rank else 0
    me = np.array([1 if mine else 0, node, -1 if device is None else device_key(device)],
                  np.int64)
    every = np.empty(3 * world.size, np.int64)
    world.allgatherv(me, every, [3] * world.size)
    table = every.reshape(world.size, 3)
    usable = bool(table[:, 0].min())
    seen: dict[tuple[int, int], int] = {}
    shared: tuple[int, int] | None = None
    for r, (_, nd, key) in enumerate(table.tolist()):
        if key < 0:
            continue
        if (nd, key) in seen and shared is None:
            shared = (seen[(nd, key)], r)
        seen.setdefault((nd, key), r)
    if usable and shared is None:
        return "nccl"
    if setting == "nccl":
        if not usable:
            where = "this rank" if not mine else "another rank of the process set"
            raise LightCCError(f"LCC_BACKEND=nccl, but {where} has no usable NCCL (needs CuPy "
                               f"with NCCL and a GPU: pip install cupy-cuda13x "
                               f"nvidia-nccl-cu13); use LCC_BACKEND=auto or mpi to stage "
                               f"through host memory")
        raise LightCCError(f"LCC_BACKEND=nccl, but ranks {shared[0]} and {shared[1]} of process "
                           f"set {world.name!r} use the same GPU, and NCCL refuses two ranks on "
                           f"one GPU; give each rank its own GPU, or use LCC_BACKEND=auto or mpi "
                           f"to stage through host memory")
    why = ("NCCL not usable on every rank" if not usable else
           f"ranks {shared[0]} and {shared[1]} share a GPU")
    log.info("device arrays of process set %s use MPI through pinned host memory (%s)",
             world.name, why)
    return "mpi"


def default_device(host: Topology) -> int:
    """The GPU of a rank that has not used one yet: local rank modulo the visible GPUs."""
    count = kc.cupy_or_raise().cuda.runtime.getDeviceCount()
    return host.local_rank % max(count, 1)


def make_device_comms(host: Topology, setting: str, device: int | None) -> DeviceComms:
    """Build the device communicators of a process set (collective over its members)."""
    cupy = kc.cupy_or_raise()
    if device is None:
        device = default_device(host)
    backend = choose_backend(setting, host, device)
    with cupy.cuda.Device(device):
        stream = cupy.cuda.Stream(non_blocking=True)
        if backend == "nccl":
            topo = _nccl_topology(host)
        else:
            topo = Topology(world=StagedCommunicator(host.world),
                            local=StagedCommunicator(host.local),
                            cross=StagedCommunicator(host.cross), node_of_rank=host.node_of_rank)
    log.debug("rank %d: device communicators of %s on GPU %d over %s", host.rank,
              host.world.name, device, backend)
    return DeviceComms(device, backend, topo, stream)


def _nccl_topology(host: Topology) -> Topology:
    """NCCL communicators for world, local and cross; a role with the world's membership
    reuses the world's communicator (one node: local; one rank per node: cross)."""
    from .nccl import NCCLCommunicator

    world = NCCLCommunicator.from_mpi(host.world, blocking=False)
    local = world if host.local.size == host.size else \
        NCCLCommunicator.from_mpi(host.local, blocking=False)
    cross = world if host.cross.size == host.size else \
        NCCLCommunicator.from_mpi(host.cross, blocking=False)
    return Topology(world=world, local=local, cross=cross, node_of_rank=host.node_of_rank)
