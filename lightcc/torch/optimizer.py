"""``DistributedOptimizer``: averages gradients over ranks while backward is still running.

The wrapper is an ordinary class (no class built at run time): it subclasses
``torch.optim.Optimizer`` so ``isinstance(opt, torch.optim.Optimizer)``, LR schedulers and
``torch.amp.GradScaler`` accept it, and delegates ``param_groups``, ``state`` and ``defaults``
to the wrapped optimizer. A post-accumulate-grad hook on every parameter submits that
gradient's in-place allreduce as soon as autograd has written it, so communication overlaps
the rest of backward; the engine fuses what is ready into buckets and applies ``compression``
to each bucket. ``step()`` waits for the reductions (``synchronize()``) and steps the wrapped
optimizer. CUDA gradients are reduced in their own GPU memory (NCCL, or MPI through pinned
host buffers); waiting for them makes torch's current stream wait, not the host.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Iterator

import torch

from ..common import api as _api
from ..common.api import Adasum, Average, global_process_set
from ..common.exceptions import InvalidArgumentError
from . import mpi_ops as _ops
from ._tensor import as_array, device_array, stage, torch_stream
from .compression import Compression, spec_of
from .functions import broadcast_object

_STATE_KEY = "lightcc_compression"     # compressor state inside state_dict()
_IN_PLACE = object()                   # handle info: reduced in the gradient's own memory


class _DistributedOptimizer(torch.optim.Optimizer):
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
        self._parameter_names = self._check_names(named_parameters)
        self._allreduce_delay = {p: backward_passes_per_step for p in self._parameter_names}
        self._handles: dict[Any, tuple[Any, Any]] = {}
        self._prepared: dict = {}            # parameter -> (engine, request, dtype)
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

    # ---- delegation to the wrapped optimizer --------------------------------------------------
    @property
    def param_groups(self) -> list[dict]:
        return self._opt.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict]) -> None:
        self._opt.param_groups = value

    @property
    def state(self) -> Any:
        return self._opt.state

    @state.setter
    def state(self, value: Any) -> None:
        self._opt.state = value

    @property
    def defaults(self) -> dict:
        return self._opt.defaults

    @defaults.setter
    def defaults(self, value: dict) -> None:
        self._opt.defaults = value

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes this wrapper lacks (torch internals such as hook dicts).
        if name == "_opt":
            raise AttributeError(name)
        return getattr(self._opt, name)

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self._opt!r})"

    # ---- construction helpers -----------------------------------------------------------------
    def _check_names(self, named_parameters: Any) -> dict:
        if named_parameters is not None:
            named = list(named_parameters)
        else:
            named = [(f"allreduce.noname.{i}.{j}", p)
                     for i, group in enumerate(self.param_groups)
                     for j, p in enumerate(group["params"])]
        if any(not isinstance(item, tuple) for item in named):
            raise ValueError("named_parameters should be a sequence of tuples (name, "
                             "parameter), usually produced by model.named_parameters().")
        seen, dups = set(), set()
        for name, _ in named:
            (dups if name in seen else seen).add(name)
        if dups:
            raise ValueError("Parameter names in named_parameters must be unique. Found "
                             f"duplicates: {', '.join(sorted(dups))}")
        all_ids = {id(p) for group in self.param_groups for p in group["params"]}
        unnamed = all_ids - {id(p) for _, p in named}
        if unnamed:
            raise ValueError("named_parameters was specified, but one or more model "
                             f"parameters were not named ({len(unnamed)} of "
                             f"{len(all_ids)}). Python object ids: "
                             f"{', '.join(str(i) for i in sorted(unnamed))}")
        return {p: name for name, p in sorted(named, key=lambda item: item[0])}

    def _trainable(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"] if p.requires_grad]

    def _register_hooks(self) -> None:
        params = self._trainable()
        if self._groups is not None:
            self._form_groups(params)
        for p in params:
            self._watch(p)

    def _watch(self, p: torch.Tensor) -> None:
        self._requires_update[p] = None
        self._hook_handles.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def _form_groups(self, params: list[torch.Tensor]) -> None:
        """Explicit groups: every rank orders parameters like rank 0, then splits them."""
        names = broadcast_object([self._parameter_names[p] for p in params],
                                 root_rank=_ops._first_member(self.process_set),
                                 name="lightcc.optimizer.groups", process_set=self.process_set)
        order = {name: i for i, name in enumerate(names)}
        params = sorted(params, key=lambda p: order.get(self._parameter_names[p], len(order)))
        if isinstance(self._groups, list):
            grouped, done = [], set()
            wanted = {id(p) for p in params}
            for group in self._groups:
                members = tuple(p for p in group if id(p) in wanted)
                if members:
                    grouped.append(members)
                done.update(id(p) for p in members)
            grouped += [(p,) for p in params if id(p) not in done]
        else:
            k = max(1, min(int(self._groups), len(params)))
            bounds = [round(i * len(params) / k) for i in range(k + 1)]
            grouped = [tuple(params[a:b]) for a, b in zip(bounds, bounds[1:]) if b > a]
        for group in grouped:
            for p in group:
                self._p_to_group[p] = group
            self._group_counts[group] = 0

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
        request validated at the first step (same name, shape, dtype, op and scales every
        step), so a gradient costs a view and a queue entry."""
        eng = _api.engine()
        cached = self._prepared.get(p)
        if cpu:
            arr = as_array(grad)
        else:                       # CUDA: ready event on the stream that wrote the gradient
            arr = device_array(grad, ready=True)
            self._gpu = grad.device
        if cached is not None and cached[0] is eng and cached[1].shape == arr.shape and \
                cached[2] == arr.dtype:
            return eng.submit(cached[1], arr, arr)
        pre, post = self._scales()
        handle = _api.allreduce_async(arr, self.op, self._parameter_names[p], pre, post,
                                      self.process_set, self._compression, out=arr)
        self._prepared[p] = (eng, handle.request, arr.dtype)
        return handle

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
        group = _api.engine().group(_api._pset_id(self.process_set))
        if create:
            return group.compressor(self._spec)
        return group.compressors.get(self._spec)


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters: Any = None,
                         compression: Any = None, backward_passes_per_step: int = 1,
                         op: Any = Average, gradient_predivide_factor: float = 1.0,
                         num_groups: int = 0, groups: Any = None, sparse_as_dense: bool = False,
                         process_set: Any = global_process_set, cross_barrier: bool = False,
                         model: Any = None) -> _DistributedOptimizer:
    """Wrap ``optimizer`` so that ``step()`` applies gradients averaged over all ranks.

    Arguments follow ``horovod.torch.DistributedOptimizer``: ``named_parameters`` (names for
    the allreduces, usually ``model.named_parameters()``; must be unique and cover every
    parameter), ``compression`` (a ``Compression`` value, applied by the engine per fused
    bucket, or a Horovod-style compressor applied per tensor; when not given, the default set
    by ``LCC_COMPRESSION`` / ``lccrun --compression``, else none), ``backward_passes_per_step`` (local accumulation before reducing; gradients are
    summed over passes, not averaged), ``op`` (Average or Sum), ``gradient_predivide_factor``
    (scale by 1/f before the sum and f/size after; Average only), ``groups``/``num_groups``
    (reduce these parameters together), ``sparse_as_dense`` and ``process_set``. Call
    ``synchronize()`` before modifying gradients (clipping, ``GradScaler.unscale_``), then
    ``step()`` inside ``skip_synchronize()``. ``cross_barrier=True`` (needs ``model``, the
    module whose forward reads the parameters) lets the next forward start before every
    reduction finished: each module's update is applied just before its forward, exactly as
    ``step()`` would have applied it (docs/cross-barrier.md).
    """
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be "
                      "removed.", DeprecationWarning, stacklevel=2)
        if groups is None:
            groups = num_groups
    if groups is not None:
        _check_groups(groups)
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    if op == Adasum and _api.size() > 1:
        raise InvalidArgumentError("Adasum is not supported by lightcc; use op=Average")
    if isinstance(optimizer, _DistributedOptimizer):
        raise ValueError("optimizer is already a DistributedOptimizer")
    if compression is None:
        compression = default_compression()
    if cross_barrier:
        if not isinstance(model, torch.nn.Module):
            raise InvalidArgumentError("cross_barrier=True needs model=<the torch.nn.Module "
                                       "whose forward reads these parameters>: its modules' "
                                       f"forward pre-hooks apply the updates (got {model!r})")
        from .cross_barrier import CrossBarrierOptimizer
        return CrossBarrierOptimizer(optimizer, model, named_parameters, compression,
                                     backward_passes_per_step, op, gradient_predivide_factor,
                                     groups, sparse_as_dense, process_set)
    if model is not None:
        raise InvalidArgumentError("model= is only used with cross_barrier=True")
    return _DistributedOptimizer(optimizer, named_parameters, compression,
                                 backward_passes_per_step, op, gradient_predivide_factor, groups,
                                 sparse_as_dense, process_set)


def default_compression() -> Any:
    """The compressor ``DistributedOptimizer`` uses when given none: ``LCC_COMPRESSION`` (or
    ``lccrun --compression``, or ``init(compression=...)``) as a spec string, else
    ``Compression.none``."""
    spec = _api.config().compression
    return Compression.none if spec in ("", "none") else spec


def _check_groups(groups: Any) -> None:
    if isinstance(groups, list):
        seen = set()
        for group in groups:
            for p in group:
                if not isinstance(p, torch.Tensor):
                    raise ValueError("groups must consist of torch.Tensor.")
                if id(p) in seen:
                    raise ValueError("A parameter can only appear once in groups.")
                seen.add(id(p))
    elif not (isinstance(groups, int) and groups > 0):
        raise ValueError("groups should be a non-negative integer or a list of list of "
                         "torch.Tensor.")
