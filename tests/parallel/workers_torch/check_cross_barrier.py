"""Cross-barrier DistributedOptimizer: refusals, the stale-read error, zero_grad, torch.compile.

Every case runs on every rank; refusals must raise the same clear error everywhere (no hang).
References are barrier-mode runs of the same model in the same process (distinct names).
"""
from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F
from common import check, raises, run
from torch import nn

import lightcc.torch as hvd
from lightcc.common.exceptions import InvalidArgumentError

R = N = 0


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4))


def wrap(model: nn.Module, prefix: str, xbar: bool, opt: torch.optim.Optimizer | None = None,
         **kw) -> torch.optim.Optimizer:
    opt = opt or torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return hvd.DistributedOptimizer(opt, named_parameters=[(f"{prefix}.{n}", p) for n, p in
                                                           model.named_parameters()],
                                    cross_barrier=xbar, model=model if xbar else None, **kw)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + R)
    return torch.randn(5, 6, generator=g), torch.randint(0, 4, (5,), generator=g)


def refuses_without_model() -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    raises(InvalidArgumentError, lambda: hvd.DistributedOptimizer(
        opt, named_parameters=model.named_parameters(), cross_barrier=True), "no model",
        match="cross_barrier=True needs model=")
    raises(InvalidArgumentError, lambda: hvd.DistributedOptimizer(
        opt, named_parameters=model.named_parameters(), model=model), "model without xbar",
        match="only used with cross_barrier=True")


def refuses_whole_model_optimizers() -> None:
    class Clipped(torch.optim.SGD):
        pass

    model = make_model()
    for opt in (torch.optim.LBFGS(model.parameters()), Clipped(model.parameters(), lr=0.1)):
        raises(InvalidArgumentError, lambda o=opt: wrap(model, "r", True, o), type(opt).__name__,
               match="per parameter")


def refuses_closure() -> None:
    model = make_model()
    opt = wrap(model, "c", True)
    x, y = batch(0)
    F.cross_entropy(model(x), y).backward()
    raises(InvalidArgumentError, lambda: opt.step(lambda: 0.0), "closure", match="closure")
    opt.step()
    opt.synchronize()


class Parent(nn.Module):
    """Reads its child's parameters without calling the child (always, or from step 1 on)."""

    def __init__(self, call_first: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inner = nn.Linear(6, 4)
        self.call_first, self.calls = call_first, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.call_first and self.calls == 1:
            return self.inner(x)
        return F.linear(x, self.inner.weight, self.inner.bias)


def parent_reading_child_weights_matches_barrier() -> None:
    """The first forward shows ``inner`` is never called: Parent's pre-hook applies its
    parameters (as for ``nn.MultiheadAttention.out_proj`` or a position embedding)."""
    runs = []
    for xbar in (False, True):
        model = Parent(call_first=False)
        opt = wrap(model, f"p{int(xbar)}", xbar)
        for step in range(4):
            opt.zero_grad()
            x, y = batch(step)
            F.cross_entropy(model(x), y).backward()
            opt.step()
        opt.synchronize()
        runs.append([p.detach().clone() for p in model.parameters()])
    check(all(torch.equal(a, b) for a, b in zip(*runs)), "parent: cross-barrier != barrier")


def stale_read_is_an_error() -> None:
    """A module called in the first forward but read directly later would see the old value:
    the next backward says so (on every rank) instead of training on it."""
    expect_stale_read(Parent(call_first=True), "s", "stale read")


def expect_stale_read(model: nn.Module, prefix: str, what: str) -> None:
    """Step once, then the next backward must raise the stale-read error."""
    opt = wrap(model, prefix, True)
    x, y = batch(0)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    raises(InvalidArgumentError, loss.backward, what, match="still pending")
    opt.synchronize()


class Stem(Parent):
    """A module of its own before ``inner``: its pre-hook applies ``inner``'s completed update
    early (while or after waiting for its own), so the direct read from step 1 on sees the new
    value, or not, depending on timing."""

    def __init__(self) -> None:
        super().__init__(call_first=True)
        self.stem = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(torch.tanh(self.stem(x)))


def stale_read_after_an_early_update_is_an_error() -> None:
    """The same misuse when another module's pre-hook applied ``inner``'s update before the
    read: still an error on every rank (the outcome must not depend on which updates had
    completed when that hook ran)."""
    expect_stale_read(Stem(), "e", "stale read after an early update")


def zero_grad_keeps_reducing_gradients() -> None:
    """zero_grad(set_to_none=False) and (True) between step() and the next forward leave the
    gradient under reduction alone: the result equals barrier mode's, bit for bit."""
    for set_to_none in (False, True):
        runs = []
        for xbar in (False, True):
            model = make_model()
            opt = wrap(model, f"z{int(set_to_none)}{int(xbar)}", xbar)
            for step in range(4):
                opt.zero_grad(set_to_none=set_to_none)
                x, y = batch(step)
                F.cross_entropy(model(x), y).backward()
                opt.step()
            opt.zero_grad(set_to_none=set_to_none)
            opt.synchronize()
            runs.append([p.detach().clone() for p in model.parameters()])
            if not set_to_none:
                check(all(p.grad is not None and not p.grad.any() for p in model.parameters()),
                      "zero_grad(set_to_none=False) left zero gradients")
        check(all(torch.equal(a, b) for a, b in zip(*runs)),
              f"zero_grad(set_to_none={set_to_none}): cross-barrier != barrier")


def attention_reads_child_weights() -> None:
    """nn.MultiheadAttention reads out_proj.weight without calling out_proj: the hook of the
    module owning in_proj_weight applies its children's updates too (else: stale-read error)."""
    runs = []
    for xbar in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.TransformerEncoderLayer(8, 2, 16,
                                                                          dropout=0.0))
        opt = wrap(model, f"a{int(xbar)}", xbar)
        for step in range(4):
            opt.zero_grad()
            x, y = batch(step)
            F.cross_entropy(model(x.view(5, 1, 6).expand(5, 3, 6))[:, 0, :4], y).backward()
            opt.step()
        opt.synchronize()
        runs.append([p.detach().clone() for p in model.parameters()])
    check(all(torch.equal(a, b) for a, b in zip(*runs)), "attention: cross-barrier != barrier")


