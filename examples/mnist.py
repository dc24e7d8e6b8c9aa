"""Train a small CNN on MNIST with lightcc's DistributedOptimizer.

    lccrun -np 2 python examples/mnist.py          # or: mpirun -np 2 python examples/mnist.py
    torchrun --nproc-per-node 2 examples/mnist.py  # no MPI: torchrun's store, lightcc's TCP
    python examples/mnist.py --cuda --epochs 1     # on a GPU (one per rank)

Data: the four standard IDX files (``train-images-idx3-ubyte[.gz]`` ...) in ``--data-dir``;
``--download`` fetches them first when the network allows. Without them the example says so
and falls back to scikit-learn's bundled 8x8 handwritten digits (1797 images, no network
needed), so it always runs. Each rank trains on its shard of every epoch; rank 0 prints one
line per epoch: training loss, test accuracy, seconds and samples/s over all ranks.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import lightcc
import lightcc.torch as lcc

MNIST_FILES = {"train_x": "train-images-idx3-ubyte", "train_y": "train-labels-idx1-ubyte",
               "test_x": "t10k-images-idx3-ubyte", "test_y": "t10k-labels-idx1-ubyte"}
MNIST_MIRROR = "https://ossci-datasets.s3.amazonaws.com/mnist/"


class Net(nn.Module):
    """Two 3x3 conv layers, max-pool, two dense layers; sized for 28x28 or 8x8 inputs."""

    def __init__(self, side: int) -> None:
        super().__init__()
        self.pool_twice = side >= 16            # MNIST: 28 -> 14 -> 7; digits: 8 -> 4
        self.conv1 = nn.Conv2d(1, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        out_side = side // 4 if self.pool_twice else side // 2
        self.fc1 = nn.Linear(64 * out_side * out_side, 128)
        self.fc2 = nn.Linear(128, 10)
        self.drop = nn.Dropout(0.25)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        if self.pool_twice:
            x = F.max_pool2d(x, 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = self.drop(F.relu(self.fc1(x.flatten(1))))
        return self.fc2(x)


# ---- data -------------------------------------------------------------------------------------
def _read_idx(path: Path) -> np.ndarray:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as fh:
        data = fh.read()
    ndim = data[3]
    shape = tuple(int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim))
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


def _find(data_dir: Path, stem: str) -> Path | None:
    for name in (stem, stem + ".gz"):
        if (data_dir / name).exists():
            return data_dir / name
    return None


def _download(data_dir: Path) -> None:
    data_dir.mkdir(parents=True, exist_ok=True)
    for stem in MNIST_FILES.values():
        if _find(data_dir, stem) is None:
            with urllib.request.urlopen(MNIST_MIRROR + stem + ".gz", timeout=20) as resp:
                (data_dir / (stem + ".gz")).write_bytes(resp.read())


def load_data(args: argparse.Namespace, rank: int | None = None,
              barrier=None) -> tuple[TensorDataset, TensorDataset, str]:
    """(train, test, description); MNIST when available, else the 8x8 digits fallback.

    ``rank`` and ``barrier`` default to lightcc's (other launchers pass torch.distributed's):
    rank 0 downloads while the others wait.
    """
    data_dir = Path(args.data_dir).expanduser()
    note = ""
    if args.download and (lcc.rank() if rank is None else rank) == 0:
        try:
            _download(data_dir)
        except OSError as exc:
            note = f"download failed ({exc.__class__.__name__}: {exc}); "
    (barrier or lcc.barrier)()
    paths = {k: _find(data_dir, stem) for k, stem in MNIST_FILES.items()}
    if all(paths.values()):
        arrays = {k: _read_idx(p) for k, p in paths.items()}

        def make(x: np.ndarray, y: np.ndarray) -> TensorDataset:
            images = (torch.from_numpy(x.astype(np.float32) / 255.0) - 0.1307) / 0.3081
            return TensorDataset(images.unsqueeze(1), torch.from_numpy(y.astype(np.int64)))

        return (make(arrays["train_x"], arrays["train_y"]),
                make(arrays["test_x"], arrays["test_y"]), f"MNIST from {data_dir}")
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.from_numpy((digits.images / 16.0 - 0.5).astype(np.float32)).unsqueeze(1)
    y = torch.from_numpy(digits.target.astype(np.int64))
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(1234))
    test_idx, train_idx = order[:360], order[360:]
    hint = "" if args.download else " (pass --download to fetch it)"
    text = (f"MNIST not found in {data_dir}{hint}; {note}falling back to scikit-learn's 8x8 "
            f"digits: {len(train_idx)} training / {len(test_idx)} test images")
    return (TensorDataset(x[train_idx], y[train_idx]), TensorDataset(x[test_idx], y[test_idx]),
            text)


# ---- training ---------------------------------------------------------------------------------
def _compression(name: str):
    value = getattr(lcc.Compression, name, None)
    if value is None:
        raise SystemExit(f"unknown --compression {name!r}")
    return value() if callable(value) and not hasattr(value, "spec") else value


def evaluate(model: nn.Module, loader: DataLoader, device: torch.device) -> float:
    """Test accuracy over all ranks' shards (a Sum allreduce of [correct, seen])."""
    model.eval()
    counts = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for x, y in loader:
            pred = model(x.to(device)).argmax(1).cpu()
            counts += torch.tensor([(pred == y).sum().item(), len(y)], dtype=torch.float64)
    counts = lcc.allreduce(counts, op=lcc.Sum, name="eval.counts")
    return float(counts[0] / counts[1])


