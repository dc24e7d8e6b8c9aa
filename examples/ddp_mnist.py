"""Plain DistributedDataParallel on MNIST, torchrun style: only the backend string says lightcc.

    lccrun -np 2 python examples/ddp_mnist.py                     # backend "lightcc"
    lccrun -np 2 python examples/ddp_mnist.py --comm-hook topk    # lightcc's TopK DDP hook
    lccrun -np 2 python examples/ddp_mnist.py --backend gloo      # the same script on gloo
    torchrun --nproc-per-node 2 examples/ddp_mnist.py                  # lightcc, no MPI
    torchrun --nproc-per-node 2 examples/ddp_mnist.py --backend gloo

``init_process_group`` finds its peers through torch's environment variables (lccrun exports
RANK, WORLD_SIZE, MASTER_ADDR, ... as torchrun does; under a bare ``mpirun`` the lightcc
backend asks MPI). The script shards with DistributedSampler and trains the CNN of
examples/mnist.py on its
data (MNIST IDX files, else scikit-learn's 8x8 digits). ``--comm-hook`` picks a DDP
communication hook: lightcc's (fp16, bf16, fp8, fp8_e5m2, topk, powersgd: lightcc's compressed
allreduce, on any backend) or torch's (torch-allreduce, torch-fp16, torch-powersgd).
Rank 0 prints one line per epoch: loss, test accuracy, seconds, samples/s over all ranks.
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

import lightcc.torch  # noqa: F401 - registers the torch.distributed backend "lightcc"
from lightcc.torch import ddp_hooks
from mnist import Net, load_data

TORCH_HOOKS = {"torch-allreduce": default_hooks.allreduce_hook,
               "torch-fp16": default_hooks.fp16_compress_hook}


def register_hook(model: DDP, name: str) -> None:
    if name == "none":
        return
    if name in TORCH_HOOKS:
        model.register_comm_hook(None, TORCH_HOOKS[name])
    elif name == "torch-powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=2,
                                            start_powerSGD_iter=10)
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif name in ddp_hooks.HOOKS:
        ddp_hooks.register(model, name)
    else:
        raise SystemExit(f"unknown --comm-hook {name!r}; choose from none, "
                         f"{', '.join([*ddp_hooks.HOOKS, *TORCH_HOOKS, 'torch-powersgd'])}")


def evaluate(model: torch.nn.Module, loader: DataLoader) -> float:
    """Test accuracy over all ranks' shards."""
    model.eval()
    counts = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for x, y in loader:
            counts += torch.tensor([(model(x).argmax(1) == y).sum().item(), len(y)],
                                   dtype=torch.float64)
    dist.all_reduce(counts)
    return float(counts[0] / counts[1])


def main() -> None:
    parser = argparse.ArgumentParser(description="MNIST CNN with DistributedDataParallel")
    parser.add_argument("--backend", default="lightcc", help="lightcc (default), gloo, ...")
    parser.add_argument("--comm-hook", default="none", help="none, fp16, bf16, fp8, fp8_e5m2, "
                        "topk, powersgd, torch-allreduce, torch-fp16, torch-powersgd")
    parser.add_argument("--data-dir", default="~/.cache/lightcc/mnist")
    parser.add_argument("--download", action="store_true", help="fetch MNIST if missing")
    parser.add_argument("--epochs", type=int, default=0, help="default: 8 digits / 3 MNIST")
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05, help="per rank; scaled by size")
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()

    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) //
                              int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    train, test, description = load_data(args, rank=rank, barrier=dist.barrier)
    side = train.tensors[0].shape[-1]
    epochs = args.epochs or (8 if side < 16 else 3)
    if rank == 0:
        print(f"{description}; backend {dist.get_backend()}, comm hook {args.comm_hook}",
              flush=True)
    sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True,
                                 seed=args.seed)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler)
    test_loader = DataLoader(test, batch_size=500, sampler=DistributedSampler(
        test, num_replicas=world, rank=rank, shuffle=False))
    model = DDP(Net(side))                      # broadcasts rank 0's parameters
    register_hook(model, args.comm_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * world, momentum=0.9)
    for epoch in range(1, epochs + 1):
        t0 = time.perf_counter()
        model.train()
        sampler.set_epoch(epoch)
        sums = torch.zeros(2, dtype=torch.float64)
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            sums += torch.tensor([loss.item() * len(y), len(y)], dtype=torch.float64)
        dist.all_reduce(sums)
        seconds = time.perf_counter() - t0
        accuracy = evaluate(model, test_loader)
        if rank == 0:
            print(f"epoch {epoch}/{epochs}  loss {float(sums[0] / sums[1]):.4f}  "
                  f"test accuracy {100 * accuracy:.2f}%  {seconds:.2f} s  "
                  f"{float(sums[1]) / seconds:.0f} samples/s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
