"""DistributedOptimizer, broadcast helpers and SyncBatchNorm against one-process references.

Every rank can rebuild every rank's batch, so the reference (one model trained on the
concatenated batch) is computed locally and compared parameter by parameter.
"""
from __future__ import annotations

import copy
import gc
import warnings
import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F

import lightcc.torch as hvd
from common import check, close, raises, run

R = N = 0
STEPS = 4


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4))


def batch(rank: int, step: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, 6, generator=g), torch.randint(0, 4, (n,), generator=g)


def full_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [batch(r, step) for r in range(N)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def same_params(a: nn.Module, b: nn.Module, what: str, atol: float = 1e-5) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        close(p, q, f"{what}: {name}", atol=atol, rtol=1e-4)


def train_pair(make_opt, steps: int = STEPS, dist_kwargs=None, sched=None, atol=1e-5):
    """Train a DistributedOptimizer model on this rank's batches and a reference on all."""
    model, ref = make_model(), make_model()
    opt = hvd.DistributedOptimizer(make_opt(model), named_parameters=model.named_parameters(),
                                   **(dist_kwargs or {}))
    ref_opt = make_opt(ref)
    scheds = (sched(opt), sched(ref_opt)) if sched else None
    for step in range(steps):
        x, y = batch(R, step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        fx, fy = full_batch(step)
        ref_opt.zero_grad()
        F.cross_entropy(ref(fx), fy).backward()
        ref_opt.step()
        if scheds:
            scheds[0].step()
            scheds[1].step()
    same_params(model, ref, "training", atol)
    return model, opt


def case_init():
    global R, N
    hvd.init()
    R, N = hvd.rank(), hvd.size()


def case_sgd_and_adam_match_full_batch():
    _, opt = train_pair(lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9))
    check(isinstance(opt, torch.optim.Optimizer), "isinstance Optimizer")
    check(set(opt._parameter_names.values()) == {"0.weight", "0.bias", "2.weight", "2.bias"},
          "_parameter_names")
    train_pair(lambda m: torch.optim.Adam(m.parameters(), lr=0.01))
    train_pair(lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
               dist_kwargs={"gradient_predivide_factor": 2.0})
    train_pair(lambda m: torch.optim.SGD(m.parameters(), lr=0.1), dist_kwargs={"groups": 2})
    train_pair(lambda m: torch.optim.AdamW(m.parameters(), lr=0.01),
               dist_kwargs={"num_groups": 3})


def case_lr_scheduler():
    _, opt = train_pair(lambda m: torch.optim.SGD(m.parameters(), lr=0.2, momentum=0.5),
                        sched=lambda o: torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5))
    close(torch.tensor(opt.param_groups[0]["lr"]), torch.tensor(0.2 * 0.5 ** STEPS), "lr decayed")


def case_explicit_groups_and_sum():
    model, ref = make_model(), make_model()
    params = list(model.parameters())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters(),
                                   groups=[[params[0], params[3]]], op=hvd.Sum)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    for step in range(2):
        x, y = batch(R, step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        ref_opt.zero_grad()
        fx, fy = full_batch(step)
        (F.cross_entropy(ref(fx), fy) * N).backward()   # op=Sum: grads of the summed losses
        ref_opt.step()
    same_params(model, ref, "groups + Sum")


def case_backward_passes_per_step():
    model, ref = make_model(), make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   backward_passes_per_step=2)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        opt.zero_grad()
        ref_opt.zero_grad()
        for micro in range(2):
            x, y = batch(R, 10 * step + micro)
            F.cross_entropy(model(x), y).backward()
            fx, fy = full_batch(10 * step + micro)
            F.cross_entropy(ref(fx), fy).backward()
        opt.step()
        ref_opt.step()
    same_params(model, ref, "backward_passes_per_step=2")
    x, y = batch(R, 99)
    for _ in range(2):
        F.cross_entropy(model(x), y).backward()
    raises(AssertionError, lambda: F.cross_entropy(model(x), y).backward(), "third pass")
    opt.synchronize()


