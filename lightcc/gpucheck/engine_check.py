"""The engine's GPU path on a real GPU, one case per line, for ``python -m lightcc.gpucheck``.

Run on one rank (``LCC_BACKEND=nccl``: NCCL with a single rank) or under ``mpirun -np 2`` on
one GPU (``LCC_BACKEND=mpi``: NCCL refuses two ranks on one GPU, so device arrays go through
pinned host memory; the compressors then really exchange data). Every case compares the device
result with the host path's result for the same inputs: bit for bit, except PowerSGD (cuBLAS /
cuSOLVER round differently from NumPy: relative 1e-4). Cases: every algorithm x compressor
(prescale 0.5, so a single rank does not skip the work), the other collectives, the torch layer
(a producer on a side stream that is still running when the tensor is submitted,
DistributedOptimizer and SyncBatchNorm against CPU replicas), and ``--cpu-reduce``.
Writes ``--json`` (rank 0) and exits 1 when a case failed.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from typing import Any, Callable

import numpy as np

ALGORITHMS = ["flat", "ring", "tree", "hierarchical", "2d"]
COMPRESSORS = ["none", "fp16", "bf16", "fp8", "fp8_e5m2", "topk", "powersgd"]
SHAPES = [(256, 192), (5000,), (7,)]


def _data(rank: int, shape: tuple, seed: int) -> np.ndarray:
    rng = np.random.default_rng([seed, rank])
    return (rng.standard_normal(shape) * 4).astype(np.float32)


class Cases:
    """Runs named checks, keeps going after a failure, and records each outcome."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def run(self, name: str, fn: Callable[[], str | None]) -> None:
        t0 = time.perf_counter()
        try:
            note = fn() or ""
            ok = True
        except Exception as exc:  # noqa: BLE001 - a failed case is reported, not fatal
            ok, note = False, f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        self.rows.append({"case": name, "ok": ok, "seconds": round(time.perf_counter() - t0, 3),
                          "note": note[:300]})
        print(f"{'ok  ' if ok else 'FAIL'} {name} {note[:120]}", flush=True)


def _compare(got: Any, want: np.ndarray, exact: bool, what: str) -> None:
    got = got.get() if hasattr(got, "get") else np.asarray(got)
    if exact:
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8), err_msg=what)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max(),
                                   err_msg=what)


def allreduce_matrix(lcc: Any, cupy: Any, cases: Cases, algorithms: list[str],
                     **init: Any) -> None:
    """Every algorithm x compressor: device vs host, fresh compressor state for each."""
    from lightcc.common import api

    for algo in algorithms:
        lcc.shutdown()
        lcc.init(algorithm=algo, min_compress_bytes=1024, **init)
        r = lcc.rank()
        for spec in COMPRESSORS:
            def case(algo: str = algo, spec: str = spec) -> str:
                host = [_data(r, s, i) for i, s in enumerate(SHAPES)]
                out = []
                for arrays in ([cupy.asarray(x) for x in host], host):
                    api.engine().group(0).compressors.clear()
                    out.append(lcc.grouped_allreduce(arrays, lcc.Sum, f"{algo}.{spec}", 0.5,
                                                     compression=spec))
                for i, (got, want) in enumerate(zip(*out)):
                    _compare(got, want, spec != "powersgd", f"{algo}/{spec} tensor {i}")
                return f"backend {api.engine().group(0).device.backend}"
            tag = "cpu-reduce " if init.get("cpu_reduce") else ""
            cases.run(f"{tag}allreduce {algo} {spec}", case)


def collectives(lcc: Any, cupy: Any, cases: Cases) -> None:
    r, n = lcc.rank(), lcc.size()

    def gather() -> None:
        got = lcc.allgather(cupy.full((r + 1, 3), r, np.int32), name="gc.ag").get()
        want = np.concatenate([np.full((k + 1, 3), k) for k in range(n)])
        np.testing.assert_array_equal(got, want)

    def bcast() -> None:
        b = cupy.full(5, r, np.float64)
        lcc.synchronize(lcc.broadcast_async(b, n - 1, name="gc.bc", out=b))
        assert (b.get() == n - 1).all()

    def alltoall() -> None:
        splits = [k + 1 for k in range(n)]
        a = cupy.arange(sum(splits), dtype=np.float32) + 100 * r
        out, received = lcc.alltoall(a, splits=splits, name="gc.a2a")
        want = np.concatenate([np.arange(sum(splits[:r]), sum(splits[:r + 1])) + 100 * s
                               for s in range(n)])
        np.testing.assert_array_equal(out.get(), want)

    def reducescatter() -> None:
        x = np.arange(4 * n, dtype=np.float32).reshape(2 * n, 2)
        got = lcc.reducescatter(cupy.asarray(x), name="gc.rs").get()
        np.testing.assert_array_equal(got, x[2 * r:2 * r + 2])

    for name, fn in (("allgather", gather), ("broadcast", bcast), ("alltoall", alltoall),
                     ("reducescatter", reducescatter)):
        cases.run(f"{name} cupy", fn)


