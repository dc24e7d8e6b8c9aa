"""FSDP1 and FSDP2 (``fully_shard``) on the "lightcc" backend against one process training the
same model on the whole global batch (mpirun -np 2 or 3; 3 ranks shard unevenly)."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

import lightcc.torch  # noqa: F401 - registers the backend
from common import check, close, run

R = N = 0
STEPS = 3
LOCAL = 4


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 24), nn.ReLU(), nn.Linear(24, 24), nn.ReLU(),
                         nn.Linear(24, 5))


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(N * LOCAL, 10, generator=g), torch.randn(N * LOCAL, 5, generator=g)


def reference() -> list[torch.Tensor]:
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        x, y = global_batch(step)
        opt.zero_grad()
        ((m(x) - y) ** 2).mean().backward()
        opt.step()
    return [p.detach() for p in m.parameters()]


def train_sharded(m: nn.Module) -> None:
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    mine = slice(R * LOCAL, (R + 1) * LOCAL)
    for step in range(STEPS):
        x, y = global_batch(step)
        opt.zero_grad()
        ((m(x[mine]) - y[mine]) ** 2).mean().backward()
        opt.step()


def case_init():
    global R, N
    dist.init_process_group("lightcc")
    R, N = dist.get_rank(), dist.get_world_size()


def case_fsdp1():
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    m = FSDP(model(), device_id=torch.device("cpu"), use_orig_params=True)
    train_sharded(m)
    with FSDP.summon_full_params(m):
        got = [p.detach().clone() for p in m.parameters()]
    for i, (a, b) in enumerate(zip(got, reference())):
        close(a, b, f"FSDP1 param {i}", atol=1e-5, rtol=1e-5)


def case_fsdp2():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (N,))
    m = model()
    for layer in m:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    train_sharded(m)
    got = [p.full_tensor().detach() for p in m.parameters()]
    for i, (a, b) in enumerate(zip(got, reference())):
        close(a, b, f"FSDP2 param {i}", atol=1e-5, rtol=1e-5)
    shard = next(iter(m.parameters())).to_local()
    check(shard.shape[0] < 24, f"FSDP2 parameters are sharded: {tuple(shard.shape)}")


run([case_init, case_fsdp1, case_fsdp2])
