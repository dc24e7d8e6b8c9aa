"""lightcc.torch without MPI: tensor adapters, argument handling, Horovod name/default parity."""
from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import lightcc.torch as hvd  # noqa: E402
from lightcc.torch import _tensor, compression, mpi_ops  # noqa: E402

# horovod.torch 0.28's public names (horovod/torch/__init__.py)
HOROVOD_NAMES = """init shutdown is_initialized size rank local_size local_rank cross_size cross_rank
is_homogeneous mpi_threads_supported mpi_enabled mpi_built gloo_enabled gloo_built nccl_built
ddl_built ccl_built cuda_built rocm_built allreduce allreduce_ allreduce_async allreduce_async_
grouped_allreduce grouped_allreduce_ grouped_allreduce_async grouped_allreduce_async_
sparse_allreduce_async allgather allgather_async grouped_allgather grouped_allgather_async
broadcast broadcast_ broadcast_async broadcast_async_ alltoall alltoall_async reducescatter
reducescatter_async grouped_reducescatter grouped_reducescatter_async poll synchronize join
barrier Average Sum Adasum Min Max Product Compression DistributedOptimizer broadcast_parameters
broadcast_optimizer_state broadcast_object allgather_object SyncBatchNorm ProcessSet
add_process_set remove_process_set global_process_set start_timeline stop_timeline
HorovodInternalError""".split()

# (function, parameter names in order, defaults) as in horovod.torch 0.28
SIGNATURES = {
    "allreduce": ("tensor average name compression op prescale_factor postscale_factor "
                  "process_set", {"average": None, "name": None, "op": None,
                                  "prescale_factor": 1.0, "postscale_factor": 1.0}),
    "allreduce_async": ("tensor average name op prescale_factor postscale_factor process_set",
                        {"op": None}),
    "allreduce_": ("tensor average name op prescale_factor postscale_factor process_set", {}),
    "grouped_allreduce": ("tensors average name compression op prescale_factor "
                          "postscale_factor process_set", {}),
    "allgather": ("tensor name process_set", {"name": None}),
    "broadcast": ("tensor root_rank name process_set", {"name": None}),
    "broadcast_async_": ("tensor root_rank name process_set", {}),
    "alltoall": ("tensor splits name process_set", {"splits": None}),
    "reducescatter": ("tensor name compression op process_set prescale_factor "
                      "postscale_factor", {"op": hvd.Average}),
    "reducescatter_async": ("tensor name op process_set prescale_factor postscale_factor",
                            {"op": hvd.Average}),
    "join": ("device", {"device": -1}),
    "barrier": ("process_set", {}),
    "broadcast_parameters": ("params root_rank", {}),
    "broadcast_optimizer_state": ("optimizer root_rank model", {"model": None}),
    "broadcast_object": ("obj root_rank name process_set", {"root_rank": 0, "name": None}),
    "DistributedOptimizer": ("optimizer named_parameters compression backward_passes_per_step op "
                             "gradient_predivide_factor num_groups groups sparse_as_dense "
                             "process_set", {"named_parameters": None,
                                             "backward_passes_per_step": 1, "op": hvd.Average,
                                             "gradient_predivide_factor": 1.0, "num_groups": 0,
                                             "groups": None, "sparse_as_dense": False}),
    "start_timeline": ("file_path mark_cycles", {"mark_cycles": False}),
}


def test_every_horovod_name_exists():
    missing = [n for n in HOROVOD_NAMES if not hasattr(hvd, n)]
    assert not missing


@pytest.mark.parametrize("fn", sorted(SIGNATURES))
def test_signatures_match_horovod(fn):
    names, defaults = SIGNATURES[fn]
    params = inspect.signature(getattr(hvd, fn)).parameters
    assert list(params)[:len(names.split())] == names.split()
    for key, value in defaults.items():
        assert params[key].default == value, key
    if "process_set" in params:
        assert params["process_set"].default is hvd.global_process_set


