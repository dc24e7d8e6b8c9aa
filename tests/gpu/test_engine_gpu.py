"""The engine's device path on a real GPU: one rank in this process (NCCL with a single rank,
and MPI), and the compressors at two ranks sharing the GPU (``compressors_worker.py`` under
``mpirun -np 2``, ``LCC_BACKEND=mpi``: at one rank twophase and PowerSGD return before
compressing). Needs a GPU.

What only a GPU shows: that the engine's stream really waits for a producer that is still
running when the tensor is submitted, that the consumer's stream really waits for the result,
that kernels, NCCL and DLPack accept what lightcc passes them, and that the CUDA compression
kernels give the simulation's bits. Further multi-rank runs: ``python -m lightcc.gpucheck``
(two ranks over MPI staging) and, on several GPUs,
``mpirun -np N python -m lightcc.gpucheck.engine_check``.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from .gpu_common import require_gpu

pytestmark = pytest.mark.gpu
cupy = require_gpu()
pytest.importorskip("mpi4py.MPI", reason="lightcc.init needs mpi4py")

import lightcc as lcc  # noqa: E402
from lightcc.common import api  # noqa: E402
from lightcc.common.backends.nccl import nccl_available  # noqa: E402


def test_compressors_on_device_at_two_ranks():
    """fp16, bf16, fp8 (E4M3, E5M2 block) and TopK bit for bit, PowerSGD within 1e-4, against
    NumPy simulations, two steps each (error feedback, warm start). First in this module: it
    starts its own job before this process initialises MPI. Its logic also runs on the CPU
    with the CuPy doubles (tests/parallel/test_core.py)."""
    from tests.mpi_harness import run_mpi

    out = run_mpi(2, [str(Path(__file__).with_name("compressors_worker.py"))],
                  env={"LCC_BACKEND": "mpi"}, timeout=300).stdout
    assert out.count("gpu compressors ok") == 2, out


@pytest.fixture(scope="module", params=["nccl", "mpi"])
def engine(request):
    if request.param == "nccl" and not nccl_available():
        pytest.skip("CuPy has no NCCL (pip install nvidia-nccl-cu13)")
    lcc.init(backend=request.param)
    yield request.param
    lcc.shutdown()


def _torch_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    return torch


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64, np.int32, np.uint8])
def test_allreduce_cupy_arrays(engine, dtype):
    xs = [cupy.arange(n, dtype=dtype) for n in (10, 1000, 70_000)]
    got = lcc.grouped_allreduce(xs, lcc.Sum, f"ar.{np.dtype(dtype).name}", prescale_factor=1.0,
                                postscale_factor=2.0 if dtype in (np.float32, np.float64)
                                else 1.0)
    for x, g in zip(xs, got):
        assert isinstance(g, cupy.ndarray) and g.dtype == x.dtype
        scale = 2 if dtype in (np.float32, np.float64) else 1
        np.testing.assert_array_equal(g.get(), x.get() * scale)
    assert api.engine().group(0).device.backend == engine


def test_producer_still_running_at_submit(engine):
    """The engine stream waits for the producer's kernels (recorded event), no host sync."""
    side = cupy.cuda.Stream(non_blocking=True)
    with side:
        x = cupy.zeros(1 << 24, np.float32)
        for _ in range(20):                      # keep the side stream busy for a while
            x += 1.0
        h = lcc.allreduce_async(x, lcc.Sum, "producer", prescale_factor=3.0)
        got = lcc.synchronize(h)                  # side stream waits for the engine
        assert float(got[-1]) == 60.0 and float(got[0]) == 60.0


def test_collectives_on_cupy(engine):
    x = cupy.arange(12, dtype=np.float32).reshape(4, 3)
    np.testing.assert_array_equal(lcc.allgather(x, name="ag").get(), x.get())
    out = cupy.empty_like(x)
    lcc.synchronize(lcc.broadcast_async(x, 0, name="bc", out=out))
    np.testing.assert_array_equal(out.get(), x.get())
    got, splits = lcc.alltoall(x, splits=[4], name="a2a")
    np.testing.assert_array_equal(got.get(), x.get())
    np.testing.assert_array_equal(lcc.reducescatter(x, name="rs").get(), x.get())


def test_torch_cuda_tensors_zero_copy(engine):
    torch = _torch_cuda()
    import lightcc.torch as hvd

    for dt in (torch.float32, torch.float16, torch.bfloat16, torch.bool):
        t = torch.ones(5, 7, device="cuda", dtype=dt)
        ptr = t.data_ptr()
        assert hvd.allreduce_(t, op=hvd.Max if dt == torch.bool else hvd.Sum,
                              name=f"t.{dt}") is t
        assert t.data_ptr() == ptr and t.is_cuda and bool(t.all())
        out = hvd.allreduce(t.float(), name=f"o.{dt}", prescale_factor=2.0)
        assert out.is_cuda and torch.equal(out, torch.full_like(out, 2.0))
    g = hvd.allgather(torch.arange(6, device="cuda", dtype=torch.bfloat16).view(2, 3))
    assert g.is_cuda and g.dtype == torch.bfloat16 and g.flatten().tolist() == list(range(6))


def test_torch_side_stream_is_the_consumer(engine):
    torch = _torch_cuda()
    import lightcc.torch as hvd

    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        t = torch.zeros(1 << 22, device="cuda")
        torch.cuda._sleep(100_000_000)
        t.add_(5.0)
        hvd.allreduce_(t, op=hvd.Sum, name="side", prescale_factor=2.0)
        t.mul_(0.5)                               # queued on s after the wait
    s.synchronize()
    assert float(t.min()) == 5.0 and float(t.max()) == 5.0
