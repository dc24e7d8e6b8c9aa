"""torch.compile on the "lightcc" backend against the same programs on gloo (mpirun -np 2 or 3).

The default group is gloo; ``new_group(backend="lightcc")`` over every rank gives the lightcc
group, so each case runs the same compiled program once per backend, from the same start and
on the same per-rank data, and the results must agree (gloo is the reference). The functional
collectives (``torch.distributed._functional_collectives``, the ``_c10d_functional`` ops that
DTensor, FSDP2 and compiled autograd use) are checked against torch ops on every rank's
inputs, eagerly and inside a compiled function.

Before the backend kept Dynamo out of its Python methods (c10d/untraced.py), compiled DDP
died in ``_pre_forward`` with "Attempted to access unregistered member on an OpaqueObject"
and so did eager collectives after a graph break (cases ddp and graph_break).
"""
from __future__ import annotations

import torch
import torch._dynamo
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import lightcc.torch  # noqa: F401 - registers the backend
from common import check, close, rank_input, run

R = N = 0
LCC = None
STEPS = 4


class Net(nn.Module):
    """A small MLP with a BatchNorm (DDP broadcasts its buffers before every forward)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(12, 32)
        self.bn = nn.BatchNorm1d(32)
        self.b = nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.bn(self.a(x))))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 12, generator=g), torch.randn(8, 3, generator=g)


def train(model: nn.Module, params: list, steps: int = STEPS) -> None:
    step_fn = torch.compile(model)
    opt = torch.optim.Adam(params, lr=1e-2)
    for step in range(steps):
        x, y = batch(step, R)
        opt.zero_grad()
        ((step_fn(x) - y) ** 2).mean().backward()
        opt.step()


def ddp_params(group) -> list[torch.Tensor]:
    torch._dynamo.reset()
    model = DDP(Net(), process_group=group)
    train(model, list(model.parameters()))
    return [t.detach().clone() for t in [*model.parameters(), *model.buffers()]]


def agree(got: list[torch.Tensor], ref: list[torch.Tensor], what: str,
          tol: float = 1e-6) -> None:
    check(len(got) == len(ref), f"{what}: {len(got)} tensors, gloo has {len(ref)}")
    for i, (a, b) in enumerate(zip(got, ref)):
        close(a, b, f"{what} tensor {i}", atol=tol, rtol=tol)


def case_init():
    global R, N, LCC
    dist.init_process_group("gloo")
    R, N = dist.get_rank(), dist.get_world_size()
    LCC = dist.new_group(backend="lightcc")
    check(dist.get_backend(LCC) == "lightcc", "lightcc group")


def case_compiled_ddp_matches_gloo():
    ref = ddp_params(None)
    got = ddp_params(LCC)
    agree(got, ref, "compiled DDP")
    start = [t.detach() for t in [*Net().parameters()]]
    check(any(not torch.equal(a, b) for a, b in zip(got, start)), "compiled DDP: no update")


def case_compiled_autograd_python_reducer():
    """DDP under compiled autograd: the reducer is Python and reduces gradients with the
    functional all_reduce inside the compiled backward."""
    with torch._dynamo.config.patch(optimize_ddp="python_reducer", compiled_autograd=True):
        ref = ddp_params(None)
        got = ddp_params(LCC)
    agree(got, ref, "compiled autograd DDP")


def case_compiled_fsdp2_matches_gloo():
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    def fsdp_params(group) -> list[torch.Tensor]:
        torch._dynamo.reset()
        mesh = DeviceMesh.from_group(group or dist.group.WORLD, "cpu")
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 24), nn.ReLU(),
                              nn.Linear(24, 3))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        train(model, list(model.parameters()))
        shard = next(iter(model.parameters())).to_local()
        check(shard.shape[0] < 24, f"FSDP2 parameters are sharded: {tuple(shard.shape)}")
        return [p.full_tensor().detach().clone() for p in model.parameters()]

    agree(fsdp_params(LCC), fsdp_params(None), "compiled FSDP2", tol=1e-5)


def case_eager_collectives_after_a_graph_break():
    """dist.* calls that a compiled function runs eagerly (after a graph break) reach the
    backend's Python methods with Dynamo's frame hook active."""
    torch._dynamo.reset()

    @torch.compile
    def f(x: torch.Tensor, group) -> torch.Tensor:
        x = x * 2
        dist.all_reduce(x, group=group)           # traced: becomes a functional all_reduce
        torch._dynamo.graph_break()
        outs = [torch.empty_like(x) for _ in range(N)]
        dist.all_gather(outs, x + 1, group=group, async_op=True).wait()
        dist.broadcast(x, 0, group=group)
        return torch.cat(outs + [x]).cos()

    xs = [rank_input(r, (5,), torch.float32, 7) for r in range(N)]
    total = sum(2 * x for x in xs)
    want = torch.cat([total + 1] * N + [total]).cos()
    close(f(xs[R].clone(), LCC), want, "compiled function with a graph break", atol=1e-5)


def _functional_checks(group, tag: int) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(what, got, want) for every functional collective, eagerly."""
    xs = [rank_input(r, (N * 4, 3), torch.float32, tag) for r in range(N)]
    x = xs[R]
    stacked = torch.stack(xs)
    summed = stacked.sum(0)
    rows = slice(R * 4, (R + 1) * 4)
    ys = [x * 3 for x in xs]
    wait = fc.wait_tensor
    out = [
        ("all_reduce sum", wait(fc.all_reduce(x, "sum", group)), summed),
        ("all_reduce avg", wait(fc.all_reduce(x, "avg", group)), summed / N),
        ("all_reduce max", wait(fc.all_reduce(x, "max", group)), stacked.max(0).values),
        ("all_gather_tensor", wait(fc.all_gather_tensor(x, 0, group)), torch.cat(xs)),
        ("reduce_scatter_tensor sum", wait(fc.reduce_scatter_tensor(x, "sum", 0, group)),
         summed[rows]),
        ("reduce_scatter_tensor avg", wait(fc.reduce_scatter_tensor(x, "avg", 0, group)),
         summed[rows] / N),
        ("all_to_all_single", wait(fc.all_to_all_single(x, None, None, group)),
         torch.cat([xs[r][rows] for r in range(N)])),
        ("broadcast", wait(fc.broadcast(x, N - 1, group)), xs[N - 1]),
    ]
    coal = fc.all_reduce_coalesced([x, x * 3], "sum", group)
    out += [("all_reduce_coalesced 0", wait(coal[0]), summed),
            ("all_reduce_coalesced 1", wait(coal[1]), sum(ys))]
    gathered = fc.all_gather_into_tensor_coalesced([x, x * 3], group)
    out += [("all_gather_into_tensor_coalesced 0", wait(gathered[0]), torch.cat(xs)),
            ("all_gather_into_tensor_coalesced 1", wait(gathered[1]), torch.cat(ys))]
    scattered = fc.reduce_scatter_tensor_coalesced([x, x * 3], "sum", [0, 0], group)
    out += [("reduce_scatter_tensor_coalesced 0", wait(scattered[0]), summed[rows]),
            ("reduce_scatter_tensor_coalesced 1", wait(scattered[1]), sum(ys)[rows])]
    ops = torch.ops._c10d_functional          # the ops themselves, by group name
    name = group.group_name
    out += [
        ("op all_reduce", ops.wait_tensor(ops.all_reduce(x, "sum", name)), summed),
        ("op all_gather_into_tensor",
         ops.wait_tensor(ops.all_gather_into_tensor(x, N, name)), torch.cat(xs)),
        ("op reduce_scatter_tensor",
         ops.wait_tensor(ops.reduce_scatter_tensor(x, "sum", N, name)), summed[rows]),
    ]
    return out