@pytest.mark.parametrize("dtype", _tensor.SUPPORTED_DTYPES)
def test_contiguous_tensors_become_views(dtype):
    t = torch.zeros(3, 4, dtype=dtype)
    s = _tensor.stage(t, "test")
    assert not s.copy_back and s.array.shape == (3, 4)
    assert s.array.__array_interface__["data"][0] == t.data_ptr()     # same memory
    s.array[...] = np.ones((3, 4), dtype=s.array.dtype)
    assert bool((t == 1).all())
    back = _tensor.from_array(s.array)
    assert back.dtype == dtype and back.data_ptr() == t.data_ptr()


def test_bfloat16_view_is_ml_dtypes_bfloat16():
    t = torch.tensor([1.5, -2.25, 3.0], dtype=torch.bfloat16)
    arr = _tensor.as_array(t)
    assert arr.dtype.name == "bfloat16"
    assert arr.astype(np.float32).tolist() == [1.5, -2.25, 3.0]


def test_non_contiguous_tensor_is_staged_and_copied_back():
    t = torch.arange(12.0).reshape(3, 4).t()
    s = _tensor.stage(t, "test")
    assert s.copy_back and s.array.flags.c_contiguous
    s.array *= 2
    assert s.finish() is t
    assert torch.equal(t, torch.arange(12.0).reshape(3, 4).t() * 2)


