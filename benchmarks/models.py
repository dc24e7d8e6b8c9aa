"""Model shapes the training benchmarks run: few large tensors, many small ones, a CNN.

Every model takes MNIST-shaped input (N, 1, 28, 28) and returns 10 logits, so one synthetic data
set serves all of them. Parameter tensor counts are what matters for a communication library:

- ``mlp``: 784 -> 2560 -> 2048 -> 10, 7.3 M parameters in 6 tensors (few, large);
- ``resmlp``: 40 residual blocks of LayerNorm + Linear + ReLU at width 410, 7.1 M parameters in
  164 tensors (many small tensors, shaped like real networks' 100-300);
- ``cnn``: a small ResNet-style CNN (stem + 4 basic blocks + classifier), 29 tensors, most of
  the step in compute;
- ``transformer``: row embedding + 12 uniform encoder blocks (width 256), 9.5 M parameters.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def mlp(hidden: tuple[int, ...] = (2560, 2048)) -> nn.Module:
    layers: list[nn.Module] = [nn.Flatten()]
    width = 784
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    layers.append(nn.Linear(width, 10))
    return nn.Sequential(*layers)


class _ResBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.relu(self.fc(self.norm(x)))


class ResMLP(nn.Module):
    """``blocks`` residual LayerNorm+Linear blocks: 4 tensors each, plus 4 for in/out."""

    def __init__(self, blocks: int = 40, width: int = 410) -> None:
        super().__init__()
        self.inp = nn.Linear(784, width)
        self.blocks = nn.Sequential(*[_ResBlock(width) for _ in range(blocks)])
        self.out = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(self.inp(x.flatten(1))))


class _BasicBlock(nn.Module):
    """conv-bn-relu-conv-bn plus a parameter-free shortcut (pooled, zero-padded channels)."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.b1 = nn.BatchNorm2d(cout)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.b2 = nn.BatchNorm2d(cout)
        self.stride, self.pad = stride, cout - cin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.b2(self.c2(F.relu(self.b1(self.c1(x)))))
        if self.stride > 1:
            x = F.avg_pool2d(x, self.stride)
        if self.pad:
            x = F.pad(x, (0, 0, 0, 0, 0, self.pad))
        return F.relu(x + y)


class SmallResNet(nn.Module):
    """Stem (3 tensors) + 4 basic blocks (6 each) + classifier (2): 29 tensors."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, width, 3, 1, 1, bias=False)
        self.bn = nn.BatchNorm2d(width)
        self.layers = nn.Sequential(_BasicBlock(width, width, 1),
                                    _BasicBlock(width, 2 * width, 2),
                                    _BasicBlock(2 * width, 2 * width, 1),
                                    _BasicBlock(2 * width, 4 * width, 2))
        self.fc = nn.Linear(4 * width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(F.relu(self.bn(self.stem(x))))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


class Transformer(nn.Module):
    """Embedding + ``blocks`` uniform pre-norm encoder blocks + classifier: each image row is a
    token (28 tokens of 28 pixels), embedded by a Linear layer plus a learned position
    embedding; width 256, 4 heads, feed-forward 1024, 12 blocks: 9.5 M parameters in 148
    tensors, every block the same size, so backward produces equal gradients at an even pace
    (the regime cross-barrier mode is for). ``--batch-size`` chooses how compute compares with
    the wire."""

    def __init__(self, blocks: int = 12, width: int = 256, heads: int = 4,
                 ff: int = 1024) -> None:
        super().__init__()
        self.embed = nn.Linear(28, width)
        self.pos = nn.Embedding(28, width)
        self.blocks = nn.Sequential(*[
            nn.TransformerEncoderLayer(width, heads, ff, dropout=0.0, batch_first=True,
                                       norm_first=True) for _ in range(blocks)])
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.embed(x.flatten(1, 2))                  # (N, 28 rows, 28) -> (N, 28, w)
        tokens = tokens + self.pos.weight
        return self.fc(self.norm(self.blocks(tokens)).mean(1))


MODELS = {"mlp": mlp, "resmlp": ResMLP, "cnn": SmallResNet, "transformer": Transformer}


def build(name: str) -> nn.Module:
    try:
        return MODELS[name]()
    except KeyError:
        raise SystemExit(f"unknown model {name!r}; known: {', '.join(MODELS)}") from None


def describe(model: nn.Module) -> str:
    params = list(model.parameters())
    return f"{sum(p.numel() for p in params) / 1e6:.1f} M params in {len(params)} tensors"
