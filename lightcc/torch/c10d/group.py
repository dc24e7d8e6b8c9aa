"""``ProcessGroupLightCC``: torch.distributed collectives on lightcc's engine.

Each torch collective becomes one or a few core collectives on the group's lightcc process
set, all with ``ordered=True``: torch promises that every member issues a group's collectives
in the same order, so they are matched by position on the set's ordered stream (no names).
Collectives issued inside future callbacks are the exception: their timing differs between
ranks, so they are matched by deterministic names instead (see :mod:`.futures`).

Tensors are handed to the core as NumPy views (contiguous CPU tensors, no copy; other tensors
through a CPU staging copy, copied back when the collective completes), except CUDA tensors of
allreduce, which go to the engine's device path as zero-copy device arrays when CuPy sees a GPU
(``ops.device_stage``; the other collectives still stage CUDA tensors through the host). Results reach torch
through :class:`~.work.LightCCWork`. Argument errors raise at once, naming the collective and
option. The gather / scatter / all-to-all family is in :mod:`.movement`.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ...common import api
from ...common.exceptions import LightCCError
from . import ops
from .._tensor import host_stage
from .futures import current_chain
from .p2p import PointToPoint, free_comm
from .movement import DataMovement
from .untraced import untraced
from .work import GroupWork, LightCCWork

BACKEND_NAME = "lightcc"


class GroupDestroyedError(LightCCError):
    """A collective was called on a lightcc process group after it was destroyed."""


@untraced
class ProcessGroupLightCC(DataMovement, dist.ProcessGroup):
    """A torch ``ProcessGroup`` whose collectives run on a lightcc process set."""

    def __init__(self, rank: int, size: int, process_set: api.ProcessSet, timeout: float,
                 p2p_comm: Any = None, world_ranks: Sequence[int] = (),
                 owns_set: bool = False) -> None:
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        self._ps = process_set
        self._timeout = float(timeout)
        self._world_ranks = list(world_ranks)
        self._owns_set = owns_set
        self._name = ""
        self._label = "c10d"
        self._desc = ""
        self._uid = f"c10d.ps{process_set.process_set_id}"
        self._seq = 0
        self._seq_lock = threading.Lock()
        self._p2p = PointToPoint(p2p_comm, self._uid, self._timeout)
        self._destroyed = False
        self._coalescing: list[Any] | None = None

    # ---- identity ----------------------------------------------------------------------------
    # torch 2.14 asks a group for its backend per device from Python (batch_isend_irecv, abort,
    # splitting; 2.13 skipped that for ProcessGroup subclasses): this group is its own backend
    # on every device, without the optional features those callers look for.
    supports_coalescing = False
    supports_splitting = False
    supports_time_estimate = False

    def _get_backend(self, device: Any) -> ProcessGroupLightCC:
        return self

    def getBackendName(self) -> str:
        return BACKEND_NAME

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank

    def setGroupName(self, name: str) -> None:
        self._name = str(name)
        self._label = f"c10d:{self._name}"

    def getGroupName(self) -> str:
        return self._name

    def _set_group_name(self, name: str) -> None:
        self.setGroupName(name)

    @property
    def group_name(self) -> str:
        if not self._name:
            raise LightCCError("ProcessGroup name not set")
        return self._name

    def setGroupDesc(self, desc: str) -> None:
        self._desc = str(desc)

    def getGroupDesc(self) -> str:
        return self._desc

    def _set_group_desc(self, desc: str) -> None:
        self._desc = str(desc)

    @property
    def group_desc(self) -> str:
        return self._desc

    @property
    def process_set(self) -> api.ProcessSet:
        """The lightcc process set this group runs on."""
        return self._ps

    def __repr__(self) -> str:
        return (f"ProcessGroupLightCC(rank={self._rank}, size={self._size}, "
                f"name={self._name!r}, process_set={self._ps.process_set_id})")

    # ---- plumbing ----------------------------------------------------------------------------
    def _what(self, coll: str) -> str:
        return f"{coll} on group '{self._name or self._uid}'"

    def _check_alive(self, what: str) -> None:
        if self._destroyed:
            raise GroupDestroyedError(f"{what}: the process group was destroyed "
                                      f"(destroy_process_group)")

    def _route(self, what: str) -> tuple[str, dict[str, Any]]:
        """(work key, routing) for the next collective issued by this thread: a position on
        the ordered stream, or the chain of the future callback issuing it."""
        self._check_alive(what)
        chain = current_chain()
        if chain is None:
            with self._seq_lock:
                seq = self._seq
                self._seq += 1
            return f"{self._uid}.{seq}", {"ordered": True}
        return chain.key, {"chain": chain}

    def _kw(self, route: dict[str, Any], opts: Any = None) -> dict[str, Any]:
        """Core keyword arguments for one core call of this collective.

        torch's blocking calls (``opts.asyncOp`` False) wait right after the call, and a
        waiting thread drives lightcc itself, so they do not wake the background thread (a
        wake costs a thread switch: about 2x the latency of a small allreduce).
        """
        wake = bool(getattr(opts, "asyncOp", True))
        chain = route.get("chain")
        if chain is None:     # the name only labels the call in errors and the timeline
            return {"ordered": True, "name": self._label, "process_set": self._ps,
                    "wake": wake}
        return {"name": f"{self._uid}:{chain.next_name()}", "process_set": self._ps,
                "wake": wake}

    def _work(self, handles: list[Any], finish: Callable[[list], Any], what: str, key: str,
              opts: Any = None, outputs: Sequence[torch.Tensor] = (),
              stream_device: Any = None) -> LightCCWork:
        devices = sorted({t.device for t in outputs if t.is_cuda}, key=str)
        work = LightCCWork(handles, finish, what, key, ops.timeout_of(opts, self._timeout),
                           devices, stream_device)
        if self._coalescing is not None:
            self._coalescing.append(work)
        return work

    # ---- allreduce family --------------------------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> LightCCWork:
        opts = opts if opts is not None else dist.AllreduceOptions()
        return self._allreduce(list(tensors), opts, "allreduce", single=True)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> LightCCWork:
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        return self._allreduce(list(tensors), opts, "allreduce_coalesced", single=False)

    def _allreduce(self, tensors: list[torch.Tensor], opts: Any, coll: str,
                   single: bool) -> LightCCWork:
        what = self._what(coll)
        if single:
            ops.one(tensors, what)
        staged = [ops.device_stage(t, what) for t in tensors]
        prepared = [(st, *ops.reduce_op(opts.reduceOp, st.tensor.dtype, what)) for st in staged]
        key, route = self._route(what)
        handles = [api.allreduce_async(st.array, op, prescale_factor=pre, out=st.array,
                                       **self._kw(route, opts))
                   for st, op, pre in prepared]

        def finish(_results: list) -> list[torch.Tensor]:
            return [st.finish() for st in staged]

        gpu = next((st.tensor.device for st in staged if st.gpu), None)
        return self._work(handles, finish, what, key, opts, tensors, stream_device=gpu)

    def _rooted(self, coll: str, tensors: list[torch.Tensor], opts: Any) -> tuple:
        """(what, tensor, staged tensor, root) of a rooted collective, its options checked."""
        what = self._what(coll)
        t = ops.one(tensors, what)
        ops.root_tensor(opts, what)
        root = ops.root(opts.rootRank, self._size, "rootRank", what)
        return what, t, host_stage(t, what), root

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> LightCCWork:
        opts = opts if opts is not None else dist.ReduceOptions()
        what, t, st, root = self._rooted("reduce", tensors, opts)
        op, pre = ops.reduce_op(opts.reduceOp, t.dtype, what)
        key, route = self._route(what)
        mine = self._rank == root          # only the root's tensor receives the result
        h = api.allreduce_async(st.array, op, prescale_factor=pre,
                                out=st.array if mine else None, **self._kw(route, opts))
        return self._work([h], lambda _r: [st.finish() if mine else t], what, key, opts, [t])

    # ---- broadcast ---------------------------------------------------------------------------
    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> LightCCWork:
        opts = opts if opts is not None else dist.BroadcastOptions()
        what, t, st, root = self._rooted("broadcast", tensors, opts)
        key, route = self._route(what)
        h = api.broadcast_async(st.array, self._world_ranks[root], out=st.array,   # global rank
                                **self._kw(route, opts))
        return self._work([h], lambda _r: [st.finish()], what, key, opts, [t])

    # ---- barrier, point-to-point, coalescing -------------------------------------------------
    def barrier(self, opts: Any = None) -> LightCCWork:
        what = self._what("barrier")
        key, route = self._route(what)
        kw = self._kw(route, opts)
        h = api.barrier_async(**kw)
        return self._work([h], lambda _r: [], what, key, opts)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> Any:
        self._check_alive("send")
        return self._p2p.send(tensors, ops.root(dst, self._size, "dst", "send"), tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> Any:
        self._check_alive("recv")
        return self._p2p.recv(tensors, ops.root(src, self._size, "src", "recv"), tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> Any:
        self._check_alive("recv")
        return self._p2p.recv(tensors, None, tag)

    def _start_coalescing(self, device: Any = None) -> None:
        self._coalescing = []

    def _end_coalescing(self, device: Any = None) -> LightCCWork:
        works, self._coalescing = self._coalescing or [], None
        return self._merge(works, self._what("coalesced"), lambda: [])

    # ---- lifecycle ---------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Mark the group destroyed (destroy_process_group); later calls raise."""
        if self._destroyed:
            return
        self._destroyed = True
        comm, self._p2p.comm = self._p2p.comm, None
        free_comm(comm)

    def abort(self) -> None:
        self.shutdown()

    # ---- helpers -----------------------------------------------------------------------------
    def _merge(self, works: list[Any], what: str, value: Callable[[], list]) -> Any:
        """One Work standing for several (coalesced calls)."""
        key = works[0]._key if works else f"{self._uid}.empty"
        merged = GroupWork(works, value, what, key, self._timeout)
        if self._coalescing is not None:
            self._coalescing[:] = [w for w in self._coalescing if w not in works]
            self._coalescing.append(merged)
        return merged