def _vm_flags(addr: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds ``addr`` (Linux smaps)."""
    flags, inside = None, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith("VmFlags:"):
            flags = line.split()[1:]
    assert flags is not None, hex(addr)
    return flags


@pytest.mark.skipif(not Path("/sys/kernel/mm/transparent_hugepage").exists(),
                    reason="no transparent huge pages (Linux only)")
def test_large_fresh_results_ask_for_huge_pages_small_ones_do_not():
    """A fresh out-of-place result of 4 MB or more is advised as huge-page memory before it is
    written (``hg`` in its mapping's VmFlags), as NumPy does for its arrays: torch.empty alone
    is not (faulting 64 MB in 4 KB pages cost 3x the allreduce, docs/memory.md)."""
    big = torch.ones(16 << 20)                                 # 64 MB input
    out, arr = _tensor.result_like(big)
    assert arr.__array_interface__["data"][0] == out.data_ptr()
    assert "hg" in _vm_flags(out.data_ptr() + (out.numel() * 4) // 2)
    # torch's own allocation is not advised: checked in a fresh process (in this one an earlier
    # test's advised memory may be reused by the allocator, advice and all)
    probe = ("import torch, sys; sys.path.insert(0, %r); from test_torch import _vm_flags; "
             "t = torch.empty(16 << 20); print('hg' in _vm_flags(t.data_ptr() + (32 << 20)))"
             % str(Path(__file__).parent))
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=120, env=env)
    assert res.stdout.strip() == "False", res.stdout + res.stderr
    small = _tensor.empty_host((1024,), torch.float32)
    assert small.shape == (1024,) and small.dtype == torch.float32


def test_zero_size_and_scalar_tensors():
    for shape in [(0,), (2, 0), ()]:
        s = _tensor.stage(torch.empty(shape), "test")
        assert s.array.shape == shape


def test_unsupported_tensor_types_raise_value_and_type_error():
    with pytest.raises(ValueError, match="complex64"):
        _tensor.stage(torch.ones(2, dtype=torch.complex64), "allreduce")
    with pytest.raises(TypeError):
        _tensor.stage(np.ones(2), "allreduce")
    with pytest.raises(ValueError, match="sparse"):
        _tensor.stage(torch.ones(2).to_sparse(), "allreduce")


def test_requires_grad_tensor_is_viewed_without_copy():
    p = torch.nn.Parameter(torch.ones(3))
    s = _tensor.stage(p, "test")
    assert s.array.__array_interface__["data"][0] == p.data_ptr()


def test_average_backwards_compatibility():
    f = mpi_ops.handle_average_backwards_compatibility
    assert f(None, None) == hvd.Average
    assert f(hvd.Min, None) == hvd.Min
    with pytest.warns(DeprecationWarning):
        assert f(None, False) == hvd.Sum
    with pytest.raises(ValueError):
        f(hvd.Sum, True)


def test_compression_specs():
    assert compression.spec_of(hvd.Compression.none) == "none"
    assert compression.spec_of(hvd.Compression.fp16) == "fp16"
    assert compression.spec_of(hvd.Compression.topk(0.1)).startswith("topk")
    assert compression.spec_of(None) == "none"

    class Custom:
        @staticmethod
        def compress(t):
            return t, None

        @staticmethod
        def decompress(t, ctx):
            return t

    assert compression.spec_of(Custom) is None          # applied per tensor, as in Horovod
    with pytest.raises(ValueError):
        compression.spec_of(42)


BEFORE_INIT = """
import pytest, torch
import lightcc.torch as hvd
assert not hvd.is_initialized()
assert hvd.mpi_built() is True and hvd.gloo_built() is False
assert hvd.cuda_built() == (hvd.nccl_built() != 0)
for fn in (hvd.rank, hvd.size, hvd.mpi_enabled, lambda: hvd.allreduce(torch.ones(2)),
           lambda: hvd.poll(123456789)):
    with pytest.raises(ValueError):
        fn()
assert hvd.synchronize(123456789) is None
print("before-init ok")
"""


def test_built_flags_and_errors_before_init():
    # a fresh interpreter: other tests in this session may have called init()
    out = subprocess.run([sys.executable, "-c", BEFORE_INIT], capture_output=True, text=True,
                         timeout=60, cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0 and "before-init ok" in out.stdout, out.stdout + out.stderr


def test_optimizer_arguments_checked_before_any_communication():
    params = [torch.nn.Parameter(torch.ones(2))]
    with pytest.raises(ValueError, match="gradient_predivide_factor"):
        hvd.DistributedOptimizer(torch.optim.SGD(params, lr=1), op=hvd.Sum,
                                 gradient_predivide_factor=2.0)
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        hvd.DistributedOptimizer(torch.optim.SGD(params, lr=1), backward_passes_per_step=0)
    with pytest.raises(ValueError, match="groups"):
        hvd.DistributedOptimizer(torch.optim.SGD(params, lr=1), groups=[[params[0], params[0]]])
    with pytest.raises(ValueError, match="groups"):
        hvd.DistributedOptimizer(torch.optim.SGD(params, lr=1), groups=-1)


def test_builtin_compressors_are_horovod_classes_and_engine_specs():
    t = torch.tensor([1.0 + 2 ** -12, -2.5])
    c, ctx = hvd.Compression.fp16.compress(t)
    assert c.dtype == torch.float16 and ctx == torch.float32
    assert hvd.Compression.fp16.decompress(c, ctx).dtype == torch.float32
    ints = torch.arange(3)
    assert hvd.Compression.fp16.compress(ints)[0] is ints
    assert hvd.Compression.none.compress(t) == (t, None)
    assert compression.spec_of(hvd.Compression.bf16) == "bf16"

    class Inherits(hvd.Compression.fp16):             # nothing overridden: still the engine's
        pass

    class Overrides(hvd.Compression.fp16):            # Horovod-style: applied per tensor
        @staticmethod
        def compress(tensor):
            return tensor, None

    assert compression.spec_of(Inherits) == "fp16"
    assert compression.spec_of(Overrides) is None
    assert compression.spec_of(compression.per_tensor(hvd.Compression.fp16)) is None
    with pytest.raises(ValueError, match="inside the engine"):
        hvd.Compression.powersgd().compress(t)
    with pytest.raises(ValueError):
        compression.per_tensor(42)


def test_gradient_semantics_modes():
    from lightcc.torch import autograd

    assert autograd._semantics == "horovod"
    with hvd.gradient_semantics("sum_of_losses"):
        assert autograd._semantics == "sum_of_losses"
    assert autograd._semantics == "horovod"
    with pytest.raises(ValueError, match="sum_of_losses"):
        hvd.set_gradient_semantics("average")
    # reducescatter's backward factor: Horovod's is size times the sum-of-losses one
    for op in (hvd.Sum, hvd.Average):
        h = autograd._scatter_grad_scale(op, 2.0, 0.5, 4, "horovod")
        s = autograd._scatter_grad_scale(op, 2.0, 0.5, 4, "sum_of_losses")
        assert h == pytest.approx(4 * s)
