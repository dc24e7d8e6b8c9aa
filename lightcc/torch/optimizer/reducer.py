"""How one gradient goes to the engine and comes back.

:class:`GradientReducer` starts the allreduce of a parameter's gradient (or of a group's) and
returns a :class:`PendingGradient`; :meth:`GradientReducer.finish` waits for it and leaves the
reduced gradient in ``p.grad``. The first step prepares each gradient's allreduce
(``api.prepare_allreduce``: validated once); later steps submit it again, so a gradient costs
a view and a queue entry. CUDA gradients are reduced in their own GPU memory (NCCL, or MPI
through pinned host buffers). *When* gradients are reduced (hooks, passes, groups, ``step``)
is the optimizer's business (:mod:`.barrier`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ...common import api as _api
from ...common.api import Average
from .. import collectives as _ops
from .._tensor import as_array, device_array, stage
from ..compression import spec_of

_ELEMENTWISE = ("none", "fp16", "bf16")  # compressions whose result is per element


class Pieces:
    """The handles of one gradient reduced in pieces (:meth:`GradientReducer.pieces`)."""

    __slots__ = ("handles",)

    def __init__(self, handles: list) -> None:
        self.handles = handles

    def wait(self) -> None:
        for h in self.handles:
            h.wait()


@dataclass(eq=False, slots=True)
class PendingGradient:
    """A started reduction: of one parameter's gradient (``key`` is the parameter) or of a
    group reduced together (``key`` is the tuple of its parameters).

    ``handle``: the engine's ``Handle``, a ``GroupHandle``, :class:`Pieces`, or, for a sparse
    gradient (``sparse``), the callable that waits and returns the reduced tensor. ``staged``:
    None when the gradient is reduced in its own memory, else one ``(Staged, ctx)`` per member
    (the buffer the engine reduces, the per-tensor compressor's context) that
    :meth:`GradientReducer.finish` copies back. ``finished``: ``finish`` was called.
    """

    key: Any
    handle: Any
    staged: list | None = None
    sparse: bool = False
    finished: bool = False

    @property
    def params(self) -> tuple:
        """The parameters whose gradients this reduction carries."""
        key = self.key
        return key if isinstance(key, tuple) else (key,)

    def completed(self) -> bool:
        """Has the reduction completed? Never waits; False for what it cannot tell (sparse)."""
        handle = self.handle
        pieces = getattr(handle, "handles", None)
        if pieces is not None:
            return all(getattr(h, "is_done", False) for h in pieces)
        return getattr(handle, "is_done", False) is True

    def wait_passive(self) -> bool:
        """Wait for completion without driving an eager engine (its background thread
        executes the buckets back to back; this thread wakes when its own is done). False,
        without waiting, in lazy mode and for a sparse reduction: :meth:`GradientReducer.finish`
        (which drives) does it."""
        handle = self.handle
        for h in getattr(handle, "handles", None) or (handle,):
            if getattr(h, "is_done", False) is True:
                continue
            wait = getattr(h, "wait_passive", None)
            if wait is None or not wait():
                return False
        return True


class GradientReducer:
    """Starts and finishes the allreduces of one optimizer's gradients.

    ``names``: parameter -> allreduce name (every rank the same). ``priorities``: parameter
    -> its allreduce's priority (empty: none; cross-barrier mode fills it in forward order).
    ``partition_bytes``: >0 cuts larger gradients into allreduces of at most this many bytes
    (cross-barrier mode; elementwise compressions only). ``gpu``: the torch device of CUDA
    gradients once one was seen (``synchronize`` makes its stream wait for the results).
    """

    def __init__(self, compression: Any, op: Any, gradient_predivide_factor: float,
                 sparse_as_dense: bool, process_set: Any, names: dict,
                 partition_bytes: int = 0) -> None:
        self.compression = compression
        self.spec = spec_of(compression)
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        self.names = names
        self.partition_bytes = partition_bytes
        self.priorities: dict = {}
        self.gpu: Any = None
        self._prepared: dict = {}            # parameter -> its Prepared allreduces (pieces)
        self._prepared_priority: dict = {}   # parameter -> the priority it was prepared with

    def _scales(self) -> tuple[float, float]:
        if self.op == Average:
            return 1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor
        return 1.0, 1.0

    def submit(self, p: torch.Tensor) -> PendingGradient:
        """Start the allreduce of ``p.grad`` (zeros when this rank computed none)."""
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grad = p.grad
        if grad.is_sparse:
            if not self.sparse_as_dense:
                return PendingGradient(p, _ops.sparse_allreduce_async(
                    grad, self.names[p], self.op, self.process_set), sparse=True)
            grad = grad.to_dense()
        ctx = None
        if self.spec is None:       # Horovod-style custom compressor, per tensor
            grad, ctx = self.compression.compress(grad)
        elif grad is p.grad and grad.is_contiguous() and \
                ((cuda := grad.is_cuda) or grad.is_cpu):    # (device.type costs 0.4 us)
            return PendingGradient(p, self._submit_in_place(p, grad, not cuda))
        pre, post = self._scales()
        s = stage(grad, "DistributedOptimizer")
        if s.gpu:
            self.gpu = grad.device
        handle = _api.allreduce_async(s.array, self.op, self.names[p], pre, post,
                                      self.process_set,
                                      self.compression if self.spec else None, out=s.array)
        return PendingGradient(p, handle, [(s, ctx)])

    def _submit_in_place(self, p: torch.Tensor, grad: torch.Tensor, cpu: bool = True) -> Any:
        """The per-step fast path: the gradient's own memory is reduced in place with the
        allreduce prepared at the first step (same name, shape, dtype, op and scales every
        step)."""
        if cpu:
            arr = as_array(grad)
        else:                       # CUDA: ready event on the stream that wrote the gradient
            arr = device_array(grad, ready=True)
            self.gpu = grad.device
        prepared = self._prepared.get(p)
        priority = self.priorities.get(p, 0) if self.priorities else 0
        pieces = self.pieces(arr)
        if prepared is None or len(prepared) != len(pieces) or \
                not prepared[0].fits(pieces[0]) or \
                self._prepared_priority.get(p, 0) != priority:   # first step, new runtime/shape
            pre, post = self._scales()
            name = self.names[p]
            prepared = self._prepared[p] = [
                _api.prepare_allreduce(piece, self.op, name if len(pieces) == 1 else
                                       f"{name}#{i}", pre, post, self.process_set,
                                       self.compression, priority=priority)
                for i, piece in enumerate(pieces)]
            self._prepared_priority[p] = priority
        if len(pieces) == 1:
            return prepared[0].submit(arr, arr)
        return Pieces([prep.submit(piece, piece) for prep, piece in zip(prepared, pieces)])

    def pieces(self, arr: Any) -> list:
        """``arr`` cut into allreduces of at most ``partition_bytes`` (cross-barrier mode:
        a high-priority tensor then waits behind at most a piece; views, reduced in place),
        or ``[arr]``. Only where the result of an element does not depend on its neighbours
        (no compression, fp16, bf16), so the pieces' results equal the whole tensor's."""
        limit = self.partition_bytes
        if not limit or arr.nbytes <= limit or self.spec not in _ELEMENTWISE or \
                not isinstance(arr, np.ndarray):
            return [arr]
        flat = arr.reshape(-1)
        step = max(1, limit // arr.itemsize)
        return [flat[i:i + step] for i in range(0, flat.size, step)]

    def submit_group(self, group: tuple) -> PendingGradient:
        """Start the allreduce of a group's gradients as one (zeros for those not computed)."""
        for p in group:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        pairs = [self._compress(p.grad) for p in group]
        staged = [stage(grad, "DistributedOptimizer") for grad, _ in pairs]
        if self.gpu is None and any(st.gpu for st in staged):
            self.gpu = next(st.tensor.device for st in staged if st.gpu)
        pre, post = self._scales()
        arrays = [s.array for s in staged]
        handle = _api.grouped_allreduce_async(arrays, self.op, self.names[group[0]], pre, post,
                                              self.process_set,
                                              self.compression if self.spec else None,
                                              outs=arrays)
        return PendingGradient(group, handle, [(s, ctx) for s, (_, ctx) in zip(staged, pairs)])

    def _compress(self, grad: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """A Horovod-style compressor's ``compress`` (per tensor); identity for the engine's."""
        if self.spec is None:
            return self.compression.compress(grad)
        return grad, None

    def finish(self, pending: PendingGradient) -> None:
        """Wait for ``pending`` (driving the engine if nobody else does) and leave each
        member's reduced gradient in its ``p.grad``; raises the collective's error."""
        pending.finished = True
        staged = pending.staged
        if staged is None:
            if pending.sparse:
                pending.key.grad = pending.handle()
            else:
                pending.handle.wait()
            return
        pending.handle.wait()
        for p, (s, ctx) in zip(pending.params, staged):
            self._write_back(p, s.finish(), ctx)

    def _write_back(self, p: torch.Tensor, reduced: torch.Tensor, ctx: Any) -> None:
        """Decompress (Horovod-style compressors) and put the reduced gradient in ``p.grad``."""
        if self.spec is None:
            reduced = self.compression.decompress(reduced, ctx)
        if reduced is not p.grad:
            if p.grad.is_sparse:
                p.grad = reduced.to_sparse()
            else:
                with torch.no_grad():
                    p.grad.copy_(reduced)
