"""Cross-barrier ``DistributedOptimizer``: the next forward starts while gradients are on the wire.

``step()`` only starts the missing reductions and records, per parameter, a *pending update*
(the reduction, the gradient being reduced, a snapshot of its ``param_group``'s
hyperparameters). A forward pre-hook on every module waits for the reductions of the
parameters that module owns and applies the wrapped optimizer's update to them with those
hyperparameters, so every parameter forward *t+1* reads holds exactly (bitwise) barrier
mode's update of step *t*, while later layers' gradients are still on the wire. Whatever else
reads parameters or optimizer state drains every pending update first. docs/cross-barrier.md.

Built on :class:`~.barrier.BarrierOptimizer`'s public surface only: ``start_all()`` hands
over the step's reductions (:class:`~.reducer.PendingGradient`), ``reducer.finish()`` waits
for one, ``reducer.priorities`` orders them, ``on_gradient()`` is the hook extended here,
``watched``, ``should_synchronize``, ``step_pending`` and ``wrapped`` (the torch optimizer).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...common.exceptions import InvalidArgumentError
from .barrier import BarrierOptimizer
from .reducer import PendingGradient

# torch.optim classes whose update of a parameter reads only that parameter, its gradient and
# its own state: stepping them on a subset of the parameters gives the same bits.
PER_PARAMETER = ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Rprop",
                 "Adagrad", "Adadelta", "ASGD", "SparseAdam")


#: Gradients larger than this (bytes, before compression) are reduced in pieces of at most this
#: size (uncompressed, fp16, bf16: per-element results, so bitwise the same), so that a
#: gradient the next forward needs first, completed while rank 0 executes a batch, is ordered
#: before the rest in the next batch instead of waiting behind a 25 MB tensor.
PARTITION_BYTES = 1 << 20

#: While a module's pre-hook waits for its reductions, it applies the updates of completed
#: reductions this many parameters at a time (re-checking its own between two).
SWEEP_CHUNK = 16

#: Once a module's parameters are reduced, its pre-hook also applies the completed updates of
#: the parameters the forward needs within this many positions after its own.
SWEEP_AHEAD = 16


def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Refuse optimizers whose update of one parameter may read the others (LBFGS, Muon, any
    class that is not one of torch's per-parameter optimizers, subclasses included: their
    ``step`` could compute a global norm)."""
    cls = type(optimizer)
    known = {getattr(torch.optim, n) for n in PER_PARAMETER if hasattr(torch.optim, n)}
    if cls not in known:
        raise InvalidArgumentError(
            f"cross_barrier=True needs an optimizer whose update is per parameter "
            f"(torch.optim {', '.join(PER_PARAMETER)}); {cls.__module__}.{cls.__name__} may "
            f"need every parameter at once, so it cannot update parameters one module at a "
            f"time: use cross_barrier=False")


@dataclass(eq=False, slots=True)
class _PendingUpdate:
    """A parameter's update waiting for its reduction: the reduction, the gradient tensor
    being reduced and the index and hyperparameters of its param_group at ``step()``."""

    reduction: PendingGradient
    grad: Any
    group: int
    hyper: dict


def _snapshot(group: dict) -> dict:
    """A param_group's hyperparameters as they are now (tensors copied: schedulers may write
    a tensor learning rate in place)."""
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v)
            for k, v in group.items() if k != "params"}