def case_functional_collectives():
    for what, got, want in _functional_checks(LCC, 3):
        close(got, want, f"functional {what}", atol=1e-5, rtol=1e-6)


def case_functional_collectives_compiled():
    torch._dynamo.reset()

    @torch.compile(fullgraph=True)
    def f(x: torch.Tensor, group) -> tuple[torch.Tensor, ...]:
        s = fc.all_reduce(x * 2, "sum", group)
        g = fc.all_gather_tensor(s + 1, 0, group)
        r = fc.reduce_scatter_tensor(g, "avg", 0, group)
        a = fc.all_reduce(x, "max", group)
        return s, g, r.sin(), a

    xs = [rank_input(r, (N * 2, 3), torch.float32, 5) for r in range(N)]
    total = sum(2 * x for x in xs)
    s, g, r, a = f(xs[R].clone(), LCC)
    close(s, total, "compiled all_reduce", atol=1e-5)
    close(g, torch.cat([total + 1] * N), "compiled all_gather_tensor", atol=1e-5)
    close(r, (total + 1).sin(), "compiled reduce_scatter_tensor avg", atol=1e-5)
    close(a, torch.stack(xs).max(0).values, "compiled all_reduce max")


run([case_init, case_functional_collectives, case_functional_collectives_compiled,
     case_eager_collectives_after_a_graph_break, case_compiled_ddp_matches_gloo,
     case_compiled_autograd_python_reducer, case_compiled_fsdp2_matches_gloo])
