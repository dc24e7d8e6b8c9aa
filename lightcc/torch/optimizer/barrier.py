"""The optimizer ``DistributedOptimizer(...)`` returns: averages gradients over ranks while
backward is still running, and steps once they are all reduced (a barrier at each step).

The wrapper is an ordinary class (no class built at run time): a
:class:`~.wrapper.WrappedOptimizer`, so ``isinstance(opt, torch.optim.Optimizer)``,
LR schedulers and ``torch.amp.GradScaler`` accept it, and ``param_groups``, ``state`` and
``defaults`` are the wrapped optimizer's. A post-accumulate-grad hook on every parameter
(:meth:`BarrierOptimizer.on_gradient`) counts backward passes and, after the last one, has
the :class:`~.reducer.GradientReducer` start that gradient's in-place allreduce, so
communication overlaps the rest of backward; the engine fuses what is ready into buckets and
applies ``compression`` to each bucket. ``step()`` waits for the reductions
(``synchronize()``) and steps the wrapped optimizer; waiting for CUDA gradients makes torch's
current stream wait, not the host.

The public members below marked *(for subclasses)* are what cross-barrier mode
(:mod:`.cross_barrier`) and Adasum (:mod:`.adasum`) build on.
"""
from __future__ import annotations

import contextlib
import time
import warnings
import weakref
from typing import Any, Iterator

import torch

from ...common import api as _api
from ...common.exceptions import InvalidArgumentError
from ...common.observability.metrics import note_step
from .._tensor import torch_stream
from .reducer import GradientReducer, PendingGradient
from .wrapper import WrappedOptimizer, parameter_names, split_groups

_STATE_KEY = "lightcc_compression"     # compressor state inside state_dict()


def _reducer_owned(name: str, doc: str) -> property:
    """An attribute horovod.torch's optimizer has, kept by its :class:`GradientReducer`
    (assignable, as in Horovod)."""
    return property(lambda self: getattr(self.reducer, name),
                    lambda self, value: setattr(self.reducer, name, value), doc=doc)


