"""Run under ``lccrun --compression fp16``: DistributedOptimizer without ``compression=`` uses
the launcher's default compressor; an explicit ``compression=`` still wins (issue 17 item 6).

The gradients differ from 1 only below float16's precision (1 + k * 2**-12), so the averaged
gradient shows whether it travelled as float16: fp16 rounds every rank's value to 1.0 before
the sum, no compression keeps the exact average. Expected values come from torch's own float16
rounding, not from lightcc.
"""
from __future__ import annotations

import torch

import lightcc.torch as hvd
from common import check, close, run

R = N = 0
SIZE = 2048            # 8 KB of float32: above LCC_MIN_COMPRESS_BYTES (4 KB), so compressed


def case_init():
    global R, N
    hvd.init()
    R, N = hvd.rank(), hvd.size()


def _grad(rank: int) -> torch.Tensor:
    return torch.full((SIZE,), 1.0 + (rank + 1) * 2.0 ** -12)


def _averaged_gradient(**kwargs) -> torch.Tensor:
    p = torch.nn.Parameter(torch.zeros(SIZE))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([p], lr=1.0),
                                   named_parameters=[(f"p.{len(kwargs)}", p)], **kwargs)
    (p * _grad(R)).sum().backward()
    opt.synchronize()
    return p.grad.detach().clone()


def _exact() -> torch.Tensor:
    return sum(_grad(r).double() for r in range(N)).div(N).float()


def _as_fp16() -> torch.Tensor:
    return (sum(_grad(r).half().float() for r in range(N)) / N).half().float()


def case_launcher_default_is_used():
    check(not torch.equal(_exact(), _as_fp16()), "test values must show float16 rounding")
    close(_averaged_gradient(), _as_fp16(), "no compression= under lccrun --compression fp16",
          atol=0, rtol=0)


def case_explicit_compression_wins():
    close(_averaged_gradient(compression=hvd.Compression.none), _exact(),
          "explicit compression=Compression.none", atol=0, rtol=0)

    class Identity(hvd.compression.Compressor):
        calls = 0

        @staticmethod
        def compress(tensor):
            Identity.calls += 1
            return tensor, None

        @staticmethod
        def decompress(tensor, ctx):
            return tensor

    close(_averaged_gradient(compression=Identity), _exact(),
          "explicit user compressor", atol=0, rtol=0)
    check(Identity.calls == 1, f"user compressor called {Identity.calls} times")


if __name__ == "__main__":
    run([case_init, case_launcher_default_is_used, case_explicit_compression_wins])
