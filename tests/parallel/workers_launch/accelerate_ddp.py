"""Hugging Face accelerate on the lightcc backend: the script calls
``init_process_group("lightcc")``, then ``Accelerator()`` takes the group as it is. One
prepared (DDP) step: the gradient equals the mean of every rank's own gradient, computed here
from all ranks' seeded inputs; ``accelerator.gather`` returns every rank's value."""
import torch
import torch.distributed as dist
from accelerate import Accelerator

import lightcc.torch  # noqa: F401 - registers the backend

dist.init_process_group("lightcc")
acc = Accelerator(cpu=True)
R, N = acc.process_index, acc.num_processes
assert (R, N) == (dist.get_rank(), dist.get_world_size()) and dist.get_backend() == "lightcc"
torch.manual_seed(0)
model = torch.nn.Linear(5, 3)
ref = torch.nn.Linear(5, 3)
ref.load_state_dict(model.state_dict())
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model, opt = acc.prepare(model, opt)
xs = [torch.randn(4, 5, generator=torch.Generator().manual_seed(r)) for r in range(N)]
acc.backward(model(xs[R]).pow(2).sum())
grads = []
for x in xs:
    ref.zero_grad()
    ref(x).pow(2).sum().backward()
    grads.append([p.grad.clone() for p in ref.parameters()])
for i, p in enumerate(model.parameters()):
    want = sum(g[i] for g in grads) / N
    assert torch.allclose(p.grad, want, atol=1e-5), (i, p.grad, want)
got = acc.gather(torch.tensor([float(R)]))
assert torch.equal(got, torch.arange(N, dtype=torch.float32)), got
print(f"rank {R}: accelerate ok", flush=True)
dist.destroy_process_group()
