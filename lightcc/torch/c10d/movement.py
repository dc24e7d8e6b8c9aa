"""The gather, scatter, reduce-scatter and all-to-all collectives of the lightcc process group.

A mixin of :class:`~.group.ProcessGroupLightCC` (it uses the group's ``_route``, ``_kw``,
``_work`` and ``_merge``). Gathered data comes back from the core as one array and is split
into torch's output tensors; gather and scatter are alltoalls in which only the root receives
or sends; reduce_scatter stacks the input chunks into one ``(ranks, numel)`` array.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ...common import api
from ...common.exceptions import InvalidArgumentError
from .._tensor import copy_into
from . import ops
from .untraced import untraced


@untraced
class DataMovement:
    """Collectives that move data between ranks (see module docstring)."""

    _size: int
    _rank: int

    def allgather(self, output_tensors: list[list[torch.Tensor]],
                  input_tensors: list[torch.Tensor], opts: Any = None) -> LightCCWork:
        what = self._what("allgather")
        t = ops.one(input_tensors, what)
        outs = self._out_list(output_tensors, what, "output_tensors")
        ops.same_dtype(outs, t.dtype, what)
        return self._gather_into(outs, ops.cpu_flat(t, what), what, opts)

    def _gather_into(self, outs: list[torch.Tensor], arr: np.ndarray, what: str,
                     opts: Any) -> LightCCWork:
        """Allgather ``arr`` and split the result over ``outs`` in order."""
        key, route = self._route(what)
        h = api.allgather_async(arr, **self._kw(route, opts))

        def finish(results: list) -> list[torch.Tensor]:
            self._split_into(outs, results[0], what)
            return outs

        return self._work([h], finish, what, key, opts, outs)

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]],
                            input_tensors: list[torch.Tensor], opts: Any = None) -> LightCCWork:
        """torch's ``all_gather_coalesced``: ``output_lists[r][j]`` receives rank r's
        ``input_tensors[j]``. One allgather of this rank's inputs flattened into one row (rows
        of different lengths on different ranks are an error on every rank)."""
        what = self._what("allgather_coalesced")
        ins = list(input_tensors)
        outs = [list(lst) for lst in output_lists]
        if not ins:
            raise InvalidArgumentError(f"{what}: input_tensor_list is empty")
        if len(outs) != self._size:
            raise InvalidArgumentError(f"{what}: output_tensor_lists has {len(outs)} lists "
                                       f"(one per rank expected), the group has {self._size} "
                                       f"ranks")
        sizes = [t.numel() for t in ins]
        for r, lst in enumerate(outs):
            if [o.numel() for o in lst] != sizes:
                raise InvalidArgumentError(f"{what}: output_tensor_lists[{r}] holds "
                                           f"{[o.numel() for o in lst]} elements per tensor, "
                                           f"the inputs have {sizes}")
        flat_outs = [o for lst in outs for o in lst]
        ops.same_dtype(ins + flat_outs, ins[0].dtype, what)
        row = np.concatenate([ops.cpu_flat(t, what) for t in ins]).reshape(1, -1)
        return self._gather_into(flat_outs, row, what, opts)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,
                          opts: Any = None) -> LightCCWork:
        what = self._what("all_gather_into_tensor")
        if output.numel() != input.numel() * self._size or output.dtype != input.dtype:
            raise InvalidArgumentError(f"{what}: output has {output.numel()} {output.dtype} "
                                       f"elements, expected {self._size} x {input.numel()} "
                                       f"{input.dtype}")
        arr = ops.cpu_flat(input, what).reshape(1, -1)
        key, route = self._route(what)
        h = api.allgather_async(arr, **self._kw(route, opts))

        def finish(results: list) -> torch.Tensor:
            copy_into(output, results[0])
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
        h = api.alltoall_async(arr, splits, **self._kw(route, opts))

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
        h = api.alltoall_async(arr, splits, **self._kw(route, opts))

        def finish(results: list) -> list[torch.Tensor]:
            data = results[0][0]
            if data.size != out.numel():
                raise InvalidArgumentError(f"{what}: received {data.size} elements from the "
                                           f"root, the output tensor holds {out.numel()}")
            copy_into(out, data)
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
        h = api.reducescatter_async(arr, op, prescale_factor=pre, **self._kw(route, opts))

        def finish(results: list) -> torch.Tensor:
            copy_into(out, results[0])
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
        h = api.alltoall_async(arr, splits, **self._kw(route, opts))

        def finish(results: list) -> torch.Tensor:
            data, got = results[0]
            got = [int(g) for g in got]
            if want and got != want:
                raise InvalidArgumentError(f"{what}: received splits {got}, "
                                           f"output_split_sizes says {want}")
            if data.size != output.numel():
                raise InvalidArgumentError(f"{what}: received {data.size} elements (splits "
                                           f"{got}), the output holds {output.numel()}")
            copy_into(output, data)
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
                               **self._kw(route, opts))

        def finish(results: list) -> list[torch.Tensor]:
            self._split_into(outs, results[0][0], what)
            return outs

        return self._work([h], finish, what, key, opts, outs)

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
            copy_into(o, flat[offset:offset + o.numel()])
            offset += o.numel()

