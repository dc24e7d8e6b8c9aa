"""DDP on the "lightcc" backend against DDP on gloo, in one job (mpirun -np 2 or 3).

The default group is gloo (initialized with no argument but the backend: MPI rendezvous);
``new_group(backend="lightcc")`` over every rank gives the lightcc group. Each case trains the
same model twice from the same start, on the same per-rank data, once per backend, and the
parameters must agree within 1e-6. Then torch's own comm hooks run on the lightcc group,
and torch's PowerSGD hook runs 50 steps (callbacks that issue collectives) on both groups;
lightcc's TopK hook on gloo is checked against TopK with error feedback simulated per
parameter in one process (workers_compression/sim.py).
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.nn.parallel import DistributedDataParallel as DDP

import lightcc.torch  # noqa: F401 - registers the backend
from common import check, close, run

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workers_compression"))
import sim  # noqa: E402

R = N = 0
LCC = None
STEPS = 6


class Net(nn.Module):
    """An MLP with a branch that is only used on even steps (find_unused_parameters)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(12, 32)
        self.b = nn.Linear(32, 32)
        self.side = nn.Linear(32, 32)
        self.head = nn.Linear(32, 3)
        self.register_buffer("calls", torch.zeros(1))

    def forward(self, x: torch.Tensor, use_side: bool = True) -> torch.Tensor:
        self.calls += 1
        h = torch.relu(self.b(torch.relu(self.a(x))))
        if use_side:
            h = h + torch.tanh(self.side(h))
        return self.head(h)


def batches(step: int, rank: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + (R if rank is None else rank))
    return torch.randn(8, 12, generator=g), torch.randn(8, 3, generator=g)


