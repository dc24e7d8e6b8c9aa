"""The optimizer ``DistributedOptimizer(...)`` returns: averages gradients over ranks while
backward is still running.

The wrapper is an ordinary class (no class built at run time): a
:class:`~.optimizer_setup.WrappedOptimizer`, so ``isinstance(opt, torch.optim.Optimizer)``,
LR schedulers and ``torch.amp.GradScaler`` accept it, and ``param_groups``, ``state`` and
``defaults`` are the wrapped optimizer's. A post-accumulate-grad hook on every parameter
submits that gradient's in-place allreduce as soon as autograd has written it, so
communication overlaps the rest of backward; the engine fuses what is ready into buckets and
applies ``compression`` to each bucket. The first step prepares each gradient's allreduce
(``api.prepare_allreduce``: validated once); later steps submit it again. ``step()`` waits
for the reductions (``synchronize()``) and steps the wrapped optimizer. CUDA gradients are
reduced in their own GPU memory (NCCL, or MPI through pinned host buffers); waiting for them
makes torch's current stream wait, not the host.
"""
from __future__ import annotations

import contextlib
import time
import warnings
from typing import Any, Iterator

import numpy as np
import torch

from ..common import api as _api
from ..common.api import Average
from ..common.exceptions import InvalidArgumentError
from ..common.observability.metrics import note_step
from . import collectives as _ops
from ._tensor import as_array, device_array, stage, torch_stream
from .compression import spec_of
from .optimizer_setup import WrappedOptimizer, parameter_names, split_groups

_STATE_KEY = "lightcc_compression"     # compressor state inside state_dict()
_IN_PLACE = object()                   # handle info: reduced in the gradient's own memory
_ELEMENTWISE = ("none", "fp16", "bf16")  # compressions whose result is per element


class _Pieces:
    """The handles of one gradient reduced in pieces (:meth:`_DistributedOptimizer._pieces`)."""

    __slots__ = ("handles",)

    def __init__(self, handles: list) -> None:
        self.handles = handles

    def wait(self) -> None:
        for h in self.handles:
            h.wait()