def case_second_pass_with_one_pass_per_step():
    """backward_passes_per_step=1 (the pass count is not kept): a second backward before
    step() is refused, and the step after synchronize() still averages the first pass."""
    model, ref = make_model(), make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x, y = batch(R, 77)
    F.cross_entropy(model(x), y).backward()
    raises(AssertionError, lambda: F.cross_entropy(model(x), y).backward(), "second pass")
    opt.synchronize()
    model.zero_grad()       # the refused pass added to the local grads; start over
    opt.zero_grad()
    for step in range(2):
        opt.zero_grad()
        ref_opt.zero_grad()
        x, y = batch(R, 80 + step)
        F.cross_entropy(model(x), y).backward()
        fx, fy = full_batch(80 + step)
        F.cross_entropy(ref(fx), fy).backward()
        opt.step()
        ref_opt.step()
    same_params(model, ref, "after a refused second pass")


def case_unused_parameter_and_zero_grad():
    torch.manual_seed(3)
    model = nn.ModuleDict({"a": nn.Linear(3, 2), "b": nn.Linear(3, 2)})
    ref = copy.deepcopy(model)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                   named_parameters=model.named_parameters())
    x = torch.ones(1, 3) * (R + 1)
    opt.zero_grad(set_to_none=True)
    out = model["a"](x) + (model["b"](x) if R == 0 else 0)   # only rank 0 uses "b"
    out.sum().backward()
    opt.step()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=1.0)
    loss = sum(ref["a"](torch.ones(1, 3) * (r + 1)).sum() for r in range(N)) + \
        ref["b"](torch.ones(1, 3)).sum()
    (loss / N).backward()
    ref_opt.step()
    same_params(model, ref, "missing gradient reduced as zeros")
    opt.zero_grad(set_to_none=True)
    check(all(p.grad is None for p in model.parameters()), "set_to_none")
    model["a"](x).sum().backward()
    raises(AssertionError, lambda: opt.zero_grad(), "zero_grad with pending allreduces")
    opt.step()


def case_synchronize_warns_once():
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            x, y = batch(R, step)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.synchronize()
            opt.step()
        count = sum("skip_synchronize" in str(w.message) for w in caught)
        check(count == 1, f"step() after synchronize() warned {count} times, want 1")
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.synchronize()
        with opt.skip_synchronize():
            opt.step()
        check(sum("skip_synchronize" in str(w.message) for w in caught) == 1, "skip warned")


def case_grad_scaler():
    model, ref = make_model(), make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    scaler, ref_scaler = torch.amp.GradScaler("cpu", init_scale=1024.0), \
        torch.amp.GradScaler("cpu", init_scale=1024.0)
    for step in range(3):
        x, y = batch(R, step)
        opt.zero_grad()
        scaler.scale(F.cross_entropy(model(x), y)).backward()
        opt.synchronize()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
        fx, fy = full_batch(step)
        ref_opt.zero_grad()
        ref_scaler.scale(F.cross_entropy(ref(fx), fy)).backward()
        ref_scaler.unscale_(ref_opt)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_scaler.step(ref_opt)
        ref_scaler.update()
    same_params(model, ref, "GradScaler pattern")


def case_name_errors():
    model = make_model()
    named = list(model.named_parameters())
    dup = [("w", p) for _, p in named]
    raises(ValueError, lambda: hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1),
                                                        named_parameters=dup), "duplicates",
           match="w")
    raises(ValueError, lambda: hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1),
                                                        named_parameters=named[:2]), "partial")
    raises(ValueError, lambda: hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1),
                                                        named_parameters=[p for _, p in named]),
           "not tuples")
    raises(ValueError, lambda: hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1),
                                                        backward_passes_per_step=0), "bpps 0")


