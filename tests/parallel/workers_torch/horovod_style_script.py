"""A training script written for Horovod (horovod.torch 0.28 API only); the import below is
the only line changed for the port. Run it on 3 ranks; every rank prints one ``RESULT`` line
that tests/parallel/test_torch_horovod_script.py compares with values it derives itself from
Horovod's documented semantics.

What it uses, the way a Horovod user writes it: static process sets passed to ``hvd.init``,
``broadcast_parameters`` / ``broadcast_optimizer_state`` / ``broadcast_`` / ``broadcast_object``
with global root ranks (also inside a process set), allgather-based training (the loss is
computed on every rank's gathered outputs, CLIP-style), a differentiable ``broadcast`` in the
graph, and two user-written compressors (a float16 cast subclassing Horovod's ``Compressor``,
and a 16-bit fixed-point one written from scratch) given to ``DistributedOptimizer``.
"""
import json

import torch

import lightcc.torch as hvd  # was: import horovod.torch as hvd

STEPS = 3
LR = 0.05


class HalfPrecision(hvd.compression.Compressor):
    """Float tensors travel as float16."""

    @staticmethod
    def compress(tensor):
        return tensor.to(torch.float16), tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        return tensor.to(ctx)


class FixedPoint16:
    """16-bit fixed point with 8 fractional bits (integers on the wire: averaged by Horovod
    with truncation toward zero)."""

    @staticmethod
    def compress(tensor):
        return torch.round(tensor * 256).to(torch.int16), tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        return tensor.to(ctx) / 256


def batch(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 3, generator=g)


def targets(step, size):
    g = torch.Generator().manual_seed(9999 + step)
    return torch.randn(4 * size, 2, generator=g)


def batch2(rank, step):
    g = torch.Generator().manual_seed(500 + 10 * step + rank)
    return torch.randn(3, 2, generator=g)


even_set = hvd.ProcessSet([0, 2])
odd_set = hvd.ProcessSet([1])
hvd.init(process_sets=[even_set, odd_set])
rank, size = hvd.rank(), hvd.size()
assert size == 3, "run on 3 ranks"

# ---- part 1: allgather-based training on every rank, fp16 user compressor -----------------
torch.manual_seed(1000 + rank)                 # different on purpose: rank 0's wins below
net = torch.nn.Linear(3, 2)
scale = torch.nn.Parameter(torch.ones(1) * (1 + rank))
hvd.broadcast_parameters(net.state_dict(), root_rank=0)
hvd.broadcast_parameters([("scale", scale)], root_rank=0)
opt = torch.optim.SGD(list(net.parameters()) + [scale], lr=LR * (1 + rank), momentum=0.9)
hvd.broadcast_optimizer_state(opt, root_rank=0)    # rank 0's lr and momentum buffers
opt = hvd.DistributedOptimizer(opt, named_parameters=list(net.named_parameters())
                               + [("scale", scale)], compression=HalfPrecision)
for step in range(STEPS):
    opt.zero_grad()
    z = net(batch(rank, step))                       # this rank's 4 rows
    everyone = hvd.allgather(z)                      # all ranks' rows, differentiable
    s = hvd.broadcast(scale, root_rank=1)            # rank 1's scale, differentiable
    loss = (1 + rank) * ((everyone * s - targets(step, size)) ** 2).mean() \
        + 0.1 * (z ** 2).mean()
    loss.backward()
    opt.step()

# ---- part 2: inside process sets (global root ranks), 16-bit user compressor -------------
this_set = even_set if rank in even_set.ranks else odd_set
root = max(this_set.ranks)                           # global rank 2 in {0, 2}, 1 in {1}
w = torch.full((2,), float(rank))
hvd.broadcast_(w, root_rank=root, process_set=this_set)
info = hvd.broadcast_object({"from": rank}, root_rank=root, process_set=this_set)
total = hvd.allreduce(torch.tensor([float(rank + 1)]), op=hvd.Sum, process_set=this_set)
torch.manual_seed(2000 + rank)
model2 = torch.nn.Linear(2, 1)
for p in model2.parameters():
    hvd.broadcast_(p.data, root_rank=root, process_set=this_set)
opt2 = hvd.DistributedOptimizer(torch.optim.SGD(model2.parameters(), lr=0.1),
                                named_parameters=[("m2." + n, p)
                                                  for n, p in model2.named_parameters()],
                                compression=FixedPoint16, process_set=this_set)
for step in range(2):
    opt2.zero_grad()
    out = hvd.allgather(model2(batch2(rank, step)), process_set=this_set)
    ((1 + rank) * ((out - 0.5) ** 2).mean()).backward()
    opt2.step()

hvd.barrier()                 # shutdown is global: wait until every rank is done training
print("RESULT " + json.dumps({
    "rank": rank,
    "weight": net.weight.tolist(), "bias": net.bias.tolist(), "scale": scale.item(),
    "lr": opt.param_groups[0]["lr"], "w": w.tolist(), "info": info, "total": total.item(),
    "m2.weight": model2.weight.tolist(), "m2.bias": model2.bias.tolist(),
}), flush=True)
hvd.shutdown()
