"""The torch.distributed cases of a GPU user, one per line: DDP, FSDP2 and torch.compile(DDP)
on the ``lightcc`` backend with CUDA tensors, for ``python -m lightcc.gpucheck.device_run``.

Run under ``mpirun -np 1`` (the native backend is NCCL) or ``mpirun -np 2`` with both ranks on
one GPU (native: gloo, which stages CUDA tensors through the host as lightcc's backend does
there; NCCL refuses two ranks on one GPU). The reference for every case is computed in this
process without any collective: the gradient of the mean over ranks of each rank's loss, on a
local copy of the model. Cases (each after one step from the same weights):

* ``ddp <native>``: DDP on the native backend (checks the harness; it is what is timed);
* ``ddp lightcc <hook>``: DDP on a ``lightcc`` group, no hook / ``ddp_hooks`` fp16 / fp8;
* ``fsdp2 lightcc <fmt>``: FSDP2 on the group with ``lightcc.torch.fsdp.compress``;
* ``compile ddp lightcc``: ``torch.compile`` of a DDP model (4 blocks) on the group.

Tolerances, absolute, against ``A`` = the largest per-rank gradient element: 1e-5 A
uncompressed, 2**-9 A fp16, 2**-3 A fp8 (E4M3 keeps 3 mantissa bits; the two-phase scheme
rounds twice). Then per-step time, median of ``--steps`` (CUDA synchronized) of DDP on the
native backend and on lightcc, plain and with the fp16 hook, on a model of >= 100 tensors.
Writes ``--json`` (rank 0) and exits 1 when a case failed.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

from .engine_check import Cases

TOL = {"none": 1e-5, "fp16": 2.0 ** -9, "fp8": 2.0 ** -3}
KEEP: list = []     # DDP/FSDP models stay alive: freeing a Reducer can deadlock gloo's threads


def build(torch: Any, layers: int, width: int) -> Any:
    """``layers`` Linear+ReLU blocks (2 tensors each), same weights on every rank."""
    torch.manual_seed(0)
    mods: list[Any] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*mods)


class Check:
    def __init__(self, torch: Any, rank: int, world: int, width: int, layers: int,
                 cuda: bool = True) -> None:
        self.torch, self.rank, self.world, self.cuda = torch, rank, world, cuda
        self.dev = torch.device("cuda", torch.cuda.current_device()) if cuda else \
            torch.device("cpu")
        self.width, self.layers = width, layers
        self.batches = [torch.randn(16, width, generator=torch.Generator().manual_seed(r))
                        .to(self.dev) for r in range(world)]
        ref = build(torch, layers, width).to(self.dev)
        per_rank = []
        for x in self.batches:
            ref.zero_grad()
            ref(x).square().mean().backward()
            per_rank.append([p.grad.clone() for p in ref.parameters()])
        self.want = [sum(g) / world for g in zip(*per_rank)]
        self.amax = max(float(g.abs().max()) for gs in per_rank for g in gs)

    def step(self, model: Any) -> list[Any]:
        """One forward/backward on this rank's batch; the parameters' gradients (full)."""
        model.zero_grad(set_to_none=True)
        model(self.batches[self.rank]).square().mean().backward()
        grads = []
        for p in model.parameters():
            g = p.grad
            grads.append(g.full_tensor() if hasattr(g, "full_tensor") else g)
        return grads

    def compare(self, got: list[Any], kind: str) -> str:
        atol = TOL[kind] * self.amax
        worst = 0.0
        for i, (g, w) in enumerate(zip(got, self.want)):
            err = float((g.detach().float() - w).abs().max())
            worst = max(worst, err)
            if not err <= atol:                     # NaN fails too
                raise AssertionError(f"tensor {i}: max error {err:.3g} > {atol:.3g} "
                                     f"({kind}, A = {self.amax:.3g})")
        return f"max error {worst:.2g} (tolerance {atol:.2g})"


def ddp(check: Check, group: Any, hook: str | None, native_hook: bool = False) -> Any:
    torch = check.torch
    model = build(torch, check.layers, check.width).to(check.dev)
    model = torch.nn.parallel.DistributedDataParallel(model, process_group=group)
    if hook and native_hook:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        model.register_comm_hook(group, default_hooks.fp16_compress_hook)
    elif hook:
        from lightcc.torch import ddp_hooks

        ddp_hooks.register(model, hook, process_group=group)
    KEEP.append(model)
    return model


def fsdp(check: Check, group: Any, fmt: str) -> Any:
    import lightcc
    import lightcc.torch.fsdp
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    model = build(check.torch, check.layers, check.width).to(check.dev)
    mesh = DeviceMesh.from_group(group, check.dev.type)
    for child in model.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)
    spec = getattr(lightcc.Compression, fmt)
    lightcc.torch.fsdp.compress(model, spec() if callable(spec) else spec)
    KEEP.append(model)
    return model


def per_step_ms(check: Check, model: Any, steps: int, warmup: int = 5) -> float:
    torch, times = check.torch, []
    sync = torch.cuda.synchronize if check.cuda else (lambda: None)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = check.batches[check.rank]
    for i in range(warmup + steps):
        sync()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def timing(check: Check, native: str, group: Any, steps: int) -> list[dict[str, Any]]:
    """Per-step ms, native DDP against DDP on lightcc (plain, fp16 hook); slowest rank."""
    from mpi4py import MPI

    rows = []
    for hook in (None, "fp16"):
        ms = {}
        for which, g, nat in ((native, None, True), ("lightcc", group, False)):
            ms[which] = MPI.COMM_WORLD.allreduce(
                per_step_ms(check, ddp(check, g, hook, native_hook=nat), steps), op=MPI.MAX)
        rows.append({"hook": hook or "none", "native": native, "native_ms": ms[native],
                     "lightcc_ms": ms["lightcc"], "ratio": ms[native] / ms["lightcc"],
                     "overhead_pct": 100 * (ms["lightcc"] / ms[native] - 1)})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None, help="write the cases and timings here (rank 0)")
    ap.add_argument("--port", type=int, default=29561)
    ap.add_argument("--layers", type=int, default=60, help="Linear blocks (2 tensors each)")
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per column (0: none)")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile(DDP)")
    ap.add_argument("--cpu", action="store_true",
                    help="CPU tensors, gloo as the native backend (tries the harness without "
                         "a GPU; not a GPU check)")
    args = ap.parse_args(argv)
    import lightcc  # noqa: F401  (its Open MPI settings, before MPI starts)
    from mpi4py import MPI
    import torch
    import torch.distributed as dist

    import lightcc.torch  # noqa: F401 - registers the lightcc backend

    rank, world = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    if not args.cpu:
        torch.cuda.set_device(0)                   # one GPU, shared by every rank
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    native = "nccl" if world == 1 and not args.cpu else "gloo"
    dist.init_process_group(native, rank=rank, world_size=world)
    group = dist.new_group(backend="lightcc")
    check = Check(torch, rank, world, args.width, args.layers, cuda=not args.cpu)
    cases = Cases()
    cases.run(f"ddp {native}", lambda: check.compare(check.step(ddp(check, None, None)), "none"))
    for hook in ("none", "fp16", "fp8"):
        cases.run(f"ddp lightcc {hook}", lambda h=hook: check.compare(
            check.step(ddp(check, group, None if h == "none" else h)), h))
    for fmt in ("fp16", "fp8"):
        cases.run(f"fsdp2 lightcc {fmt} reduce-scatter",
                  lambda f=fmt: check.compare(check.step(fsdp(check, group, f)), f))
    if not args.no_compile:                         # a small model: compile time counts
        small = Check(torch, rank, world, args.width, 4, cuda=not args.cpu)
        cases.run("compile ddp lightcc", lambda: small.compare(
            small.step(torch.compile(ddp(small, group, None))), "none"))
    times: list[dict[str, Any]] = []
    if args.steps > 0:
        def timed() -> str:
            times.extend(timing(check, native, group, args.steps))
            return "; ".join(f"{t['hook']}: lightcc {t['lightcc_ms']:.2f} ms vs {native} "
                             f"{t['native_ms']:.2f} ms" for t in times)
        cases.run(f"timing ddp lightcc vs {native}", timed)
    failed = sum(not c["ok"] for c in cases.rows)
    doc = {"rank": rank, "size": world, "native": native, "cases": cases.rows, "failed": failed,
           "tensors": 2 * args.layers, "timing": times}
    if args.json and rank == 0:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(doc, fh, indent=1)
    print(f"rank {rank}: {len(cases.rows) - failed}/{len(cases.rows)} cases ok", flush=True)
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
