"""The whole GPU path through a real engine, with the CuPy/NCCL/torch.cuda doubles.

Run alone (one rank: ``LCC_BACKEND=nccl``, the fake NCCL) or under ``mpirun -np 2``
(``LCC_BACKEND=mpi``: device arrays staged through pinned memory over real MPI). Checks:
device results equal the host path's bits for every algorithm and compressor; every collective
on CuPy arrays; host and device tensors in one batch; the torch layer on tensors that say they
are on ``cuda:0`` (no host copy: requests are device requests, in-place results stay in the
tensor's memory) including DistributedOptimizer; one rank: no host synchronization between
submit and result; argument errors.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import numpy as np  # noqa: E402

from tests.doubles import fake_cupy, install, spy_submissions  # noqa: E402

gpu = install(devices=2, torch_cuda=True)
cupy = gpu.cupy

import lightcc as lcc  # noqa: E402
from lightcc.common import api  # noqa: E402

ALGORITHMS = ["flat", "ring", "tree", "hierarchical", "2d"]
COMPRESSORS = ["none", "fp16", "bf16", "fp8", "fp8_e5m2", "topk", "powersgd"]
submitted = spy_submissions()


def data(rank: int, shape: tuple, seed: int) -> np.ndarray:
    rng = np.random.default_rng([seed, rank])
    return rng.integers(-8, 9, shape).astype(np.float32)


def check_algorithms_and_compressors() -> None:
    shapes = [(64, 48), (3000,), (7,)]
    for algo in ALGORITHMS:
        lcc.shutdown()
        lcc.init(algorithm=algo, fusion_threshold=1 << 20, min_compress_bytes=1024)
        R = lcc.rank()
        for spec in COMPRESSORS:
            host = [data(R, s, i) for i, s in enumerate(shapes)]
            dev = [cupy.asarray(x) for x in host]
            results = []
            for arrays in (dev, host):   # same names, fresh compressor state (EF, PowerSGD Q)
                api.engine().group(0).compressors.clear()
                results.append(lcc.grouped_allreduce(arrays, lcc.Sum, f"{algo}.{spec}",
                                                     compression=spec))
            for got, want in zip(*results):
                assert isinstance(got, fake_cupy.ndarray), type(got)
                np.testing.assert_array_equal(got.get().view(np.uint32), want.view(np.uint32),
                                              err_msg=f"{algo}/{spec}")
    print(f"rank {lcc.rank()}: ok algorithms x compressors", flush=True)


def check_collectives() -> None:
    R, N = lcc.rank(), lcc.size()
    x = cupy.asarray(np.full((R + 1, 3), R, np.int32))
    got = lcc.allgather(x, name="ag").get()
    np.testing.assert_array_equal(got, np.concatenate([np.full((r + 1, 3), r) for r in range(N)]))
    b = cupy.asarray(np.full(5, R, np.float64))
    lcc.synchronize(lcc.broadcast_async(b, N - 1, name="bc", out=b))
    assert (b.get() == N - 1).all()
    splits = [r + 1 for r in range(N)]
    a = cupy.asarray(np.arange(sum(splits), dtype=np.float32) + 100 * R)
    out, received = lcc.alltoall(a, splits=splits, name="a2a")
    want = np.concatenate([np.arange(sum(splits[:R]), sum(splits[:R + 1])) + 100 * s
                           for s in range(N)])
    np.testing.assert_array_equal(out.get(), want)
    np.testing.assert_array_equal(received, [R + 1] * N)
    rs = lcc.reducescatter(cupy.asarray(np.arange(4 * N, dtype=np.float32).reshape(2 * N, 2)),
                           name="rs")
    np.testing.assert_array_equal(rs.get(), np.arange(4 * N, dtype=np.float32)
                                  .reshape(2 * N, 2)[2 * R:2 * R + 2])
    # host and device tensors in one batch: separate buckets, both right
    hs = [lcc.allreduce_async(np.full(4, R, np.float32), lcc.Sum, "mix.h"),
          lcc.allreduce_async(cupy.full(4, R, np.float32), lcc.Sum, "mix.d")]
    total = sum(range(N))
    assert (hs[0].wait() == total).all() and (hs[1].wait().get() == total).all()
    print(f"rank {R}: ok collectives", flush=True)


def check_torch() -> None:
    import torch

    import lightcc.torch as hvd
    from tests.doubles.fake_torch import cuda_tensor

    R, N = hvd.rank(), hvd.size()
    submitted.clear()
    gpu.log.clear()
    cupy.cuda.Device(1).use()        # CuPy's current device is not the tensors' (cuda:0)
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        t = cuda_tensor(torch.full((3, 4), float(R + 1), dtype=dt))
        ptr = t.data_ptr()
        assert hvd.allreduce_(t, op=hvd.Sum, name=f"t.{dt}") is t and t.data_ptr() == ptr
        assert (t.float() == sum(range(1, N + 1))).all(), t
        out = hvd.allreduce(cuda_tensor(torch.full((5,), float(R), dtype=dt)), name=f"o.{dt}")
        assert out.dtype == dt and torch.allclose(out.float(), torch.full((5,), (N - 1) / 2))
    # unnamed and blocking: checked against the other ranks on this thread (direct.py), then
    # reduced by the engine on the device path (the direct path never reduces GPU memory)
    path = api.engine().groups[0].direct
    assert path is not None, "no direct path (MPI_THREAD_MULTIPLE missing?)"
    calls, reduced = path.calls, path.reduced
    u = hvd.allreduce(cuda_tensor(torch.full((4,), float(R))), op=hvd.Sum)
    assert torch.allclose(u.float(), torch.full((4,), float(sum(range(N))))), u
    assert (path.calls, path.reduced) == (calls + 1, reduced), (path.calls, path.reduced)
    assert submitted[-1].device, submitted[-1]
    flags = cuda_tensor(torch.tensor([R == 0, False, True]))
    hvd.allreduce_(flags, op=hvd.Max, name="flags")
    assert flags.tolist() == [True, False, True]
    g = hvd.allgather(cuda_tensor(torch.full((R + 1,), R, dtype=torch.bfloat16)), name="tg")
    assert g.dtype == torch.bfloat16 and g.tolist() == sum(([r] * (r + 1) for r in range(N)), [])
    b = cuda_tensor(torch.full((2,), float(R)))
    hvd.broadcast_(b, root_rank=0, name="tb")
    assert b.tolist() == [0.0, 0.0]
    assert all(r.device for r in submitted), [r.name for r in submitted if not r.device]
    # a side stream in torch: the ready event is recorded there and that stream waits
    side = cupy.cuda.Stream(non_blocking=True)
    gpu.torch.set_stream(side.ptr)
    t = cuda_tensor(torch.ones(6))
    hvd.allreduce_(t, op=hvd.Sum, name="side")
    assert gpu.log.of("record", side.ptr) and gpu.log.of("wait", side.ptr), gpu.log.records[-9:]
    gpu.torch.set_stream(0)
    # DistributedOptimizer with gradients on the "GPU": the average of every rank's gradient
    model = torch.nn.Linear(4, 2)
    torch.manual_seed(0)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                   named_parameters=model.named_parameters())
    before = [p.detach().clone() for p in model.parameters()]
    submitted.clear()
    for i, p in enumerate(model.parameters()):
        p.grad = cuda_tensor(torch.full_like(p, float(R + i)))
        if N > 1:
            opt.on_gradient(p)                # what the post-accumulate-grad hook does
    opt.step()
    for i, (p, p0) in enumerate(zip(model.parameters(), before)):
        assert torch.allclose(p.detach(), p0 - ((N - 1) / 2 + i)), (p, p0)
    assert N == 1 or (submitted and all(r.device for r in submitted))
    if os.environ.get("LCC_BACKEND") == "nccl":      # no host round trip on the NCCL path
        staged = [r for r in gpu.log.of("copy") if r[2][0] in (1, 2)]
        assert not staged and gpu.log.of("nccl"), staged
    cupy.cuda.Device(0).use()
    print(f"rank {R}: ok torch", flush=True)


def check_no_host_sync_and_errors() -> None:
    from lightcc.common.exceptions import InvalidArgumentError

    lcc.shutdown()
    lcc.init()                               # algorithm auto: NCCL's own allreduce
    x = cupy.ones(1000, np.float32)
    gpu.log.clear()
    res = lcc.grouped_allreduce([x, x[:10]], lcc.Sum, name="nosync", prescale_factor=2.0)
    syncs = gpu.log.of("sync")
    assert not syncs, syncs
    # one fused bucket, or two single ones when the second arrived after the first was agreed
    assert gpu.log.of("nccl") and {r[2] for r in gpu.log.of("launch")} <= \
        {"lcc_pack_scale_f32", "lcc_unpack_b4"}, gpu.log.records
    assert (res[0].get() == 2.0).all() and (res[1].get() == 2.0).all()
    for call, match in [
            (lambda: lcc.allreduce(cupy.ones((4, 4), np.float32)[:, 1], name="nc"),
             "C-contiguous"),
            (lambda: lcc.allreduce(x, name="out", out=np.empty(1000, np.float32)), "GPU"),
    ]:
        try:
            call()
        except InvalidArgumentError as exc:
            assert match in str(exc), exc
        else:
            raise AssertionError(f"no error for {match}")
    with cupy.cuda.Device(1):
        y = cupy.ones(3, np.float32)
    try:
        lcc.allreduce(y, name="gpu1")
    except InvalidArgumentError as exc:
        assert "GPU 1" in str(exc) and "GPU 0" in str(exc), exc
    else:
        raise AssertionError("a tensor on another GPU was accepted")
    print("rank 0: ok no host sync, errors", flush=True)


lcc.init()
check_algorithms_and_compressors()
check_collectives()
check_torch()
if lcc.size() == 1 and os.environ.get("LCC_BACKEND") == "nccl":
    check_no_host_sync_and_errors()
lcc.shutdown()