def main() -> None:
    parser = argparse.ArgumentParser(description="MNIST CNN with lightcc")
    parser.add_argument("--data-dir", default="~/.cache/lightcc/mnist")
    parser.add_argument("--download", action="store_true", help="fetch MNIST if missing")
    parser.add_argument("--epochs", type=int, default=0, help="default: 8 digits / 3 MNIST")
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05, help="per rank; scaled by size")
    parser.add_argument("--compression", default="none",
                        help="none, fp16, bf16, fp8, topk, powersgd (lightcc.torch.Compression)")
    parser.add_argument("--cuda", action="store_true",
                        help="train on the GPU of the local rank (an error without one)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--json", default=None, help="write a summary here (rank 0)")
    args = parser.parse_args()

    lcc.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // lcc.local_size()))
    device = torch.device("cpu")
    if args.cuda:      # one GPU per rank; gradients are reduced on it (NCCL or MPI staging)
        if not torch.cuda.is_available():
            raise SystemExit("--cuda: torch sees no CUDA device")
        device = torch.device("cuda", lcc.local_rank() % torch.cuda.device_count())
        torch.cuda.set_device(device)
    train, test, description = load_data(args)
    side = train.tensors[0].shape[-1]
    epochs = args.epochs or (8 if side < 16 else 3)
    if lcc.rank() == 0:
        print(description, flush=True)
    sampler = DistributedSampler(train, num_replicas=lcc.size(), rank=lcc.rank(),
                                 shuffle=True, seed=args.seed)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler)
    test_loader = DataLoader(test, batch_size=500, sampler=DistributedSampler(
        test, num_replicas=lcc.size(), rank=lcc.rank(), shuffle=False))

    model = Net(side).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * lcc.size(), momentum=0.9)
    lcc.broadcast_parameters(model.state_dict(), root_rank=0)
    lcc.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = lcc.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=_compression(args.compression))
    start, accuracy, sent0 = time.perf_counter(), 0.0, lightcc.stats()["bytes_sent"]
    for epoch in range(1, epochs + 1):
        t0 = time.perf_counter()
        model.train()
        sampler.set_epoch(epoch)
        total_loss, seen = torch.zeros(1, dtype=torch.float64), 0
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            total_loss += loss.item() * len(y)
            seen += len(y)
        sums = lcc.allreduce(torch.cat([total_loss, torch.tensor([float(seen)],
                                                                 dtype=torch.float64)]),
                             op=lcc.Sum, name="epoch.loss")
        seconds = time.perf_counter() - t0
        accuracy = evaluate(model, test_loader, device)
        if lcc.rank() == 0:
            print(f"epoch {epoch}/{epochs}  loss {float(sums[0] / sums[1]):.4f}  "
                  f"test accuracy {100 * accuracy:.2f}%  {seconds:.2f} s  "
                  f"{float(sums[1]) / seconds:.0f} samples/s", flush=True)
    wall = time.perf_counter() - start
    sent = lcc.allreduce(torch.tensor([float(lightcc.stats()["bytes_sent"] - sent0)]),
                         op=lcc.Sum, name="bytes").item()
    if lcc.rank() == 0 and args.json:
        Path(args.json).write_text(json.dumps({
            "ranks": lcc.size(), "compression": args.compression, "epochs": epochs,
            "data": "mnist" if side >= 16 else "digits", "wall_s": wall,
            "accuracy": accuracy, "bytes_sent": sent}))
    lcc.shutdown()


if __name__ == "__main__":
    sys.exit(main())
