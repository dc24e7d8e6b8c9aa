"""Every compressor on the engine's device path at two ranks, against independent NumPy
simulations (``tests/parallel/workers_compression/sim.py``). Run under ``mpirun -np 2`` with
``LCC_BACKEND=mpi``: both ranks share one GPU (NCCL refuses two ranks on one device), device
buffers go through pinned host memory, and the compressors really exchange data (at one rank
twophase and PowerSGD return before compressing).

Per compressor, two steps on a (128, 128) float32 tensor with prescale 0.5 (the compressor sees
0.5 * x): fp16, bf16, fp8 E4M3 (a scale per chunk), fp8 E5M2 (a scale per 256-element block)
and TopK 1 % with error feedback bit for bit; PowerSGD rank 2 (warm start, error feedback)
within 1e-4 relative (cuBLAS / cuSOLVER round differently from NumPy's float64). Also: the
result is a device array, bitwise the same on both ranks, and differs from the exact sum (the
compressor acted). With ``LCC_TEST_DOUBLES=1`` the CuPy doubles (tests/doubles) stand in for
the GPU, so the logic of this check runs on the CPU too. Prints ``gpu compressors ok`` per rank.
"""
from __future__ import annotations

import os
import sys
import zlib
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "parallel" / "workers_compression"))
import sim  # noqa: E402

if os.environ.get("LCC_TEST_DOUBLES"):
    from tests.doubles import install

    cupy = install(devices=1).cupy
else:
    import cupy

from mpi4py import MPI  # noqa: E402

import lightcc as lcc  # noqa: E402
from lightcc.common import api  # noqa: E402
from lightcc.common.compression.base import BucketContext  # noqa: E402

SHAPE = (128, 128)
N_EL = SHAPE[0] * SHAPE[1]
# spec -> (format, scaling, block) for sim.twophase
TWOPHASE = {"fp16": ("fp16", None, 256), "bf16": ("bf16", None, 256),
            "fp8": ("e4m3", "bucket", 256), "fp8:e5m2:block:256": ("e5m2", "block", 256)}

lcc.init()
R, P = lcc.rank(), lcc.size()
assert P == 2, "run under mpirun -np 2"
cupy.cuda.Device(lcc.local_rank() % cupy.cuda.runtime.getDeviceCount()).use()


def inputs(spec: str, step: int) -> list[np.ndarray]:
    """Every rank's tensor (each rank makes all of them from seeds)."""
    return [np.random.default_rng([step, r, zlib.crc32(spec.encode())])
            .standard_normal(SHAPE).astype(np.float32) * 4 for r in range(P)]


def reduce_on_device(spec: str, x: np.ndarray) -> np.ndarray:
    got = lcc.allreduce(cupy.asarray(x), lcc.Sum, f"gpu.{spec}", compression=spec,
                        prescale_factor=0.5)
    assert isinstance(got, cupy.ndarray), f"{spec}: result is {type(got)}, not on the device"
    host = got.get().reshape(-1)
    digests = MPI.COMM_WORLD.allgather(zlib.crc32(host.tobytes()))
    assert len(set(digests)) == 1, f"{spec}: ranks differ (crc32 {digests})"
    return host


def bitwise(got: np.ndarray, want: np.ndarray, what: str) -> None:
    bad = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
    assert bad.size == 0, (f"{what}: {bad.size} of {got.size} differ from the simulation, "
                           f"first at {bad[0]}: {got[bad[0]]!r} != {want[bad[0]]!r}")


def acted(got: np.ndarray, seen: list[np.ndarray], what: str) -> None:
    exact = (seen[0] + seen[1]).astype(np.float32)
    assert not np.array_equal(got, exact), f"{what}: the exact sum, no compressor acted"


def check_twophase(spec: str) -> None:
    fmt, scaling, block = TWOPHASE[spec]
    for step in range(2):
        xs = inputs(spec, step)
        seen = [(0.5 * x).reshape(-1) for x in xs]          # exact in float32
        got = reduce_on_device(spec, xs[R])
        bitwise(got, sim.twophase(seen, fmt, scaling, block), f"{spec} step {step}")
        acted(got, seen, spec)


def check_topk() -> None:
    res = None
    for step in range(2):                                   # step 1 adds step 0's residuals
        xs = inputs("topk", step)
        seen = [(0.5 * x).reshape(-1) for x in xs]
        got = reduce_on_device("topk", xs[R])
        want, res, k = sim.topk_step(seen, res, 0.01)
        bitwise(got, want, f"topk step {step}")
        assert 0 < np.count_nonzero(got) <= P * k, f"topk step {step}: {np.count_nonzero(got)}"
        acted(got, seen, "topk")


def check_powersgd() -> None:
    name = "gpu.powersgd"
    comp = api.engine().group(0).compressor("powersgd")
    ctx = BucketContext((name,), (0,), (N_EL,), 0, 0, (SHAPE,))
    part = next(p for p in comp.plan(N_EL, ctx) if p.shape is not None)
    # the seeded initial Q is an input of the scheme, taken as is (as the host test does)
    qs = [comp._initial_q(comp._key(part, ctx), part.shape[1],
                          min(comp.rank, *part.shape)).astype(np.float64)]
    res = None
    for step in range(2):                                   # warm start and error feedback
        xs = inputs("powersgd", step)
        seen = [(0.5 * x).reshape(-1) for x in xs]
        got = reduce_on_device("powersgd", xs[R])
        want, res, qs = sim.powersgd_step(seen, res, qs, comp.rank, [(0, N_EL, SHAPE)])
        err = float(np.abs(got - want).max() / np.abs(want).max())
        assert err < 1e-4, f"powersgd step {step}: relative error {err:.2e} vs the simulation"
        acted(got, seen, "powersgd")


for spec in TWOPHASE:
    check_twophase(spec)
check_topk()
check_powersgd()
backend = api.engine().group(0).device.backend
assert backend == "mpi", f"device backend {backend!r}, expected mpi (LCC_BACKEND=mpi)"
print(f"rank {R}: gpu compressors ok", flush=True)
lcc.shutdown()
