"""Compressed training does not depend on how a step's gradients fall into buckets (mpirun).

The same model, seeds and data are trained for ``STEPS`` steps through lightcc.torch's
``DistributedOptimizer`` with each compressor, under every fusion threshold of ``THRESHOLDS``
(0: every gradient alone; 64 KB: a few per bucket; 64 MB: the whole step in one) and both
engine modes (``overlap`` 0: collectives start when a thread waits, the step's gradients in
one batch; 1: in the background as backward produces them, split by timing). The parameters
must be bitwise identical in all six runs, on every rank. One step has an Inf in one
gradient on one rank (an fp16 overflow that GradScaler skips): the step is skipped, and
compressor state (TopK residuals, PowerSGD's per-tensor finiteness) must not leak into the
other tensors of its bucket. Usage: ``bucket_invariance.py SPEC [SPEC ...]``.
"""
from __future__ import annotations

import sys
import zlib

import torch
import torch.nn as nn

import lightcc.torch as lcc

STEPS, BATCH, OVERFLOW_STEP = 6, 16, 3
THRESHOLDS = (0, 64 << 10, 64 << 20)
MODES = ("0", "1")


def model() -> nn.Module:
    """Tensors from 10 to 131 072 elements (0.04-512 KB) with gradients of different sizes."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.LayerNorm(256), nn.ReLU(),
                         nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 64), nn.Tanh(),
                         nn.Linear(64, 10))


def train(spec: str, threshold: int, overlap: str) -> list[bytes]:
    lcc.init(fusion_threshold=threshold, overlap=overlap, min_compress_bytes=1024)
    rank = lcc.rank()
    net = model()
    lcc.broadcast_parameters(net.state_dict(), root_rank=0)
    opt = lcc.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=net.named_parameters(), compression=spec)
    target = dict(net.named_parameters())["3.weight"]
    step_no = [0]

    def overflow(grad: torch.Tensor) -> torch.Tensor:   # an Inf in one gradient on rank 1
        if step_no[0] == OVERFLOW_STEP and rank == 1:
            grad = grad.clone()
            grad[0, 0] = float("inf")
        return grad

    target.register_hook(overflow)
    g = torch.Generator().manual_seed(1234 + rank)
    for step in range(STEPS):
        step_no[0] = step
        x = torch.randn(BATCH, 64, generator=g)
        y = torch.randint(0, 10, (BATCH,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.synchronize()
        finite = all(torch.isfinite(p.grad).all() for p in net.parameters())
        if finite:
            with opt.skip_synchronize():
                opt.step()
        elif step != OVERFLOW_STEP:
            raise AssertionError(f"{spec}: non-finite gradient at step {step}")
    params = [p.detach().numpy().tobytes() for p in net.parameters()]
    lcc.shutdown()
    return params


def main() -> int:
    specs = sys.argv[1:]
    failed = []
    for spec in specs:
        runs = {(t, m): train(spec, t, m) for t in THRESHOLDS for m in MODES}
        first = next(iter(runs.values()))
        differ = [f"threshold={t} overlap={m}" for (t, m), p in runs.items() if p != first]
        lcc.init()
        crcs = lcc.allgather(torch.tensor([zlib.crc32(b"".join(first))], dtype=torch.int64),
                             name=f"crc.{spec}")
        lcc.shutdown()
        if differ or len(set(crcs.tolist())) != 1:
            failed.append(spec)
            print(f"FAIL {spec}: parameters differ from threshold={THRESHOLDS[0]} "
                  f"overlap={MODES[0]} in {differ}; crc per rank {crcs.tolist()}", flush=True)
        else:
            print(f"same {spec}: {len(runs)} runs bitwise identical", flush=True)
    if failed:
        return 1
    print("OK bucket invariance", flush=True)
    return 0


sys.exit(main())