class CrossBarrierOptimizer(BarrierOptimizer):
    """See ``DistributedOptimizer(..., cross_barrier=True, model=...)``."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module,
                 *args: Any) -> None:
        check_optimizer(optimizer)
        super().__init__(optimizer, *args, partition_bytes=PARTITION_BYTES)
        self._pending: dict = {}              # parameter -> _PendingUpdate
        self._orders: dict = {}               # param group index -> (params, positions)
        self._module_hooks: list = []
        self._plan: dict = {}                 # module -> parameters its pre-hook applies
        self._called: set = set()             # modules called (first forward; since step())
        self._swept: set = set()              # updates applied ahead of their module's call
        self._owners: Any = None              # parameter -> modules whose pre-hook applies it
        self._learning = True
        self._claimed: set = set()            # parameters some module's pre-hook applies
        self._model = model
        self._hook_model(model)

    # ---- hooks ------------------------------------------------------------------------------
    def _hook_model(self, model: torch.nn.Module, wanted: Any = None) -> None:
        """A forward pre-hook on every module of ``model``: a module applies the updates of
        the parameters it owns directly (of ``wanted``, default: every parameter this
        optimizer reduces) and, once the first forward showed which modules are called, of
        those owned only by modules that forward never called (``nn.MultiheadAttention``
        reads ``out_proj.weight`` without calling ``out_proj``; a model may read
        ``self.pos.weight``): the nearest called ancestor applies them."""
        wanted = set(self.watched) if wanted is None else wanted
        for module in model.modules():
            own = [p for p in module.parameters(recurse=False) if p in wanted]
            if module not in self._plan:
                self._plan[module] = []
                self._module_hooks.append(
                    module.register_forward_pre_hook(self._make_pre_hook(module)))
            self._plan[module].extend(own)
            self._claimed.update(own)
        self._owners = None

    def _adopt_orphans(self) -> None:
        """After the first forward: parameters whose owners were never called go to the
        nearest ancestor that was (none: applied at ``step()``, as unclaimed)."""
        self._learning = False
        parents = {child: mod for mod in self._model.modules() for child in mod.children()}
        for module in list(self._plan):
            if module in self._called or not self._plan[module]:
                continue
            up = parents.get(module)
            while up is not None and up not in self._called:
                up = parents.get(up)
            if up is None:
                self._claimed.difference_update(self._plan[module])
            else:
                self._plan[up] = list(dict.fromkeys(self._plan[up] + self._plan[module]))
                priority = self.reducer.priorities
                first = min((priority[p] for p in self._plan[up] if p in priority), default=0)
                for p in self._plan[module]:     # needed when ``up`` starts
                    priority.setdefault(p, first)
        self._called.clear()
        self._owners = None

    def _owner_called(self, p: torch.Tensor) -> bool:
        """Was a module whose pre-hook applies ``p`` called since the last ``step()``?"""
        if self._owners is None:
            self._owners = {}
            for module, params in self._plan.items():
                for q in params:
                    self._owners.setdefault(q, []).append(module)
        return any(m in self._called for m in self._owners.get(p, ()))

    def _make_pre_hook(self, module: torch.nn.Module) -> Any:
        plan, called = self._plan, self._called

        def pre_forward(mod: Any, args: Any) -> None:
            called.add(mod)
            if self._learning:
                priority = self.reducer.priorities
                for p in plan[mod]:        # forward order: the next forward's needs go first
                    priority.setdefault(p, len(priority) + 1)
            if self._pending:
                pending = self._pending
                own = [p for p in plan[mod] if p in pending]
                if own:
                    self._apply_ready(own)
        # torch.compile: run the wait eagerly (a graph break at each such module).
        disable = getattr(getattr(torch, "_dynamo", None), "disable", None)
        return disable(pre_forward) if disable is not None else pre_forward

    def on_gradient(self, p: torch.Tensor) -> None:
        """Refuse a gradient computed from a parameter whose update is still pending."""
        if p in self._pending or (p in self._swept and not self._owner_called(p)):
            name = self.reducer.names.get(p, "?")
            raise InvalidArgumentError(
                f"cross_barrier: parameter '{name}' got a gradient while its update from the "
                f"previous step was still pending: forward read it without calling the module "
                f"that owns it, so it saw the old value. Call optimizer.synchronize() before "
                f"such a forward, or use cross_barrier=False")
        super().on_gradient(p)

    # ---- applying updates -------------------------------------------------------------------
    def _finish_reduction(self, red: PendingGradient) -> None:
        """Wait for one reduction and leave each member's reduced gradient in its pending
        record (the parameter's own ``.grad`` may already be a new step's)."""
        if red.finished:
            return
        members = red.params
        saved = [p.grad for p in members]
        try:
            for p in members:
                p.grad = self._pending[p].grad
            self.reducer.finish(red)
            for p in members:
                self._pending[p].grad = p.grad
        finally:
            for p, g in zip(members, saved):
                p.grad = g

    def _apply_ready(self, params: list) -> None:
        """Wait for the reductions of ``params`` (a module's) and apply their updates. While
        waiting, apply completed updates of others (forward order, :data:`SWEEP_CHUNK` at a
        time: the optimizer's CPU time hides behind the wire); then ``params`` with the
        completed ones within :data:`SWEEP_AHEAD` forward positions, in one optimizer step
        (a forward costs a few optimizer steps, not one per module)."""
        pending = self._pending
        reds = list({id(r): r for r in (pending[p].reduction for p in params)}.values())
        wanted = set(params)
        while True:
            left = [r for r in reds if not (r.finished or r.completed())]
            if not left:
                break
            extra = self._completed_extras(wanted, SWEEP_CHUNK)
            if extra:
                self._swept.update(extra)
                self._apply(extra)
            elif not left[0].wait_passive():     # lazy mode: Handle.wait drives, below
                break
        for red in reds:
            self._finish_reduction(red)
        priority = self.reducer.priorities
        near = max(priority.get(p, 0) for p in params) + SWEEP_AHEAD
        extra = self._completed_extras(wanted, None, near)
        self._swept.update(extra)      # applied before their module is called: a read by
        self._apply(params + extra)    # another module is checked in on_gradient

    def _completed_extras(self, wanted: set, most: int | None = None,
                          up_to: int | None = None) -> list:
        """Pending parameters outside ``wanted`` whose reductions completed (and whose
        forward-order priority is at most ``up_to``), first needed first, at most ``most``."""
        priority = self.reducer.priorities
        done = [p for p, rec in self._pending.items()
                if p not in wanted and (rec.reduction.finished or rec.reduction.completed())
                and (up_to is None or priority.get(p, 0) <= up_to)]
        done.sort(key=lambda p: priority.get(p, 0))
        return done if most is None else done[:most]

    def _apply(self, params: list) -> None:
        """Apply the pending updates of ``params`` (in place), each with its step's
        hyperparameters, through the wrapped optimizer restricted to them."""
        if not params:
            return
        pend = [self._pending[p] for p in params]
        for rec in pend:
            self._finish_reduction(rec.reduction)
        by_group: dict = {}
        for p, rec in zip(params, pend):
            by_group.setdefault(rec.group, (rec.hyper, []))[1].append(p)
        groups = []
        for index in sorted(by_group):
            hyper, members = by_group[index]
            order = self._order(index)
            members.sort(key=order.__getitem__)
            groups.append({**hyper, "params": members})
        opt = self.wrapped
        original = opt.param_groups
        saved = [p.grad for p in params]
        try:
            for p, rec in zip(params, pend):
                p.grad = rec.grad
            opt.param_groups = groups
            opt.step()
        finally:
            opt.param_groups = original
            for p, g in zip(params, saved):
                p.grad = g
            for p in params:
                del self._pending[p]

    def _order(self, index: int) -> dict:
        """Parameter -> position in param group ``index`` (rebuilt when its list changes)."""
        params = self.wrapped.param_groups[index]["params"]
        cached = self._orders.get(index)
        if cached is None or cached[0] is not params or len(cached[1]) != len(params):
            cached = self._orders[index] = (params, {p: i for i, p in enumerate(params)})
        return cached[1]

    def _drain(self) -> None:
        """Apply every pending update (in registration order)."""
        if self._pending:
            self._apply(list(self._pending))

    # ---- optimizer API ----------------------------------------------------------------------
    def synchronize(self) -> None:
        """Apply every pending update; then, if this step's gradients were computed, finish
        their reductions in place (barrier mode's ``synchronize()``), so a following ``step()``
        (inside ``skip_synchronize()``) updates every parameter at once, as barrier mode does:
        the sync point for gradient clipping and ``GradScaler.unscale_``."""
        self._drain()
        if self.step_pending:
            super().synchronize()

    def step(self, closure: Any = None) -> Any:
        if closure is not None:
            raise InvalidArgumentError("cross_barrier=True: step(closure) is not supported "
                                       "(a closure re-evaluates the model with the updated "
                                       "parameters)")
        self._drain()                  # updates no forward used since the last step()
        self._swept.clear()
        if not self.should_synchronize or not self.process_set.included() or \
                not self.watched:
            # After an explicit synchronize() (clipping, GradScaler), or nothing to reduce:
            # the barrier-mode step.
            if not self._learning:
                self._called.clear()
            return super().step()
        if self._learning:
            self._adopt_orphans()
        self._called.clear()
        reductions = self.start_all()
        groups = self.wrapped.param_groups
        hyper = [_snapshot(g) for g in groups]
        group_of = {p: i for i, g in enumerate(groups) for p in g["params"]}
        for red in reductions:
            for p in red.params:
                i = group_of[p]
                self._pending[p] = _PendingUpdate(red, p.grad, i, hyper[i])
        unclaimed = [p for p in self._pending if p not in self._claimed]
        self._apply(unclaimed)         # no forward hook would wait for these: update now
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero (or drop) every gradient; one still being reduced is left to its pending
        update, and the parameter gets a new one."""
        if self.step_pending:
            super().zero_grad(set_to_none)      # raises: backward done, step() not called
        for p in self._pending:
            if self._pending[p].grad is p.grad:
                p.grad = None if set_to_none else torch.zeros_like(p)
        self.wrapped.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        self._drain()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self._drain()
        super().load_state_dict(state_dict)

    def add_param_group(self, param_group: dict) -> None:
        """Drain, add the group, and hook the modules of ``model`` that own its parameters."""
        self._drain()
        known = set(self.watched)
        super().add_param_group(param_group)
        new = set(self.watched) - known
        if new:
            self._hook_model(self._model, new)

    def remove_hooks(self) -> None:
        """Remove the forward pre-hooks (after draining every pending update)."""
        self._drain()
        for h in self._module_hooks:
            h.remove()
        self._module_hooks.clear()
