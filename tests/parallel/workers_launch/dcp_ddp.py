"""torch.distributed.checkpoint on a DDP model: ``dcp.save``, ``dcp.async_save`` and
``dcp.load`` on the backend ``argv[1]`` into a checkpoint folder ``argv[2]``; the loaded
state must equal what was saved (a model initialised differently loads it). Prints "dcp ok"."""
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import lightcc.torch  # noqa: F401 - registers the backend

backend, folder = sys.argv[1], sys.argv[2]
dist.init_process_group(backend)
R = dist.get_rank()
torch.manual_seed(0)
ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
    torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)))
opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
for step in range(2):
    opt.zero_grad()
    ddp(torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * R + step))).sum().backward()
    opt.step()
saved = {k: v.detach().clone() for k, v in ddp.state_dict().items()}
dcp.save({"model": ddp.state_dict()}, checkpoint_id=f"{folder}/sync")
dcp.async_save({"model": ddp.state_dict()}, checkpoint_id=f"{folder}/async").result()
for kind in ("sync", "async"):
    with torch.no_grad():
        for p in ddp.parameters():
            p.fill_(-7.0)
    state = {"model": ddp.state_dict()}
    dcp.load(state, checkpoint_id=f"{folder}/{kind}")
    ddp.load_state_dict(state["model"])
    for k, v in ddp.state_dict().items():
        assert torch.equal(v, saved[k]), (kind, k)
dist.barrier()
print(f"rank {R}: dcp ok on {dist.get_backend()}", flush=True)
dist.destroy_process_group()