class BarrierOptimizer(WrappedOptimizer):
    """See :func:`~.factory.DistributedOptimizer`. ``partition_bytes``: see
    :class:`~.reducer.GradientReducer` (0, the default: whole gradients)."""

    def __init__(self, optimizer: torch.optim.Optimizer, named_parameters: Any,
                 compression: Any, backward_passes_per_step: int, op: Any,
                 gradient_predivide_factor: float, groups: Any, sparse_as_dense: bool,
                 process_set: Any, partition_bytes: int = 0) -> None:
        # torch.optim.Optimizer.__init__ is not called: the wrapped optimizer owns the state.
        self._opt = optimizer
        #: How gradients are reduced: names, priorities, compression, the prepared requests.
        self.reducer = GradientReducer(compression, op, gradient_predivide_factor,
                                       sparse_as_dense, process_set,
                                       parameter_names(named_parameters, self.param_groups),
                                       partition_bytes)
        self.backward_passes_per_step = backward_passes_per_step
        self._passes_left = {p: backward_passes_per_step for p in self.reducer.names}
        self._started: dict[Any, PendingGradient] = {}   # parameter or group -> its reduction
        self._arrived: set = set()         # gradients in, reduction not started (passes, group)
        self._requires_update: dict = {}     # parameter -> None, in registration order
        self._hook_handles: list = []
        self._synchronized = False
        self._should_synchronize = True
        self._warned_double_sync = False
        self._groups = groups
        self._p_to_group: dict = {}
        self._group_counts: dict = {}
        if self.process_set.included() and _api.size() > 1:
            self._register_hooks()

    # ---- Horovod's attributes, owned by the reducer -------------------------------------------
    op = _reducer_owned("op", "The reduction (Average or Sum).")
    gradient_predivide_factor = _reducer_owned("gradient_predivide_factor",
                                               "Scale by 1/f before the sum, f/size after.")
    sparse_as_dense = _reducer_owned("sparse_as_dense", "Reduce sparse gradients as dense.")
    process_set = _reducer_owned("process_set", "The ranks the gradients are averaged over.")

    @property
    def _parameter_names(self) -> dict:
        """{parameter: allreduce name}, under horovod.torch's name (docs/torch.md)."""
        return self.reducer.names

    # ---- the surface subclasses build on ------------------------------------------------------
    @property
    def watched(self) -> Any:
        """*(for subclasses)* The parameters whose gradients are reduced, in registration
        order (a live view; empty on one rank or outside the process set)."""
        return self._requires_update.keys()

    @property
    def should_synchronize(self) -> bool:
        """*(for subclasses)* False inside :meth:`skip_synchronize`."""
        return self._should_synchronize

    @property
    def step_pending(self) -> bool:
        """*(for subclasses)* True from the first gradient of a step until ``step()`` or
        ``synchronize()`` takes this step's reductions (``zero_grad()`` then raises)."""
        return bool(self._started or self._arrived)

    def start_all(self) -> list[PendingGradient]:
        """*(for subclasses)* Start the reductions backward did not start (gradients that
        never arrived are reduced as zeros, incomplete groups as a whole) and hand over every
        reduction of this step; the caller finishes them (``reducer.finish``). The pass and
        group counts start again for the next backward."""
        started = sum(len(key) if isinstance(key, tuple) else 1 for key in self._started)
        if started < len(self._requires_update):     # some gradients never arrived
            self._submit_missing()
        reductions = list(self._started.values())
        self._started.clear()
        self._arrived.clear()
        if self.backward_passes_per_step != 1 or self._groups is not None:
            self.restart_counts()           # (on_gradient keeps no pass count at 1)
        self._synchronized = False
        return reductions

    def restart_counts(self) -> None:
        """*(for subclasses)* A new step: no gradient arrived yet, every parameter has
        ``backward_passes_per_step`` passes to go and every group none of its members."""
        self._arrived.clear()
        self._passes_left = dict.fromkeys(self._passes_left, self.backward_passes_per_step)
        if self._groups is not None:
            self._group_counts = dict.fromkeys(self._group_counts, 0)

    def on_gradient(self, p: torch.Tensor) -> None:
        """*(for subclasses)* The post-accumulate-grad hook: count the pass; reduce once the
        last one arrived.

        Runs once per gradient per step, so it looks ``p`` up as few times as it can (a
        tensor's hash is a Python call): with one backward pass per step the pass count is
        not kept (it stays at 1), and a started reduction is what a pass too many finds."""
        started = self._started
        if p in started:
            raise AssertionError("Gradients were computed more than backward_passes_per_step "
                                 "times before call to step(). Increase "
                                 "backward_passes_per_step to accumulate gradients locally.")
        if self.backward_passes_per_step != 1 and not self.count_pass(p):
            return
        if self._groups is not None:
            group = self._p_to_group[p]
            self._group_counts[group] += 1
            if self._group_counts[group] == len(group):
                self._arrived.difference_update(group)
                started[group] = self.reducer.submit_group(group)
                self._group_counts[group] = 0
            else:
                self._arrived.add(p)
            return
        started[p] = self.reducer.submit(p)

    def count_pass(self, p: torch.Tensor) -> bool:
        """*(for subclasses)* Count a backward pass of ``p``: True when it was the step's
        last (``backward_passes_per_step``), else False and ``p`` is marked as arrived."""
        left = self._passes_left[p] - 1
        self._passes_left[p] = left
        if left > 0:
            self._arrived.add(p)
            return False
        self._arrived.discard(p)
        return True

    # ---- construction helpers -----------------------------------------------------------------
    def _trainable(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"] if p.requires_grad]

    def _register_hooks(self) -> None:
        params = self._trainable()
        if self._groups is not None:
            for group in split_groups(params, self._groups, self.reducer.names,
                                      self.process_set):
                for p in group:
                    self._p_to_group[p] = group
                self._group_counts[group] = 0
        for p in params:
            self._watch(p)

    def _watch(self, p: torch.Tensor) -> None:
        self._requires_update[p] = None
        self._hook_handles.append(p.register_post_accumulate_grad_hook(_weak_hook(self)))

    def _submit_missing(self) -> None:
        """Start the allreduces of the parameters (or groups) that no reduction covers yet."""
        begun = set()
        for key in self._started:
            begun.update(key if isinstance(key, tuple) else (key,))
        if self._groups is not None:  # a group is always reduced as a whole, zeros if absent
            for group in self._group_counts:
                if group[0] not in begun:
                    self._started[group] = self.reducer.submit_group(group)
        else:
            for p in [q for q in self._requires_update if q not in begun]:
                self._started[p] = self.reducer.submit(p)

    # ---- optimizer API ------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Finish every gradient's allreduce (starting those not yet started) in place."""
        if not self.process_set.included():
            self._synchronized = True
            return
        reductions = self.start_all()
        waited_from = time.perf_counter()           # exposed communication (metrics)
        finish = self.reducer.finish
        with torch_stream(self.reducer.gpu):   # CUDA results: torch's stream waits for them
            for pending in reductions:
                if pending.staged is None and not pending.sparse:
                    pending.handle.wait()      # reduced in its own memory: nothing to copy
                else:
                    finish(pending)
        self._synchronized = True
        note_step(time.perf_counter() - waited_from)

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Within this block ``step()`` does not synchronize (call ``synchronize()`` first)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

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
        if self.step_pending:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but "
                                 "before optimizer.step() or optimizer.synchronize(). This is "
                                 "prohibited as it can cause a race condition.")
        self._opt.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        self._opt.add_param_group(param_group)
        if self.process_set.included() and _api.size() > 1:
            names = self.reducer.names
            for p in self.param_groups[-1]["params"]:
                if p not in names:
                    names[p] = f"allreduce.noname.{len(self.param_groups) - 1}.{len(names)}"
                    self._passes_left[p] = self.backward_passes_per_step
                if p.requires_grad and p not in self._requires_update:
                    self._watch(p)

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = passes
        for p in self._passes_left:
            self._passes_left[p] = passes

    def state_dict(self) -> dict:
        """The wrapped optimizer's state dict, plus this rank's compressor state (if any)."""
        sd = self._opt.state_dict()
        comp = self._compressor(create=False)
        if comp is not None:
            state = comp.state_dict()
            if state:
                sd[_STATE_KEY] = {"spec": self.reducer.spec, "state": state}
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        comp_state = state_dict.pop(_STATE_KEY, None)
        self._started.clear()
        self._arrived.clear()
        self._synchronized = False
        self._should_synchronize = True
        for p in self._passes_left:
            self._passes_left[p] = self.backward_passes_per_step
        self._opt.load_state_dict(state_dict)
        if comp_state is not None:
            comp = self._compressor(create=True)
            spec = self.reducer.spec
            if comp is None or comp_state["spec"] != spec:
                raise InvalidArgumentError(f"state_dict holds compressor state for "
                                           f"{comp_state['spec']!r} but this optimizer uses "
                                           f"{spec!r}")
            comp.load_state_dict(comp_state["state"])

    def _compressor(self, create: bool) -> Any:
        """The compressor of this optimizer's process set (its state is per process set)."""
        if self.reducer.spec in (None, "none") or not _api.is_initialized():
            return None
        return _api.compressor(self.process_set, self.reducer.spec, create)


def _weak_hook(opt: "BarrierOptimizer") -> Any:
    """The gradient hook of ``opt``, holding it weakly. torch keeps a tensor's hooks on its C++
    side, out of sight of Python's cycle collector, so a hook holding the optimizer (which holds
    the parameters) kept every DistributedOptimizer a script dropped alive, and still reducing
    its gradients. Once ``opt`` is gone its hooks do nothing."""
    ref = weakref.ref(opt)

    def hook(p: torch.Tensor) -> None:
        live = ref()
        if live is not None:
            live.on_gradient(p)

    return hook