def case_broadcast_state():
    model = make_model(seed=R)                        # different on every rank
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    same_params(model, make_model(seed=0), "broadcast_parameters(state_dict)")
    model2 = make_model(seed=R + 5)
    hvd.broadcast_parameters(list(model2.named_parameters()), root_rank=N - 1)
    same_params(model2, make_model(seed=N - 1 + 5), "broadcast_parameters(named)")
    # fresh optimizer, before the first step
    opt = torch.optim.Adam(model.parameters(), lr=0.001 * (R + 1))
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    check(len(opt.state) == 4 and opt.param_groups[0]["lr"] == 0.001, "fresh Adam broadcast")
    # after a step on rank-specific data, with options and scalar state that differ
    x, y = batch(R, 0)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    opt.param_groups[0]["lr"] = 0.5 if R == 0 else 7
    opt.param_groups[0]["betas"] = (0.8, 0.9) if R == 0 else (0.1, 0.2)
    first = next(iter(model.parameters()))
    opt.state[first]["custom"] = 3 if R == 0 else 4.0
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    want = [hvd.broadcast(opt.state[p]["exp_avg"], 0) for p in model.parameters()]
    for p, w in zip(model.parameters(), want):
        close(opt.state[p]["exp_avg"], w, "exp_avg equal to root's")
    lr, betas, custom = opt.param_groups[0]["lr"], opt.param_groups[0]["betas"], \
        opt.state[first]["custom"]
    check(lr == 0.5 and type(lr) is float, f"lr {lr!r}")
    check(betas == (0.8, 0.9) and type(betas) is tuple, f"betas {betas!r}")
    check(custom == 3 and type(custom) is int, f"scalar state {custom!r}")
    close(opt.state[first]["step"], torch.tensor(2.0), "step (init step + 1)")
    # a DistributedOptimizer before its first step: no allreduce, state created
    model3 = make_model()
    dopt = hvd.DistributedOptimizer(torch.optim.Adam(model3.parameters()),
                                    named_parameters=model3.named_parameters())
    hvd.broadcast_optimizer_state(dopt, root_rank=0)
    check(len(dopt.state) == 4, "DistributedOptimizer state initialised")


class _SumLast(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(-1)


def case_state_dict_roundtrip():
    comp = hvd.Compression.topk(0.5)
    torch.manual_seed(0)   # one parameter (one bucket per step) above LCC_MIN_COMPRESS_BYTES
    model = nn.Sequential(nn.Linear(6, 2000, bias=False), nn.Unflatten(1, (4, 500)),
                          nn.Flatten(0, 0), _SumLast())
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters(), compression=comp)
    for step in range(2):
        x, y = batch(R, step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    check("lightcc_compression" in saved, "compressor state saved")
    snapshot = copy.deepcopy(model.state_dict())
    x, y = batch(R, 5)

    def one_step(m, o):
        o.zero_grad()
        F.cross_entropy(m(x), y).backward()
        o.step()
        return [p.detach().clone() for p in m.parameters()]

    after = one_step(model, opt)
    model.load_state_dict(snapshot)
    opt.load_state_dict(saved)
    again = one_step(model, opt)
    for a, b in zip(after, again):
        close(a, b, "state_dict round trip continues identically", atol=1e-6)


def case_compression_and_custom():
    train_pair(lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
               dist_kwargs={"compression": hvd.Compression.fp16}, atol=2e-3)

    class HalfCompressor:          # Horovod-style: compress/decompress per tensor
        calls = 0

        @staticmethod
        def compress(t):
            HalfCompressor.calls += 1
            return t.to(torch.float16), t.dtype

        @staticmethod
        def decompress(t, ctx):
            return t.to(ctx)

    train_pair(lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
               dist_kwargs={"compression": HalfCompressor}, atol=2e-3)
    check(HalfCompressor.calls > 0, "custom compressor used")


def case_sparse():
    for as_dense in (False, True):
        torch.manual_seed(0)
        emb = nn.Embedding(10, 3, sparse=True)
        ref = copy.deepcopy(emb)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.5),
                                       named_parameters=emb.named_parameters(),
                                       sparse_as_dense=as_dense)
        idx = [torch.tensor([r, r + 1, 7]) for r in range(N)]
        opt.zero_grad()
        emb(idx[R]).sum().backward()
        opt.step()
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
        (sum(ref(i).sum() for i in idx) / N).backward()
        ref_opt.step()
        close(emb.weight, ref.weight, f"sparse embedding (as_dense={as_dense})")