def torch_layer(cases: Cases) -> None:
    import torch

    import lightcc.torch as hvd

    r, n = hvd.rank(), hvd.size()
    dev = torch.device("cuda", torch.cuda.current_device())

    def side_stream() -> None:
        for dt in (torch.float32, torch.float16, torch.bfloat16):
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                t = torch.zeros(1 << 20, device=dev, dtype=dt)
                torch.cuda._sleep(50_000_000)          # the producer is still running ...
                t.fill_(r + 1)                          # ... when the tensor is submitted
                hvd.allreduce_(t, op=hvd.Sum, name=f"side.{dt}")
                assert (t.float() == n * (n + 1) / 2).all(), t

    def ops() -> None:
        g = hvd.allgather(torch.full((r + 1,), r, device=dev, dtype=torch.bfloat16))
        assert g.is_cuda and g.tolist() == sum(([k] * (k + 1) for k in range(n)), [])
        b = torch.full((3,), float(r), device=dev)
        hvd.broadcast_(b, 0, name="tb")
        assert b.tolist() == [0.0] * 3
        x = torch.arange(2.0 * n, device=dev)
        rs = hvd.reducescatter(x, op=hvd.Sum)
        assert rs.is_cuda and rs.tolist() == (n * x[2 * r:2 * r + 2]).tolist()

    def optimizer() -> None:
        torch.manual_seed(1)
        cpu = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
        gpu = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                  torch.nn.Linear(16, 3)).to(dev)
        gpu.load_state_dict(cpu.state_dict())
        opts = [hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                         named_parameters=[(f"{tag}.{k}", p) for k, p in
                                                           m.named_parameters()])
                for tag, m in (("cpu", cpu), ("gpu", gpu))]
        for step in range(3):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step * 10 + r))
            for m, o, xx in ((cpu, opts[0], x), (gpu, opts[1], x.to(dev))):
                o.zero_grad()
                m(xx).square().sum().backward()
                o.step()
        for a, b in zip(cpu.parameters(), gpu.parameters()):
            torch.testing.assert_close(b.cpu(), a.detach(), rtol=1e-4, atol=1e-5)

    def sync_bn() -> None:
        torch.manual_seed(2)
        x = torch.randn(6, 4, 5, generator=torch.Generator().manual_seed(r))
        outs = []
        for where in ("cpu", dev):
            bn = hvd.SyncBatchNorm(4).to(where)
            xx = x.clone().to(where).requires_grad_()   # a leaf of its own on each device
            y = bn(xx)
            (y * torch.arange(5.0, device=where)).sum().backward()
            outs.append((y.detach().cpu(), xx.grad.cpu(), bn.running_var.cpu()))
        for a, b in zip(*outs):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)

    for name, fn in (("torch side-stream producer", side_stream), ("torch collectives", ops),
                     ("torch DistributedOptimizer", optimizer), ("torch SyncBatchNorm", sync_bn)):
        cases.run(name, fn)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None, help="write the cases here (rank 0)")
    ap.add_argument("--cpu-reduce", action="store_true", help="also run LCC_CPU_REDUCE=1")
    ap.add_argument("--algorithms", default=",".join(ALGORITHMS))
    args = ap.parse_args(argv)
    import cupy

    import lightcc as lcc

    lcc.init()
    cupy.cuda.Device(lcc.local_rank() % cupy.cuda.runtime.getDeviceCount()).use()
    import torch

    torch.cuda.set_device(cupy.cuda.runtime.getDevice())
    cases = Cases()
    allreduce_matrix(lcc, cupy, cases, args.algorithms.split(","))
    collectives(lcc, cupy, cases)
    torch_layer(cases)
    if args.cpu_reduce:
        allreduce_matrix(lcc, cupy, cases, ["auto"], cpu_reduce=True)
    failed = sum(not c["ok"] for c in cases.rows)
    summary = {"rank": lcc.rank(), "size": lcc.size(), "cases": cases.rows, "failed": failed}
    if args.json and lcc.rank() == 0:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(summary, fh, indent=1)
    print(f"rank {lcc.rank()}: {len(cases.rows) - failed}/{len(cases.rows)} cases ok",
          flush=True)
    lcc.shutdown()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
