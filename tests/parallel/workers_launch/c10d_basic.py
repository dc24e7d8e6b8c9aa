"""torch.distributed on the "lightcc" backend in a job started the torchrun way (no MPI):
every collective against a reference each rank builds from all ranks' seeded inputs, a
subgroup, send/recv, DDP gradients against the single-process mean, gloo side groups.
Prints "c10d ok" on success."""
import os
import warnings

import torch
import torch.distributed as dist

import lightcc
import lightcc.torch  # noqa: F401 - registers the backend

warnings.simplefilter("ignore", FutureWarning)
dist.init_process_group("lightcc")
R, N = dist.get_rank(), dist.get_world_size()
assert (R, N) == (int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", -1))),
                  int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", -1))))
assert dist.get_backend() == "lightcc" and lightcc.is_initialized()


def inp(rank, shape, dtype, tag=0):
    g = torch.Generator().manual_seed(1000 * tag + rank)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 4
    return x.to(dtype)


def close(got, want, what, tol=1e-6):
    assert torch.allclose(got.double(), want.double(), atol=tol, rtol=tol), \
        f"rank {R}: {what}: got {got.flatten()[:5]}, want {want.flatten()[:5]}"


# all_reduce: ops x dtypes, small and large (the two paths of the TCP allreduce)
for tag, (n, dtype, tol) in enumerate([(7, torch.float32, 1e-5), (100_000, torch.float32, 1e-4),
                                       (33, torch.float64, 1e-12), (9, torch.float16, 3e-3),
                                       (20_000, torch.bfloat16, 5e-2)]):
    every = torch.stack([inp(r, (n,), dtype, tag).double() for r in range(N)])
    for op, ref in ((dist.ReduceOp.SUM, every.sum(0)), (dist.ReduceOp.MAX, every.max(0).values),
                    (dist.ReduceOp.MIN, every.min(0).values), (dist.ReduceOp.AVG, every.mean(0))):
        t = inp(R, (n,), dtype, tag)
        dist.all_reduce(t, op=op)
        close(t, ref, f"all_reduce {op} {dtype} n={n}", tol * (1 + ref.abs().max().item()))
ints = torch.arange(12, dtype=torch.int64) * (R + 1)
dist.all_reduce(ints, op=dist.ReduceOp.PRODUCT)
want = torch.ones(12, dtype=torch.int64)
for r in range(N):
    want *= torch.arange(12, dtype=torch.int64) * (r + 1)
assert torch.equal(ints, want), ints

# all_gather, broadcast, reduce_scatter, all_to_all, barrier
outs = [torch.empty(5) for _ in range(N)]
dist.all_gather(outs, inp(R, (5,), torch.float32, 9))
for r in range(N):
    close(outs[r], inp(r, (5,), torch.float32, 9), "all_gather")
b = inp(R, (1000,), torch.float32, 10)
dist.broadcast(b, src=N - 1)
close(b, inp(N - 1, (1000,), torch.float32, 10), "broadcast")
rs = torch.empty(4)
dist.reduce_scatter_tensor(rs, inp(R, (4 * N,), torch.float32, 11))
full = sum(inp(r, (4 * N,), torch.float32, 11).double() for r in range(N))
close(rs, full[4 * R:4 * R + 4], "reduce_scatter", 1e-5)
a2a = torch.empty(3 * N)
dist.all_to_all_single(a2a, torch.arange(3 * N, dtype=torch.float32) + 100 * R)
want = torch.cat([torch.arange(3 * R, 3 * R + 3, dtype=torch.float32) + 100 * s
                  for s in range(N)])
assert torch.equal(a2a, want), a2a
dist.barrier()

# a subgroup of ranks 0 and 1, and point-to-point on the world
sub = dist.new_group([0, 1])
if R in (0, 1):
    t = torch.full((3,), float(R + 1))
    dist.all_reduce(t, group=sub)
    assert torch.equal(t, torch.full((3,), 3.0)), t
if R == 0:
    dist.send(torch.arange(6, dtype=torch.float32), dst=1, tag=7)
    got = torch.empty(2)
    dist.recv(got, src=1, tag=8)
    assert torch.equal(got, torch.tensor([5.0, 6.0])), got
elif R == 1:
    got = torch.empty(6)
    dist.recv(got, src=0, tag=7)
    assert torch.equal(got, torch.arange(6, dtype=torch.float32)), got
    dist.send(torch.tensor([5.0, 6.0]), dst=0, tag=8)

# DDP: the averaged gradient equals the mean of every rank's own gradient
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
ref_model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
ref_model.load_state_dict(model.state_dict())
ddp = torch.nn.parallel.DistributedDataParallel(model)
xs = [inp(r, (4, 8), torch.float32, 20) for r in range(N)]
ddp(xs[R]).pow(2).sum().backward()
grads = []
for r in range(N):
    ref_model.zero_grad()
    ref_model(xs[r]).pow(2).sum().backward()
    grads.append([p.grad.clone() for p in ref_model.parameters()])
for i, p in enumerate(model.parameters()):
    close(p.grad, sum(g[i] for g in grads) / N, f"DDP gradient {i}", 1e-5)

# a gloo side group beside the lightcc default group (torchtitan's checkpointer, vLLM)
side = dist.new_group(backend="gloo")
t = torch.ones(2) * R
dist.all_reduce(t, group=side)
assert torch.equal(t, torch.full((2,), float(sum(range(N))))), t
assert dist.get_backend(side) == "gloo", dist.get_backend(side)
pair = dist.new_group([0, 1], backend="gloo")
if R in (0, 1):
    t = torch.full((2,), float(R + 1))
    dist.all_reduce(t, group=pair)
    assert torch.equal(t, torch.full((2,), 3.0)), t
else:
    assert pair == dist.GroupMember.NON_GROUP_MEMBER, pair

assert lightcc.common.api.transport() == "tcp"
assert not lightcc.torch.mpi_enabled() and not lightcc.torch.mpi_threads_supported()
dist.destroy_process_group()
print(f"rank {R}: c10d ok", flush=True)
