"""The ``lightcc`` torch.distributed backend's allreduce on CUDA tensors, with the CuPy / NCCL /
torch.cuda doubles: the tensors go to the engine's device path, not through the host.

Run alone (``LCC_BACKEND=nccl``: the fake NCCL; nothing may be copied device -> host and the
host never waits for the device) or under ``mpirun -np 2`` (``LCC_BACKEND=mpi``: pinned
staging over real MPI). Every rank checks: the engine got device requests; the reduced values
land in the tensor's own memory; ``Work.wait()`` makes torch's current stream wait on the
engine's done event; allreduce_coalesced and PREMUL_SUM take the same path.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tests.doubles import install, spy_submissions  # noqa: E402

gpu = install(devices=1, torch_cuda=True)
cupy = gpu.cupy

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import lightcc.torch  # noqa: E402,F401 - registers the backend
from tests.doubles.fake_torch import cuda_tensor  # noqa: E402

submitted = spy_submissions()

dist.init_process_group("lightcc")          # MPI rendezvous under mpirun
R, N = dist.get_rank(), dist.get_world_size()
pg = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cuda"))
nccl = N == 1 and os.environ.get("LCC_BACKEND") == "nccl"



def no_host_round_trip() -> None:
    if nccl:
        d2h = [r for r in gpu.log.of("copy") if r[2][0] == 2]
        assert not d2h, f"device -> host copies on the NCCL path: {d2h}"
        assert not gpu.log.of("sync"), gpu.log.of("sync")


consumer = cupy.cuda.Stream()                # torch's current stream on this thread
gpu.torch.set_stream(consumer.ptr)
for dt in (torch.float32, torch.float16, torch.bfloat16):
    gpu.log.clear()
    submitted.clear()
    t = cuda_tensor(torch.full((1000,), float(R + 1), dtype=dt))
    ptr = t.data_ptr()
    work = pg.allreduce([t], dist.AllreduceOptions())
    assert work.wait() is True
    assert t.data_ptr() == ptr and (t.float() == N * (N + 1) / 2).all(), (dt, t)
    assert submitted and all(r.device for r in submitted), submitted
    waits = gpu.log.of("wait", consumer.ptr)
    assert waits, f"torch's current stream never waited on the result: {gpu.log.records}"
    no_host_round_trip()

submitted.clear()
a, b = cuda_tensor(torch.full((7,), float(R))), cuda_tensor(torch.full((3,), 2.0 * R))
pg.allreduce_coalesced([a, b], dist.AllreduceCoalescedOptions()).wait()
assert (a == sum(range(N))).all() and (b == 2 * sum(range(N))).all(), (a, b)
opts = dist.AllreduceOptions()
opts.reduceOp = dist._make_nccl_premul_sum(0.5)
c = cuda_tensor(torch.full((5,), float(R + 1)))
gpu.log.clear()
pg.allreduce([c], opts).wait()
assert (c == 0.5 * N * (N + 1) / 2).all(), c
assert not nccl or gpu.log.of("nccl"), gpu.log.records      # the scaled sum really ran
no_host_round_trip()
assert len(submitted) == 3 and all(r.device for r in submitted), submitted
print(f"rank {R}: ok c10d allreduce on the device path", flush=True)
dist.destroy_process_group()