class _DistributedOptimizer(WrappedOptimizer):
    """See :func:`DistributedOptimizer`."""

    def __init__(self, optimizer: torch.optim.Optimizer, named_parameters: Any,
                 compression: Any, backward_passes_per_step: int, op: Any,
                 gradient_predivide_factor: float, groups: Any, sparse_as_dense: bool,
                 process_set: Any) -> None:
        # torch.optim.Optimizer.__init__ is not called: the wrapped optimizer owns the state.
        self._opt = optimizer
        self._compression = compression
        self._spec = spec_of(compression)
        self.op = op
        self.backward_passes_per_step = backward_passes_per_step
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        self._parameter_names = parameter_names(named_parameters, self.param_groups)
        self._allreduce_delay = {p: backward_passes_per_step for p in self._parameter_names}
        self._handles: dict[Any, tuple[Any, Any]] = {}
        self._prepared: dict = {}            # parameter -> its Prepared allreduce
        self._prepared_priority: dict = {}   # parameter -> the priority it was prepared with
        self._partition_bytes = 0            # >0: larger gradients go in pieces (cross-barrier)
        #: parameter -> its allreduce's priority (cross-barrier mode: forward order; empty: none)
        self._priority: dict = {}
        self._requires_update: dict = {}     # parameter -> None, in registration order
        self._hook_handles: list = []
        self._synchronized = False
        self._should_synchronize = True
        self._warned_double_sync = False
        self._groups = groups
        self._gpu: Any = None                # torch device of CUDA gradients, once seen
        self._p_to_group: dict = {}
        self._group_counts: dict = {}
        if self.process_set.included() and _api.size() > 1:
            self._register_hooks()

    # ---- construction helpers -----------------------------------------------------------------
    def _trainable(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"] if p.requires_grad]

    def _register_hooks(self) -> None:
        params = self._trainable()
        if self._groups is not None:
            for group in split_groups(params, self._groups, self._parameter_names,
                                      self.process_set):
                for p in group:
                    self._p_to_group[p] = group
                self._group_counts[group] = 0
        for p in params:
            self._watch(p)

    def _watch(self, p: torch.Tensor) -> None:
        self._requires_update[p] = None
        self._hook_handles.append(p.register_post_accumulate_grad_hook(self._on_grad))

    # ---- communication ------------------------------------------------------------------------
    def _scales(self) -> tuple[float, float]:
        if self.op == Average:
            return 1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor
        return 1.0, 1.0

    def _submit(self, p: torch.Tensor) -> tuple[Any, Any]:
        """Start the allreduce of ``p.grad`` (zeros when this rank computed none)."""
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grad = p.grad
        if grad.is_sparse:
            if not self.sparse_as_dense:
                return _ops.sparse_allreduce_async(grad, self._parameter_names[p], self.op,
                                                   self.process_set), "sparse"
            grad = grad.to_dense()
        ctx = None
        if self._spec is None:      # Horovod-style custom compressor, per tensor
            grad, ctx = self._compression.compress(grad)
        elif grad is p.grad and grad.is_contiguous() and \
                ((cuda := grad.is_cuda) or grad.is_cpu):    # (device.type costs 0.4 us)
            return self._submit_in_place(p, grad, not cuda), _IN_PLACE
        name = self._parameter_names[p]
        pre, post = self._scales()
        s = stage(grad, "DistributedOptimizer")
        if s.gpu:
            self._gpu = grad.device
        handle = _api.allreduce_async(s.array, self.op, name, pre, post, self.process_set,
                                      self._compression if self._spec else None, out=s.array)
        return handle, (s, ctx)

    def _submit_in_place(self, p: torch.Tensor, grad: torch.Tensor, cpu: bool = True) -> Any:
        """The per-step fast path: the gradient's own memory is reduced in place with the
        allreduce prepared at the first step (same name, shape, dtype, op and scales every
        step), so a gradient costs a view and a queue entry."""
        if cpu:
            arr = as_array(grad)
        else:                       # CUDA: ready event on the stream that wrote the gradient
            arr = device_array(grad, ready=True)
            self._gpu = grad.device
        prepared = self._prepared.get(p)
        priority = self._priority.get(p, 0) if self._priority else 0
        pieces = self._pieces(arr)
        if prepared is None or len(prepared) != len(pieces) or \
                not prepared[0].fits(pieces[0]) or \
                self._prepared_priority.get(p, 0) != priority:   # first step, new runtime/shape
            pre, post = self._scales()
            name = self._parameter_names[p]
            prepared = self._prepared[p] = [
                _api.prepare_allreduce(piece, self.op, name if len(pieces) == 1 else
                                       f"{name}#{i}", pre, post, self.process_set,
                                       self._compression, priority=priority)
                for i, piece in enumerate(pieces)]
            self._prepared_priority[p] = priority
        if len(pieces) == 1:
            return prepared[0].submit(arr, arr)
        return _Pieces([prep.submit(piece, piece) for prep, piece in zip(prepared, pieces)])

    def _pieces(self, arr: Any) -> list:
        """``arr`` cut into allreduces of at most ``_partition_bytes`` (cross-barrier mode:
        a high-priority tensor then waits behind at most a piece; views, reduced in place),
        or ``[arr]``. Only where the result of an element does not depend on its neighbours
        (no compression, fp16, bf16), so the pieces' results equal the whole tensor's."""
        limit = self._partition_bytes
        if not limit or arr.nbytes <= limit or self._spec not in _ELEMENTWISE or \
                not isinstance(arr, np.ndarray):
            return [arr]
        flat = arr.reshape(-1)
        step = max(1, limit // arr.itemsize)
        return [flat[i:i + step] for i in range(0, flat.size, step)]

    def _submit_group(self, group: tuple) -> tuple[Any, Any]:
        for p in group:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        pairs = [self._compress(p.grad) for p in group]
        staged = [stage(grad, "DistributedOptimizer") for grad, _ in pairs]
        if self._gpu is None and any(st.gpu for st in staged):
            self._gpu = next(st.tensor.device for st in staged if st.gpu)
        pre, post = self._scales()
        arrays = [s.array for s in staged]
        handle = _api.grouped_allreduce_async(arrays, self.op, self._parameter_names[group[0]],
                                              pre, post, self.process_set,
                                              self._compression if self._spec else None,
                                              outs=arrays)
        return handle, [(s, ctx) for s, (_, ctx) in zip(staged, pairs)]

    def _compress(self, grad: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """A Horovod-style compressor's ``compress`` (per tensor); identity for the engine's."""
        if self._spec is None:
            return self._compression.compress(grad)
        return grad, None

    def _on_grad(self, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook: count the pass; reduce once the last one arrived.

        Runs once per gradient per step, so it looks ``p`` up as few times as it can (a
        tensor's hash is a Python call): with one backward pass per step the pass count is
        not kept (it stays at 1), and a started reduction (a handle) is what a pass too many
        finds."""
        handles = self._handles
        prev = handles.get(p)
        if prev is not None and prev[0] is not None:
            raise AssertionError("Gradients were computed more than backward_passes_per_step "
                                 "times before call to step(). Increase "
                                 "backward_passes_per_step to accumulate gradients locally.")
        if self.backward_passes_per_step != 1:
            left = self._allreduce_delay[p] - 1
            self._allreduce_delay[p] = left
            if left > 0:
                handles[p] = (None, None)
                return
        if self._groups is not None:
            group = self._p_to_group[p]
            self._group_counts[group] += 1
            if self._group_counts[group] == len(group):
                for gp in group:
                    self._handles.pop(gp, None)
                self._handles[group] = self._submit_group(group)
                self._group_counts[group] = 0
            else:
                handles[p] = (None, None)
            return
        handles[p] = self._submit(p)

    def _submit_missing(self) -> None:
        """Start the allreduces of the parameters (or groups) that no handle covers yet."""
        begun = set()
        for key in self._handles:
            begun.update(key if isinstance(key, tuple) else (key,))
        if self._groups is not None:  # a group is always reduced as a whole, zeros if absent
            for group in self._group_counts:
                if group[0] not in begun:
                    self._handles[group] = self._submit_group(group)
        else:
            for p in [q for q in self._requires_update if q not in begun]:
                self._handles[p] = self._submit(p)

    def synchronize(self) -> None:
        """Finish every gradient's allreduce (starting those not yet started) in place."""
        if not self.process_set.included():
            self._synchronized = True
            return
        started, idle = 0, False
        for key, (handle, _) in self._handles.items():
            if handle is None:
                idle = True
            else:
                started += len(key) if isinstance(key, tuple) else 1
        if idle:
            for key in [k for k, (h, _) in self._handles.items() if h is None]:
                del self._handles[key]
        if started < len(self._requires_update):     # some gradients never arrived
            self._submit_missing()
        waited_from = time.perf_counter()           # exposed communication (metrics)
        try:
            with torch_stream(self._gpu):   # CUDA results: torch's stream waits for them
                for key, (handle, info) in self._handles.items():
                    self._finish(key, handle, info)
        finally:
            self._handles.clear()
            if self.backward_passes_per_step != 1:    # (_on_grad keeps no count at 1)
                self._allreduce_delay = dict.fromkeys(self._allreduce_delay,
                                                      self.backward_passes_per_step)
            if self._groups is not None:
                self._group_counts = dict.fromkeys(self._group_counts, 0)
        self._synchronized = True
        note_step(time.perf_counter() - waited_from)

    def _finish(self, key: Any, handle: Any, info: Any) -> None:
        if info is _IN_PLACE:
            handle.wait()
            return
        if info == "sparse":
            key.grad = handle()
            return
        handle.wait()
        if isinstance(key, tuple):
            for p, (s, ctx) in zip(key, info):
                self._write_back(p, s.finish(), ctx)
        else:
            s, ctx = info
            self._write_back(key, s.finish(), ctx)

    def _write_back(self, p: torch.Tensor, reduced: torch.Tensor, ctx: Any) -> None:
        """Decompress (Horovod-style compressors) and put the reduced gradient in ``p.grad``."""
        if self._spec is None:
            reduced = self._compression.decompress(reduced, ctx)
        if reduced is not p.grad:
            if p.grad.is_sparse:
                p.grad = reduced.to_sparse()
            else:
                with torch.no_grad():
                    p.grad.copy_(reduced)

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Within this block ``step()`` does not synchronize (call ``synchronize()`` first)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    # ---- optimizer API ------------------------------------------------------------------------
    def step(self, closure: Any = None) -> Any:
        if self._should_synchronize:
            if self._synchronized and not self._warned_double_sync:
                self._warned_double_sync = True
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "context after optimizer.synchronize(). This can cause training "
                              "slowdown. You may want to consider using "
                              "optimizer.skip_synchronize() context if you use "
                              "optimizer.synchronize() in your code.", stacklevel=2)
            self.synchronize()
        self._synchronized = False
        return self._opt.step(closure) if closure is not None else self._opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._handles:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but "
                                 "before optimizer.step() or optimizer.synchronize(). This is "
                                 "prohibited as it can cause a race condition.")
        self._opt.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        self._opt.add_param_group(param_group)
        if self.process_set.included() and _api.size() > 1:
            for p in self.param_groups[-1]["params"]:
                if p not in self._parameter_names:
                    self._parameter_names[p] = f"allreduce.noname.{len(self.param_groups) - 1}" \
                                               f".{len(self._parameter_names)}"
                    self._allreduce_delay[p] = self.backward_passes_per_step
                if p.requires_grad and p not in self._requires_update:
                    self._watch(p)

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = passes
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = passes

    def state_dict(self) -> dict:
        """The wrapped optimizer's state dict, plus this rank's compressor state (if any)."""
        sd = self._opt.state_dict()
        comp = self._compressor(create=False)
        if comp is not None:
            state = comp.state_dict()
            if state:
                sd[_STATE_KEY] = {"spec": self._spec, "state": state}
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        comp_state = state_dict.pop(_STATE_KEY, None)
        self._handles.clear()
        self._synchronized = False
        self._should_synchronize = True
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step
        self._opt.load_state_dict(state_dict)
        if comp_state is not None:
            comp = self._compressor(create=True)
            if comp is None or comp_state["spec"] != self._spec:
                raise InvalidArgumentError(f"state_dict holds compressor state for "
                                           f"{comp_state['spec']!r} but this optimizer uses "
                                           f"{self._spec!r}")
            comp.load_state_dict(comp_state["state"])

    def _compressor(self, create: bool) -> Any:
        """The compressor of this optimizer's process set (its state is per process set)."""
        if self._spec in (None, "none") or not _api.is_initialized():
            return None
        return _api.compressor(self.process_set, self._spec, create)
