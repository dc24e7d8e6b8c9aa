"""One process set on this rank: its members, communicators, settings, buffers and compressors.

The engine keeps one :class:`Group` per process set (the global set is group 0). Everything the
executor needs for a bucket hangs off it as plain attributes, so the hot path does no lookups in
module globals and two process sets never share state: each has its own fusion buffer and its
own compressors, hence its own error-feedback residuals and PowerSGD factors. Device arrays use
the set's device communicators (:meth:`Group.device_comms`, from the backend factory), made at
the set's first device bucket.

:class:`ExecSettings` are frozen; a change (the autotuner's, applied at the same batch on every
rank) replaces them and pushes the chunk sizes down to the group's communicators.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .. import compression
from ..algorithms import AutoThresholds
from ..topology import Topology
from ..tracing import NULL, Tracer
from .fusion import FusionBuffer


@dataclass(frozen=True)
class ExecSettings:
    """How a group executes collectives (units: bytes, steps); see config.py for each knob."""

    algorithm: str = "auto"
    fusion_threshold: int = 64 << 20
    min_compress_bytes: int = 4096
    ring_chunk_bytes: int = 1 << 20
    mpi_chunk_bytes: int = 4 << 20
    ef_ttl_steps: int = 10_000
    auto: AutoThresholds = AutoThresholds()
    backend: str = "auto"            # device arrays: auto, nccl, mpi (LCC_BACKEND)
    cpu_reduce: bool = False         # device buckets reduced on the host (LCC_CPU_REDUCE)
    deterministic: bool = False      # float32 sums in rank order (LCC_DETERMINISTIC)
    autotune_cache: str = ""         # compression=auto's cache file ("": the default path)
    autotune_refresh: bool = False   # LCC_AUTOTUNE=refresh: decide anew, overwrite the entry

    @classmethod
    def from_config(cls, cfg: Any) -> "ExecSettings":
        return cls(algorithm=cfg.algorithm, fusion_threshold=cfg.fusion_threshold,
                   min_compress_bytes=cfg.min_compress_bytes,
                   ring_chunk_bytes=cfg.ring_chunk_bytes, mpi_chunk_bytes=cfg.mpi_chunk_bytes,
                   ef_ttl_steps=cfg.ef_ttl_steps, backend=cfg.backend,
                   cpu_reduce=cfg.cpu_reduce, deterministic=cfg.deterministic,
                   autotune_cache=cfg.autotune_cache,
                   autotune_refresh=cfg.autotune == "refresh",
                   auto=AutoThresholds(small_bytes=cfg.auto_small_bytes,
                                       hierarchical_bytes=cfg.auto_multinode_bytes,
                                       multi_node=cfg.auto_multi_node))

    def changed(self, **changes: Any) -> "ExecSettings":
        """A copy with ``changes``; ``auto_thresholds`` takes a dict of AutoThresholds fields."""
        auto = changes.pop("auto_thresholds", None)
        out = dataclasses.replace(self, **changes)
        if auto:
            out = dataclasses.replace(out, auto=dataclasses.replace(out.auto, **auto))
        return out


@dataclass
class Group:
    """A process set as this rank sees it (``topo`` is None where this rank is not a member)."""

    pset: int
    ranks: tuple[int, ...]
    topo: Topology | None
    settings: ExecSettings = field(default_factory=ExecSettings)
    fusion: FusionBuffer = field(default_factory=FusionBuffer)
    compressors: dict[str, Any] = field(default_factory=dict)
    step: int = 0                  # batches that executed work of this group
    tracer: Tracer = NULL
    device_id: int | None = None   # this rank's GPU for the set (its first device tensor's)
    device: Any = None             # DeviceComms, made by device_comms() when first needed
    progress: Any = None           # the engine's hook between pieces of long exchanges
    direct: Any = None             # direct.DirectPath: blocking unnamed small allreduces

    def __post_init__(self) -> None:
        self._where = {r: i for i, r in enumerate(self.ranks)}
        self._push_chunks()

    # -- membership ----------------------------------------------------------------------------
    def index(self, world_rank: int) -> int | None:
        """``world_rank``'s position in the set, or None when it is not a member."""
        return self._where.get(world_rank)

    @property
    def size(self) -> int:
        return len(self.ranks)

    # -- what the executor reads -------------------------------------------------------------
    @property
    def algorithm(self) -> str:
        return self.settings.algorithm

    @property
    def min_compress_bytes(self) -> int:
        return self.settings.min_compress_bytes

    def compressor(self, spec: str) -> Any:
        """This group's compressor for ``spec`` (made once, so its state persists)."""
        if spec in ("", "none"):
            return None
        comp = self.compressors.get(spec)
        if comp is None:
            comp = self.compressors[spec] = compression.make(spec)
            memory = getattr(comp, "memory", None)
            if memory is not None:
                memory.ttl_steps = self.settings.ef_ttl_steps
            if hasattr(comp, "cache_path"):        # compression=auto: init()'s cache wins
                comp.cache_path = self.settings.autotune_cache
                comp.cache_refresh = self.settings.autotune_refresh
        return comp

    def device_comms(self) -> Any:
        """The set's device communicators, GPU and engine stream (``backends.factory``); made
        on first use, which is collective: the executor calls it for a device bucket, which
        every member executes at the same point."""
        if self.device is None:
            from ..backends import factory

            self.device = factory.make_device_comms(self.topo, self.settings.backend,
                                                    self.device_id)
            self.device_id = self.device.device
            self._push_chunks()
            self.set_tracer(self.tracer)
        return self.device

    # -- changes --------------------------------------------------------------------------------
    def apply(self, settings: ExecSettings) -> None:
        """Take new settings (same values, same batch, on every rank)."""
        self.settings = settings
        for comp in self.compressors.values():
            memory = getattr(comp, "memory", None)
            if memory is not None:
                memory.ttl_steps = settings.ef_ttl_steps
        self._push_chunks()

    def set_tracer(self, tracer: Tracer) -> None:
        self.tracer = tracer
        for comm in self._comms():
            comm.tracer = tracer

    def _push_chunks(self) -> None:
        for comm in self._comms():
            comm.chunk_bytes = self.settings.mpi_chunk_bytes
            comm.ring_chunk_bytes = self.settings.ring_chunk_bytes
            comm.progress = self.progress

    def _comms(self) -> list:
        t = self.topo
        comms = [] if t is None else [t.world, t.local, t.cross]
        return comms + (self.device.comms() if self.device is not None else [])

    def free(self, free_world: bool = True) -> None:
        """Free the communicators (collective over the members) and the buffers."""
        self.fusion.release()
        if self.direct is not None:
            self.direct.free()
            self.direct = None
        if self.device is not None:
            self.device.free()
            self.device = None
        if self.topo is not None:
            self.topo.free()
            if free_world:
                self.topo.world.free()
