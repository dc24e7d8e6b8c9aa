"""``ProcessGroupLightCC``: torch.distributed collectives on lightcc's engine.

Each torch collective becomes one or a few core collectives on the group's lightcc process
set, all with ``ordered=True``: torch promises that every member issues a group's collectives
in the same order, so they are matched by position on the set's ordered stream (no names).
Collectives issued inside future callbacks are the exception: their timing differs between
ranks, so they are matched by deterministic names instead (see :mod:`.futures`).

Tensors are handed to the core as NumPy views (contiguous CPU tensors, no copy; other tensors
through a CPU staging copy, copied back when the collective completes). Reduce, gather and
scatter are composed from allreduce and alltoall. Results reach torch through
:class:`~.work.LightCCWork`. Argument errors raise at once, naming the collective and option.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from ...common import api
from ...common.exceptions import InvalidArgumentError, LightCCError
from . import ops
from .ops import stage
from .futures import current_chain
from .p2p import PointToPoint, free_comm
from .work import GroupWork, LightCCWork

BACKEND_NAME = "lightcc"


class GroupDestroyedError(LightCCError):
    """A collective was called on a lightcc process group after it was destroyed."""


class ProcessGroupLightCC(dist.ProcessGroup):
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
        self._desc = ""
        self._uid = f"c10d.ps{process_set.process_set_id}"
        self._seq = 0
        self._seq_lock = threading.Lock()
        self._p2p = PointToPoint(p2p_comm, self._uid, self._timeout)
        self._destroyed = False
        self._coalescing: list[Any] | None = None

    # ---- identity ----------------------------------------------------------------------------
    def getBackendName(self) -> str:
        return BACKEND_NAME

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank

    def setGroupName(self, name: str) -> None:
        self._name = str(name)

    def getGroupName(self) -> str:
        return self._name

    def _set_group_name(self, name: str) -> None:
        self._name = str(name)

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

    def _kw(self, route: dict[str, Any]) -> dict[str, Any]:
        """Core keyword arguments for one core call of this collective."""
        chain = route.get("chain")
        if chain is None:
            return {"ordered": True, "process_set": self._ps}
        return {"name": f"{self._uid}:{chain.next_name()}", "process_set": self._ps}

    def _work(self, handles: list[Any], finish: Callable[[list], Any], what: str, key: str,
              opts: Any = None, outputs: Sequence[torch.Tensor] = ()) -> LightCCWork:
        devices = sorted({t.device for t in outputs if t.device.type != "cpu"}, key=str)
        work = LightCCWork(handles, finish, what, key, ops.timeout_of(opts, self._timeout),
                           devices)
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
        staged = [stage(t, what) for t in tensors]
        prepared = [(st, *ops.reduce_op(opts.reduceOp, st.tensor.dtype, what)) for st in staged]
        key, route = self._route(what)
        handles = [api.allreduce_async(st.array, op, prescale_factor=pre, out=st.array,
                                       **self._kw(route))
                   for st, op, pre in prepared]

        def finish(_results: list) -> list[torch.Tensor]:
            return [st.finish() for st in staged]

        return self._work(handles, finish, what, key, opts, tensors)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> LightCCWork:
        opts = opts if opts is not None else dist.ReduceOptions()
        what = self._what("reduce")
        t = ops.one(tensors, what)
        ops.root_tensor(opts, what)
        root = ops.root(opts.rootRank, self._size, "rootRank", what)
        st = stage(t, what)
        op, pre = ops.reduce_op(opts.reduceOp, t.dtype, what)
        key, route = self._route(what)
        mine = self._rank == root          # only the root's tensor receives the result
        h = api.allreduce_async(st.array, op, prescale_factor=pre,
                                out=st.array if mine else None, **self._kw(route))
        return self._work([h], lambda _r: [st.finish() if mine else t], what, key, opts, [t])

    # ---- broadcast / gather family -----------------------------------------------------------
    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> LightCCWork:
        opts = opts if opts is not None else dist.BroadcastOptions()
        what = self._what("broadcast")
        t = ops.one(tensors, what)
        ops.root_tensor(opts, what)
        root = ops.root(opts.rootRank, self._size, "rootRank", what)
        st = stage(t, what)
        key, route = self._route(what)
        h = api.broadcast_async(st.array, root, out=st.array, **self._kw(route))
        return self._work([h], lambda _r: [st.finish()], what, key, opts, [t])

    def allgather(self, output_tensors: list[list[torch.Tensor]],
                  input_tensors: list[torch.Tensor], opts: Any = None) -> LightCCWork:
        what = self._what("allgather")
        t = ops.one(input_tensors, what)
        outs = self._out_list(output_tensors, what, "output_tensors")
        ops.same_dtype(outs, t.dtype, what)
        arr = ops.cpu_flat(t, what)
        key, route = self._route(what)
        h = api.allgather_async(arr, **self._kw(route))

        def finish(results: list) -> list[torch.Tensor]:
            self._split_into(outs, results[0], what)
            return outs

        return self._work([h], finish, what, key, opts, outs)

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]],
                            input_tensors: list[torch.Tensor], opts: Any = None) -> LightCCWork:
        works = [self.allgather([outs], [t], opts) for outs, t in zip(output_lists,
                                                                        input_tensors)]
        return self._merge(works, self._what("allgather_coalesced"),
                           lambda: [o for outs in output_lists for o in outs])

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,
                          opts: Any = None) -> LightCCWork:
        what = self._what("all_gather_into_tensor")
        if output.numel() != input.numel() * self._size or output.dtype != input.dtype:
            raise InvalidArgumentError(f"{what}: output has {output.numel()} {output.dtype} "
                                       f"elements, expected {self._size} x {input.numel()} "
                                       f"{input.dtype}")
        arr = ops.cpu_flat(input, what).reshape(1, -1)
        key, route = self._route(what)
        h = api.allgather_async(arr, **self._kw(route))

        def finish(results: list) -> torch.Tensor:
            ops.copy_into(output, results[0])
            return output

        return self._work([h], finish, what, key, opts, [output])

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor],
                                    inputs: list[torch.Tensor], opts: Any = None) -> LightCCWork:
        works = [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return self._merge(works, self._what("all_gather_into_tensor_coalesced"),
                           lambda: list(outputs))

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def gather(self, output_tensors: list[list[torch.Tensor]],
               input_tensors: list[torch.Tensor], opts: Any = None) -> LightCCWork:
        opts = opts if opts is not None else dist.GatherOptions()
        what = self._what("gather")
        t = ops.one(input_tensors, what)
        root = ops.root(opts.rootRank, self._size, "rootRank", what)
        outs = self._out_list(output_tensors, what, "gather_list") if self._rank == root \
            else []
        ops.same_dtype(outs, t.dtype, what)
        arr = ops.cpu_flat(t, what)
        splits = [0] * self._size
        splits[root] = arr.size                      # everyone sends only to the root
        key, route = self._route(what)
        h = api.alltoall_async(arr, splits, **self._kw(route))

        def finish(results: list) -> list[torch.Tensor]:
            if outs:
                self._split_into(outs, results[0][0], what)
            return outs

        return self._work([h], finish, what, key, opts, outs)

    def scatter(self, output_tensors: list[torch.Tensor],
                input_tensors: list[list[torch.Tensor]], opts: Any = None) -> LightCCWork:
        opts = opts if opts is not None else dist.ScatterOptions()
        what = self._what("scatter")
        out = ops.one(output_tensors, what)
        root = ops.root(opts.rootRank, self._size, "rootRank", what)
        splits = [0] * self._size
        if self._rank == root:
            ins = self._out_list(input_tensors, what, "scatter_list")
            ops.same_dtype(ins, out.dtype, what)
            parts = [ops.cpu_flat(x, what) for x in ins]
            splits = [p.size for p in parts]
            arr = np.concatenate(parts) if parts else np.empty(0)
        else:
            arr = ops.cpu_flat(torch.empty(0, dtype=out.dtype), what)
        key, route = self._route(what)
        h = api.alltoall_async(arr, splits, **self._kw(route))

        def finish(results: list) -> list[torch.Tensor]:
            data = results[0][0]
            if data.size != out.numel():
                raise InvalidArgumentError(f"{what}: received {data.size} elements from the "
                                           f"root, the output tensor holds {out.numel()}")
            ops.copy_into(out, data)
            return [out]

        return self._work([h], finish, what, key, opts, [out])

    # ---- reduce_scatter family ---------------------------------------------------------------
    def reduce_scatter(self, output_tensors: list[torch.Tensor],
                       input_tensors: list[list[torch.Tensor]], opts: Any = None) -> LightCCWork:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        what = self._what("reduce_scatter")
        out = ops.one(output_tensors, what)
        ins = self._out_list(input_tensors, what, "input_list")
        ops.same_dtype(ins, out.dtype, what)
        if any(x.numel() != out.numel() for x in ins):
            raise InvalidArgumentError(f"{what}: every input tensor must have the output's "
                                       f"{out.numel()} elements, got "
                                       f"{[x.numel() for x in ins]}")
        arr = np.stack([ops.cpu_flat(x, what) for x in ins])
        return self._reduce_scatter(out, arr, opts, what)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,
                              opts: Any = None) -> LightCCWork:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        what = self._what("reduce_scatter_tensor")
        if input.numel() != output.numel() * self._size or output.dtype != input.dtype:
            raise InvalidArgumentError(f"{what}: input has {input.numel()} {input.dtype} "
                                       f"elements, expected {self._size} x {output.numel()} "
                                       f"{output.dtype}")
        arr = ops.cpu_flat(input, what).reshape(self._size, -1)
        return self._reduce_scatter(output, arr, opts, what)

    _reduce_scatter_base = reduce_scatter_single

    def _reduce_scatter(self, out: torch.Tensor, arr: np.ndarray, opts: Any,
                        what: str) -> LightCCWork:
        op, pre = ops.reduce_op(opts.reduceOp, out.dtype, what)
        key, route = self._route(what)
        h = api.reducescatter_async(arr, op, prescale_factor=pre, **self._kw(route))

        def finish(results: list) -> torch.Tensor:
            ops.copy_into(out, results[0])
            return out

        return self._work([h], finish, what, key, opts, [out])

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor],
                                        opts: Any = None) -> LightCCWork:
        works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return self._merge(works, self._what("reduce_scatter_tensor_coalesced"),
                           lambda: list(outputs))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # ---- all-to-all --------------------------------------------------------------------------
    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor,
                      output_split_sizes: list[int], input_split_sizes: list[int],
                      opts: Any = None) -> LightCCWork:
        what = self._what("all_to_all_single")
        if output.dtype != input.dtype:
            raise InvalidArgumentError(f"{what}: output dtype {output.dtype} != input dtype "
                                       f"{input.dtype}")
        n = self._size
        if input.dim() == 0:
            raise InvalidArgumentError(f"{what}: needs at least one dimension")
        rows, row = input.shape[0], int(np.prod(input.shape[1:], dtype=np.int64))
        splits = [int(s) for s in input_split_sizes or []]
        if not splits:
            if rows % n:
                raise InvalidArgumentError(f"{what}: input's first dimension {rows} is not "
                                           f"divisible by {n} ranks; pass input_split_sizes")
            splits = [rows // n] * n
        arr = ops.cpu_flat(input, what).reshape(rows, row)
        want = [int(s) for s in output_split_sizes or []]
        key, route = self._route(what)
        h = api.alltoall_async(arr, splits, **self._kw(route))

        def finish(results: list) -> torch.Tensor:
            data, got = results[0]
            got = [int(g) for g in got]
            if want and got != want:
                raise InvalidArgumentError(f"{what}: received splits {got}, "
                                           f"output_split_sizes says {want}")
            if data.size != output.numel():
                raise InvalidArgumentError(f"{what}: received {data.size} elements (splits "
                                           f"{got}), the output holds {output.numel()}")
            ops.copy_into(output, data)
            return output

        return self._work([h], finish, what, key, opts, [output])

    all_to_all_single = alltoall_base

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                 opts: Any = None) -> LightCCWork:
        what = self._what("all_to_all")
        outs = list(output_tensors)
        ins = list(input_tensors)
        if len(outs) != self._size or len(ins) != self._size:
            raise InvalidArgumentError(f"{what}: needs {self._size} input and output tensors, "
                                       f"got {len(ins)} and {len(outs)}")
        dtype = ins[0].dtype
        ops.same_dtype(ins + outs, dtype, what)
        parts = [ops.cpu_flat(x, what) for x in ins]
        key, route = self._route(what)
        h = api.alltoall_async(np.concatenate(parts), [p.size for p in parts],
                               **self._kw(route))

        def finish(results: list) -> list[torch.Tensor]:
            self._split_into(outs, results[0][0], what)
            return outs

        return self._work([h], finish, what, key, opts, outs)

    # ---- barrier, point-to-point, coalescing -------------------------------------------------
    def barrier(self, opts: Any = None) -> LightCCWork:
        what = self._what("barrier")
        key, route = self._route(what)
        kw = self._kw(route)
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
    def _out_list(self, lists: list[list[torch.Tensor]], what: str,
                  option: str) -> list[torch.Tensor]:
        if len(lists) != 1:
            raise InvalidArgumentError(f"{what}: {option} must hold one list, got "
                                       f"{len(lists)}")
        outs = list(lists[0])
        if len(outs) != self._size:
            raise InvalidArgumentError(f"{what}: {option} has {len(outs)} tensors, the group "
                                       f"has {self._size} ranks")
        return outs

    @staticmethod
    def _split_into(outs: list[torch.Tensor], data: np.ndarray, what: str) -> None:
        flat = np.asarray(data).reshape(-1)
        need = sum(o.numel() for o in outs)
        if flat.size != need:
            raise InvalidArgumentError(f"{what}: received {flat.size} elements, the output "
                                       f"tensors hold {need} (ranks passed different sizes)")
        offset = 0
        for o in outs:
            ops.copy_into(o, flat[offset:offset + o.numel()])
            offset += o.numel()

    def _merge(self, works: list[Any], what: str, value: Callable[[], list]) -> Any:
        """One Work standing for several (coalesced calls)."""
        key = works[0]._key if works else f"{self._uid}.empty"
        merged = GroupWork(works, value, what, key, self._timeout)
        if self._coalescing is not None:
            self._coalescing[:] = [w for w in self._coalescing if w not in works]
            self._coalescing.append(merged)
        return merged
