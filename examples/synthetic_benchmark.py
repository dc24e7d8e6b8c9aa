"""Synthetic training benchmark in the manner of Horovod's: random data, fixed model, img/s.

    lccrun -np 2 python examples/synthetic_benchmark.py --model mlp --batch-size 32

Runs ``--num-warmup-batches`` untimed steps, then ``--num-iters`` timed iterations of
``--num-batches-per-iter`` steps each; prints img/s per iteration, the mean +- 1.96 standard
deviations per rank, and the total over all ranks. ``--use-adasum`` reduces with Adasum as
Horovod's ``pytorch_synthetic_benchmark.py`` does: ``DistributedOptimizer(op=Adasum)`` and the
learning rate not scaled by the number of ranks (Horovod scales it by ``local_size`` only for
its NCCL GPU Adasum, which lightcc does not have); it needs a power-of-2 number of ranks.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import lightcc.torch as lcc


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = nn.Sequential()
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                       nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.short(x))


def resnet18_like(width: int = 32, classes: int = 10) -> nn.Module:
    """ResNet-18's layout ([2, 2, 2, 2] basic blocks) for 32x32 inputs, ``width`` base channels."""
    layers: list[nn.Module] = [nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width),
                               nn.ReLU()]
    cin = width
    for i, cout in enumerate([width, 2 * width, 4 * width, 8 * width]):
        for j in range(2):
            layers.append(BasicBlock(cin, cout, 2 if (j == 0 and i > 0) else 1))
            cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes)]
    return nn.Sequential(*layers)


def build(name: str) -> tuple[nn.Module, tuple[int, ...]]:
    """The model and the shape of one input sample."""
    if name == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(784, 2560), nn.ReLU(),
                             nn.Linear(2560, 2048), nn.ReLU(), nn.Linear(2048, 10)), (1, 28, 28)
    if name == "convnet":
        return nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Flatten(), nn.Linear(64 * 7 * 7, 128), nn.ReLU(),
                             nn.Linear(128, 10)), (1, 28, 28)
    if name == "resnet18-like":
        return resnet18_like(), (3, 32, 32)
    raise SystemExit(f"unknown --model {name!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description="lightcc synthetic benchmark")
    parser.add_argument("--model", default="mlp", choices=["mlp", "convnet", "resnet18-like"])
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--num-warmup-batches", type=int, default=10)
    parser.add_argument("--num-batches-per-iter", type=int, default=10)
    parser.add_argument("--num-iters", type=int, default=5)
    parser.add_argument("--compression", default="none", help="lightcc.torch.Compression name")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: cores/ranks)")
    parser.add_argument("--use-adasum", action="store_true",
                        help="reduce with Adasum (no learning-rate scaling by ranks)")
    args = parser.parse_args()

    lcc.init()
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // lcc.local_size()))
    torch.manual_seed(0)
    model, sample = build(args.model)
    comp = getattr(lcc.Compression, args.compression)
    comp = comp() if callable(comp) and not hasattr(comp, "spec") else comp
    lr_scaler = 1 if args.use_adasum else lcc.size()
    opt = torch.optim.SGD(model.parameters(), lr=0.01 * lr_scaler, momentum=0.9)
    lcc.broadcast_parameters(model.state_dict(), root_rank=0)
    lcc.broadcast_optimizer_state(opt, root_rank=0)
    opt = lcc.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=comp,
                                   op=lcc.Adasum if args.use_adasum else lcc.Average)
    data = torch.randn(args.batch_size, *sample)
    target = torch.randint(0, 10, (args.batch_size,))

    def step() -> None:
        opt.zero_grad()
        F.cross_entropy(model(data), target).backward()
        opt.step()

    say = print if lcc.rank() == 0 else (lambda *a, **k: None)
    params = sum(p.numel() for p in model.parameters())
    say(f"Model: {args.model} ({params / 1e6:.2f} M parameters)  Batch size: {args.batch_size}"
        f"  Ranks: {lcc.size()}  Compression: {args.compression}"
        f"{'  Adasum' if args.use_adasum else ''}")
    say("Running warmup...")
    for _ in range(args.num_warmup_batches):
        step()
    say("Running benchmark...")
    rates = []
    for i in range(args.num_iters):
        t0 = time.perf_counter()
        for _ in range(args.num_batches_per_iter):
            step()
        rate = args.batch_size * args.num_batches_per_iter / (time.perf_counter() - t0)
        say(f"Iter #{i}: {rate:.1f} img/sec per rank")
        rates.append(rate)
    mean = statistics.mean(rates)
    conf = 1.96 * (statistics.stdev(rates) if len(rates) > 1 else 0.0)
    total = lcc.allreduce(torch.tensor([mean]), op=lcc.Sum, name="bench.total").item()
    say(f"Img/sec per rank: {mean:.1f} +-{conf:.1f}")
    say(f"Total img/sec on {lcc.size()} rank(s): {total:.1f} +-{conf * lcc.size():.1f}")
    lcc.shutdown()


if __name__ == "__main__":
    main()
