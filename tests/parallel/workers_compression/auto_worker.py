"""compression=auto through DistributedOptimizer on 2-3 ranks (mpirun).

Modes (argv[1]):

- ``train``: a 32-128-16 MLP, SGD, ``STEPS`` steps with ``Compression.auto``, the probe
  measuring this machine. ``train-slow``: the same with the probe's result replaced on every
  rank by the measurements of a 1 Gbit link (so the fp16 path runs through the engine).
  Every step, each rank's reduced gradients are compared with a single-process torch
  reference built from every rank's batch at the current parameters: the exact mean where
  auto reported ``none`` (and before it decided), the two-phase fp16 simulation (each rank's
  gradient rounded to fp16, summed in fp32 in rank order, the sum rounded to fp16, divided
  by the ranks) where it reported fp16. The ranks' choices are gathered and must be equal;
  the loss must fall. Prints ``OK auto <mode> <formats>`` per rank.
- ``ddp-slow``: the same check for DDP on the ``lightcc`` backend with
  ``ddp_hooks.register(model, "auto")`` (each parameter a tensor of its own).
- ``disagree``: rank 0 asks for ``auto(accuracy="lossy")``, the others for ``auto``; then
  plain ``auto`` with LCC_COMPRESSION_ACCURACY=lossy on rank 0 only. Every rank must get an
  error from its step. Prints ``OK disagree`` per rank.
- ``badknob``: LCC_COMPRESSION_ACCURACY=fast: ``init()`` fails on every rank with the
  variable's name; ``Compression.auto(accuracy="fast")`` raises. Prints ``OK badknob``.
"""
from __future__ import annotations

import copy
import os
import sys

import numpy as np
import torch
import torch.nn as nn

import lightcc.torch as lcc

STEPS, BATCH, LR = 8, 8, 0.1
SLOW = {"none": (2e-4, 8e-9), "fp16": (5e-4, 4.3e-9), "fp8:e4m3:bucket": (5e-4, 2.4e-9)}


def batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 + step % 2)   # two batches: the loss must fall
    x = torch.randn(BATCH * lcc.size(), 32, generator=g)
    y = torch.randint(0, 16, (BATCH * lcc.size(),), generator=g)
    return x[rank * BATCH:(rank + 1) * BATCH], y[rank * BATCH:(rank + 1) * BATCH]


def reference(model: nn.Module, step: int, formats: dict, n: int) -> dict:
    """The averaged gradient of every parameter at ``model``'s parameters (see docstring)."""
    grads = []
    for r in range(n):
        m = copy.deepcopy(model)
        x, y = batch(step, r)
        nn.functional.cross_entropy(m(x), y).backward()
        grads.append({k: p.grad.detach().clone() for k, p in m.named_parameters()})
    out = {}
    for k in grads[0]:
        if formats.get(k, "none") == "fp16":
            acc = torch.zeros_like(grads[0][k])
            for g in grads:
                acc += g[k].half().float()
            out[k] = acc.half().float() / n
        else:
            acc = grads[0][k].clone()
            for g in grads[1:]:
                acc += g[k]
            out[k] = acc / n
    return out


def train(mode: str) -> None:
    from lightcc.common import api
    from lightcc.common.compression import autoprobe

    real_probe = autoprobe._probe
    if mode == "train-slow":
        autoprobe._probe = lambda comp, comm, fmts, like: {f: SLOW[f] for f in fmts}
    init_cache = os.environ.get("LCC_TEST_INIT_CACHE")     # init()'s argument, not the env's
    lcc.init(**({"autotune_cache": init_cache} if init_cache else {}))
    n, rank = lcc.size(), lcc.rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 16))
    opt = lcc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                   named_parameters=model.named_parameters(),
                                   compression=lcc.Compression.auto)
    lcc.broadcast_parameters(model.state_dict(), root_rank=0)
    comp = None
    losses, fp16_differs = [], False
    for step in range(STEPS):
        before = copy.deepcopy(model)
        x, y = batch(step, rank)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.synchronize()
        comp = comp or api.compressor(None, "auto:lossless")
        formats = comp.decisions[-1]["formats"] if comp and comp.decisions else {}
        want = reference(before, step, formats, n)
        exact = reference(before, step, {}, n)
        for k, p in model.named_parameters():
            torch.testing.assert_close(p.grad, want[k], rtol=2e-6, atol=1e-8,
                                       msg=lambda m, k=k, s=step: f"{k} step {s}: {m}")
            fp16_differs |= not torch.allclose(want[k], exact[k], rtol=2e-6, atol=1e-8)
        with opt.skip_synchronize():
            opt.step()
        losses.append(lcc.allreduce(loss.detach(), name=f"loss{step}").item())
    assert comp is not None and len(comp.decisions) == 1, comp and comp.decisions
    formats = comp.decisions[0]["formats"]
    everyone = lcc.allgather_object(sorted(formats.items()))
    assert all(e == everyone[0] for e in everyone), everyone
    if mode == "train-slow":
        # both weights (16 KB, 8 KB) are over LCC_MIN_COMPRESS_BYTES: fp16 on a 1 Gbit link;
        # biases (< 4096 bytes) never reach auto
        assert formats == {"0.weight": "fp16", "2.weight": "fp16"}, formats
        assert fp16_differs, "the fp16 reference never differed from the exact mean"
    assert losses[-1] < losses[0], losses
    print(f"OK auto {mode} {sorted(formats.items())} on rank {rank}", flush=True)
    lcc.shutdown()
    autoprobe._probe = real_probe       # the next case of a shared job measures again