def compiled_model_matches_barrier() -> None:
    """torch.compile'd model (the hooks run eagerly at graph breaks). Dynamo does not guard
    on module hooks: a graph compiled for a hook-less model of the same class would be reused
    without them (the stale-read check catches that), hence the reset (docs/cross-barrier.md)."""
    if os.environ.get("LCC_TEST_SKIP_COMPILE"):
        return
    runs = []
    for xbar in (False, True):
        torch._dynamo.reset()
        model = make_model()
        opt = wrap(model, f"k{int(xbar)}", xbar)
        fwd = torch.compile(model, backend="eager")
        for step in range(4):
            opt.zero_grad()
            x, y = batch(step)
            F.cross_entropy(fwd(x), y).backward()
            opt.step()
        opt.synchronize()
        runs.append([p.detach().clone() for p in model.parameters()])
    check(all(torch.equal(a, b) for a, b in zip(*runs)), "compiled: cross-barrier != barrier")


def priority_follows_forward_order() -> None:
    """The first forward numbers the parameters in the order modules are called (the next
    forward's needs first); the allreduces of backward carry those priorities."""
    model = make_model()
    opt = wrap(model, "p", True)
    x, y = batch(0)
    F.cross_entropy(model(x), y).backward()
    expect = {p: i + 1 for i, p in enumerate(model.parameters())}   # Linear 0, then Linear 2
    priorities = opt.reducer.priorities
    check(priorities == expect, f"priorities {list(priorities.values())}")
    check(opt.reducer._prepared_priority == expect, "prepared allreduces carry the priorities")
    opt.step()
    opt.synchronize()


def priority_mismatch_fails_on_every_rank() -> None:
    """Ranks that disagree on an allreduce's priority (a model whose forward order differs
    between ranks) get the mismatch error on every rank, not a hang or different orders."""
    model = make_model()
    opt = wrap(model, "q", True)
    x, y = batch(0)
    out = model(x)
    if R == 1:
        priorities = opt.reducer.priorities
        priorities.update({p: v + 10 for p, v in priorities.items()})
    F.cross_entropy(out, y).backward()
    opt.step()
    raises(Exception, opt.synchronize, "priority mismatch", match="has priority")


def main() -> None:
    global R, N
    hvd.init()
    R, N = hvd.rank(), hvd.size()
    run([refuses_without_model, refuses_whole_model_optimizers, refuses_closure,
         parent_reading_child_weights_matches_barrier, stale_read_is_an_error,
         stale_read_after_an_early_update_is_an_error,
         zero_grad_keeps_reducing_gradients,
         attention_reads_child_weights, compiled_model_matches_barrier,
         priority_follows_forward_order, priority_mismatch_fails_on_every_rank])
    hvd.shutdown()


if __name__ == "__main__":
    sys.exit(main())