def train(group, opt_name: str, steps: int = STEPS, accumulate: int = 1, hook=None,
          hook_state=None, skip_side: bool = False, **ddp_kw) -> list[torch.Tensor]:
    model = DDP(Net(), process_group=group, bucket_cap_mb=0.002, **ddp_kw)
    if hook is not None:
        model.register_comm_hook(hook_state, hook)
    opt = (torch.optim.Adam(model.parameters(), lr=1e-2) if opt_name == "adam"
           else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    for step in range(steps):
        opt.zero_grad()
        for micro in range(accumulate):
            x, y = batches(step * accumulate + micro)
            use_side = not (skip_side and step % 2)
            if micro < accumulate - 1:
                with model.no_sync():
                    ((model(x, use_side) - y) ** 2).mean().backward()
            else:
                ((model(x, use_side) - y) ** 2).mean().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def same_everywhere(params: list[torch.Tensor], what: str) -> None:
    flat = torch.cat([p.reshape(-1) for p in params])
    outs = [torch.empty_like(flat) for _ in range(N)]
    dist.all_gather(outs, flat)                 # on gloo, the default group
    check(all(torch.equal(outs[0], o) for o in outs), f"{what}: ranks differ")


def compare(what: str, **kw) -> None:
    ref = train(None, **kw)
    got = train(LCC, **kw)
    for i, (a, b) in enumerate(zip(got, ref)):
        close(a, b, f"{what} param {i}", atol=1e-6, rtol=1e-5)
    same_everywhere(got, what)


def case_init():
    global R, N, LCC
    dist.init_process_group("gloo")
    R, N = dist.get_rank(), dist.get_world_size()
    LCC = dist.new_group(backend="lightcc")
    check(dist.get_backend(LCC) == "lightcc" and LCC.size() == N, "lightcc group")


def case_sgd():
    compare("sgd", opt_name="sgd")


def case_adam():
    compare("adam", opt_name="adam")


def case_find_unused_parameters():
    compare("find_unused_parameters", opt_name="sgd", skip_side=True,
            find_unused_parameters=True)


def case_static_graph():
    compare("static_graph", opt_name="adam", static_graph=True)


def case_no_sync_accumulation():
    compare("no_sync", opt_name="sgd", accumulate=3)


def case_torch_hooks():
    compare("allreduce_hook", opt_name="sgd", hook=default_hooks.allreduce_hook)
    ref = train(None, "sgd", hook=default_hooks.fp16_compress_hook)
    got = train(LCC, "sgd", hook=default_hooks.fp16_compress_hook, hook_state=LCC)
    for i, (a, b) in enumerate(zip(got, ref)):
        close(a, b, f"fp16_compress_hook param {i}", atol=1e-3, rtol=1e-3)
    same_everywhere(got, "fp16_compress_hook")


def case_lightcc_hooks_on_gloo():
    """lightcc's hooks on DDP over gloo: lightcc reduces the buckets beside gloo."""
    from lightcc.torch import ddp_hooks

    ref = train(None, "sgd", hook=default_hooks.fp16_compress_hook)
    got = train(None, "sgd", hook=ddp_hooks.fp16_hook,
                hook_state=ddp_hooks.HookState(ddp_hooks.Compression.fp16))
    for i, (a, b) in enumerate(zip(got, ref)):
        close(a, b, f"lightcc fp16_hook on gloo param {i}", atol=1e-3, rtol=1e-3)
    same_everywhere(got, "lightcc fp16_hook on gloo")
    got = train(None, "sgd", hook=ddp_hooks.topk_hook,
                hook_state=ddp_hooks.HookState(ddp_hooks.Compression.topk(0.05)))
    for i, (a, b) in enumerate(zip(got, topk_reference(0.05))):
        close(a, b, f"lightcc topk_hook on gloo param {i}", atol=1e-6, rtol=1e-5)
    same_everywhere(got, "lightcc topk_hook on gloo")


def topk_reference(ratio: float, steps: int = STEPS) -> list[torch.Tensor]:
    """``train(None, "sgd")`` with TopK and error feedback per parameter, in one process: every
    rank's gradient computed here, each parameter of 4096 bytes or more (lightcc's default
    LCC_MIN_COMPRESS_BYTES) reduced by sim.topk_step with that rank's residual, the others
    summed exactly; the sum times 1/N (float32), SGD with momentum as in train()."""
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    params = list(model.parameters())
    residuals: dict[int, list[np.ndarray]] = {}
    for step in range(steps):
        grads = []
        for rank in range(N):
            model.zero_grad()
            x, y = batches(step, rank)
            ((model(x) - y) ** 2).mean().backward()
            grads.append([p.grad.numpy().reshape(-1).copy() for p in params])
        for i, p in enumerate(params):
            ins = [g[i] for g in grads]
            if 4 * p.numel() >= 4096:
                total, residuals[i], _ = sim.topk_step(ins, residuals.get(i), ratio)
            else:
                total = ins[0]
                for g in ins[1:]:
                    total = (total + g).astype(np.float32)
            avg = (total * np.float32(1.0 / N)).astype(np.float32)
            p.grad = torch.from_numpy(avg.reshape(p.shape))
        opt.step()
    return [p.detach().clone() for p in params]


class _Done:
    """What ``dist.all_reduce(..., async_op=True)`` returns, already completed."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.fut = torch.futures.Future()
        self.fut.set_result([tensor])

    def get_future(self) -> torch.futures.Future:
        return self.fut

    def wait(self, timeout=None) -> bool:
        return True


def gloo_blocking(fn):
    """Run ``fn`` with torch.distributed.all_reduce blocking on gloo, in the calling thread.

    torch's PowerSGD hook waits on an allreduce inside a future's callback, and over gloo
    those callbacks run on gloo's worker threads: the hook hung on gloo (torch 2.13, with 2 or
    8 threads per group). Blocking calls in the hook's own thread do the same arithmetic in
    the same order."""
    real = dist.all_reduce

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        real(tensor, op=op, group=group)
        return _Done(tensor) if async_op else None

    dist.all_reduce = all_reduce
    try:
        return fn()
    finally:
        dist.all_reduce = real


def case_powersgd_50_steps():
    """torch's PowerSGD hook on the lightcc group against the same hook on gloo."""
    def state(group):
        return psgd.PowerSGDState(process_group=group, matrix_approximation_rank=2,
                                  start_powerSGD_iter=3, min_compression_rate=0.5,
                                  use_error_feedback=True, warm_start=True)

    got = train(LCC, "sgd", steps=50, hook=psgd.powerSGD_hook, hook_state=state(LCC))
    check(all(torch.isfinite(p).all() for p in got), "powerSGD: non-finite parameters")
    ref = gloo_blocking(lambda: train(None, "sgd", steps=50, hook=psgd.powerSGD_hook,
                                      hook_state=state(None)))
    for i, (a, b) in enumerate(zip(got, ref)):
        close(a, b, f"powerSGD_hook on lightcc vs gloo param {i}", atol=1e-5, rtol=1e-4)
    same_everywhere(got, "powerSGD_hook")
    # (torch 2.13's batched_powerSGD_hook fails its own _orthogonalize assertion on any
    # backend: it passes a 2-D matrix where a batch of matrices is expected)


cases = [case_init, case_sgd, case_adam, case_find_unused_parameters, case_static_graph,
         case_no_sync_accumulation, case_torch_hooks, case_lightcc_hooks_on_gloo,
         case_powersgd_50_steps]
if sys.argv[1:] == ["powersgd"]:
    cases = [case_init, case_powersgd_50_steps]
run(cases)