def ddp(mode: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightcc.common import api
    from lightcc.common.compression import autoprobe
    from lightcc.torch import ddp_hooks

    real_probe = autoprobe._probe
    autoprobe._probe = lambda comp, comm, fmts, like: {f: SLOW[f] for f in fmts}
    dist.init_process_group("lightcc")
    n, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 16))
    model = DDP(net)
    ddp_hooks.register(model, "auto")
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    comp = None
    for step in range(STEPS):
        before = copy.deepcopy(net)
        x, y = batch(step, rank)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        comp = comp or api.compressor(None, "auto:lossless")
        chosen = comp.decisions[-1]["formats"] if comp and comp.decisions else {}
        formats = {k: v for name, v in chosen.items() for k, _ in net.named_parameters()
                   if name.endswith(":" + k)}
        want = reference(before, step, formats, n)
        for k, p in net.named_parameters():
            torch.testing.assert_close(p.grad, want[k], rtol=2e-6, atol=1e-8,
                                       msg=lambda m, k=k, s=step: f"{k} step {s}: {m}")
        opt.step()
    assert sorted(formats.values()) == ["fp16", "fp16"], (chosen, formats)
    print(f"OK auto {mode} {sorted(formats.items())} on rank {rank}", flush=True)
    dist.destroy_process_group()
    autoprobe._probe = real_probe


def disagree() -> None:
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    if rank == 0:
        os.environ["LCC_COMPRESSION_ACCURACY"] = "lossy"
    lcc.init()
    errors = []
    for spec in (lcc.Compression.auto(accuracy="lossy") if rank == 0 else lcc.Compression.auto,
                 lcc.Compression.auto):
        model = nn.Linear(64, 64)
        opt = lcc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                       named_parameters=[(f"{len(errors)}.{k}", p) for k, p in
                                                         model.named_parameters()],
                                       compression=spec)
        nn.functional.mse_loss(model(torch.ones(4, 64)), torch.zeros(4, 64)).backward()
        try:
            opt.step()
        except Exception as exc:  # noqa: BLE001 - the error every rank must see
            errors.append(f"{type(exc).__name__}: {exc}")
    assert len(errors) == 2, errors
    assert all("auto" in e for e in errors), errors
    print(f"OK disagree on rank {rank}: {errors[0][:300]}", flush=True)
    lcc.shutdown()


def badknob() -> None:
    os.environ["LCC_COMPRESSION_ACCURACY"] = "fast"
    try:
        lcc.init()
    except Exception as exc:  # noqa: BLE001
        assert "LCC_COMPRESSION_ACCURACY" in str(exc), exc
    else:
        raise AssertionError("init() accepted LCC_COMPRESSION_ACCURACY=fast")
    try:
        lcc.Compression.auto(accuracy="fast")
    except ValueError as exc:
        assert "accuracy" in str(exc)
    else:
        raise AssertionError("Compression.auto(accuracy='fast') accepted")
    print("OK badknob", flush=True)


if __name__ == "__main__":
    mode = sys.argv[1]
    np.random.seed(0)
    {"train": train, "train-slow": train, "ddp-slow": ddp, "disagree": lambda _: disagree(),
     "badknob": lambda _: badknob()}[mode](mode)