def case_dropped_optimizer_is_freed_and_a_new_one_trains_alone():
    """A DistributedOptimizer the script drops is freed, and a new one on the same model is the
    only one that reduces (torch keeps gradient hooks where Python's collector cannot see the
    cycle through them: a hook holding the optimizer kept every dropped one alive, reducing)."""
    model, ref = make_model(), make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)

    def step(opt, k):
        x, y = batch(R, k)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        fx, fy = full_batch(k)
        ref_opt.zero_grad()
        F.cross_entropy(ref(fx), fy).backward()
        ref_opt.step()

    first = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters())
    step(first, 0)
    gone = weakref.ref(first)
    del first
    gc.collect()
    check(gone() is None, "a dropped DistributedOptimizer is still alive")
    second = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      named_parameters=model.named_parameters())
    for k in (1, 2):
        step(second, k)
    same_params(model, ref, "a second optimizer on the same model")


def case_sync_batch_norm():
    sizes = [3 + 2 * r for r in range(N)]
    xs = [torch.randn(n, 4, 3, 2, generator=torch.Generator().manual_seed(r)) * (r + 1) + r
          for r, n in enumerate(sizes)]
    sbn, bn = hvd.SyncBatchNorm(4, momentum=0.3), nn.BatchNorm2d(4, momentum=0.3)
    with torch.no_grad():
        for m in (sbn, bn):
            m.weight.copy_(torch.linspace(0.5, 2, 4))
            m.bias.copy_(torch.linspace(-1, 1, 4))
    x = xs[R].clone().requires_grad_()
    w = torch.linspace(-1, 1, x.numel()).reshape(x.shape)
    out = sbn(x)
    (out * w).sum().backward()
    full = torch.cat(xs).requires_grad_()
    ref_out = bn(full)
    start = sum(sizes[:R])
    ws = torch.cat([torch.linspace(-1, 1, xi.numel()).reshape(xi.shape) for xi in xs])
    (ref_out * ws).sum().backward()
    close(out, ref_out[start:start + sizes[R]], "SyncBatchNorm forward", atol=1e-5)
    close(x.grad, full.grad[start:start + sizes[R]], "SyncBatchNorm input grad", atol=1e-5)
    close(sbn.running_mean, bn.running_mean, "running_mean")
    close(sbn.running_var, bn.running_var, "running_var", atol=1e-5)
    wg = hvd.allreduce(sbn.weight.grad, op=hvd.Sum, name="sbn.wg")
    close(wg, bn.weight.grad, "weight grad (summed over ranks)", atol=1e-4)
    sbn.eval()
    bn.eval()
    close(sbn(xs[R]), bn(xs[R]), "eval mode uses running stats")


if __name__ == "__main__":
    run([case_init, case_sgd_and_adam_match_full_batch, case_lr_scheduler,
         case_explicit_groups_and_sum, case_backward_passes_per_step,
         case_second_pass_with_one_pass_per_step,
         case_unused_parameter_and_zero_grad, case_synchronize_warns_once, case_grad_scaler,
         case_name_errors, case_broadcast_state, case_state_dict_roundtrip,
         case_compression_and_custom, case_sparse,
         case_dropped_optimizer_is_freed_and_a_new_one_trains_alone, case_sync_batch_norm])
