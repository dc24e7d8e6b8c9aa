"""Rank 1 raises in the middle of backward at step 2 (some reductions started, the rest never
will); rank 0 goes on into step() and the next forward, whose pre-hooks wait for them. The
job must end with rank 1's error, not hang."""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

import lightcc.torch as hvd

XBAR = os.environ.get("XBAR", "1") == "1"
hvd.init()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                      nn.Linear(16, 4))
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                               named_parameters=model.named_parameters(), cross_barrier=XBAR,
                               model=model if XBAR else None)


def boom(grad: torch.Tensor) -> torch.Tensor:
    if hvd.rank() == 1 and step == 2:
        raise RuntimeError("rank 1 fails in the middle of backward")
    return grad


model[2].weight.register_hook(boom)
for step in range(6):
    opt.zero_grad()
    x, y = torch.randn(5, 6), torch.randint(0, 4, (5,))
    F.cross_entropy(model(x), y).backward()
    opt.step()
opt.synchronize()
print(f"[rank {hvd.rank()}] finished without error", flush=True)
