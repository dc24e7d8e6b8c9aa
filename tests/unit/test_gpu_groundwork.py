"""GPU-path code that can be checked without a GPU.

* the kernel loader finds ``csrc/*.cu`` (source tree, installed ``lightcc/_csrc``, override)
  and pastes local headers in;
* ``backends/nccl.py``, ``kernels/cuda.py`` and ``compression/gpu.py`` import without CuPy and
  fail with a LightCCError that says what is missing;
* every kernel launch in ``compression/gpu.py`` names a kernel that exists and passes
  arguments whose count and sizes match the kernel's PTX parameters (against a fake CuPy
  backed by NumPy; nvcc makes the PTX, skipped without it);
* the NCCL communicator's control logic (grouping, deferred send/recv, timeouts and async
  errors becoming CollectiveError) against a fake NCCL.
"""
from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from lightcc.common.exceptions import CollectiveError, InvalidArgumentError, LightCCError
from lightcc.common.kernels import cuda as kc
from lightcc.common.kernels import sparse
from tests.doubles import kernels

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "csrc"


# ---- loader ---------------------------------------------------------------------------------
def test_source_dirs_order(monkeypatch, tmp_path):
    monkeypatch.delenv(kc.CSRC_ENV, raising=False)
    dirs = kc.source_dirs()
    assert dirs[-1] == CSRC and dirs[-2] == ROOT / "lightcc" / "_csrc"
    monkeypatch.setenv(kc.CSRC_ENV, str(tmp_path))
    assert kc.source_dirs()[0] == tmp_path


def test_find_source_prefers_override(monkeypatch, tmp_path):
    monkeypatch.delenv(kc.CSRC_ENV, raising=False)
    assert kc.find_source("quantize.cu") == CSRC / "quantize.cu"
    assert set(kc.kernel_sources()) >= {"quantize.cu", "topk.cu", "pack.cu"}
    (tmp_path / "quantize.cu").write_text("// override\n")
    monkeypatch.setenv(kc.CSRC_ENV, str(tmp_path))
    assert kc.find_source("quantize.cu") == tmp_path / "quantize.cu"
    assert kc.kernel_sources()["quantize.cu"] == tmp_path / "quantize.cu"
    assert kc.find_source("topk.cu") == CSRC / "topk.cu"      # falls through to csrc/
    with pytest.raises(LightCCError, match="nope.cu.*not found"):
        kc.find_source("nope.cu")


def test_expand_includes_once(tmp_path):
    (tmp_path / "a.cuh").write_text('#pragma once\n#include "b.cuh"\nint a;\n')
    (tmp_path / "b.cuh").write_text("int b;\n")
    (tmp_path / "k.cu").write_text('#include "a.cuh"\n#include "b.cuh"\n#include <cuda_fp16.h>\n'
                                   '#include "missing.cuh"\nint k;\n')
    text = kc.expand_includes(tmp_path / "k.cu")
    assert text.count("int b;") == 1 and "int a;" in text and "int k;" in text
    assert "#include <cuda_fp16.h>" in text            # system headers stay for NVRTC
    assert '#include "missing.cuh"' in text             # unknown local name left alone
    assert '#include "a.cuh"' not in text


def test_real_sources_expand_without_local_includes():
    for path in kc.kernel_sources().values():
        text = kc.expand_includes(path)
        assert '#include "' not in text, path
        assert "lcc_encode_bits" in text or path.name == "pack.cu"


def test_grid_for():
    assert kc.grid_for(0) == 1
    assert kc.grid_for(256) == 1 and kc.grid_for(257) == 2
    assert kc.grid_for(1024, per_thread=4) == 1
    assert kc.grid_for(10 ** 12) == 65536


# ---- imports without CuPy ---------------------------------------------------------------------
def test_modules_import_without_cupy():
    code = (
        "import sys; sys.modules['cupy'] = None\n"
        "from lightcc.common.backends import nccl\n"
        "from lightcc.common.kernels import cuda\n"
        "from lightcc.common.compression import gpu\n"
        "from lightcc.common.exceptions import LightCCError\n"
        "import numpy as np\n"
        "assert not nccl.nccl_available() and not cuda.gpu_available()\n"
        "assert gpu.codec_module(np.zeros(3, np.float32)).__name__ == 'lightcc.common.kernels'\n"
        "for fn in (cuda.cupy_or_raise, lambda: nccl.NCCLCommunicator(None, 'w'),\n"
        "           lambda: gpu.block_amax(np.zeros(4, np.float32), 2)):\n"
        "    try:\n"
        "        fn()\n"
        "    except LightCCError as exc:\n"
        "        assert 'CuPy' in str(exc), exc\n"
        "    else:\n"
        "        raise SystemExit('no LightCCError')\n"
        "assert 'cupy' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
        "print('ok')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr


# ---- a fake CuPy backed by NumPy -------------------------------------------------------------
class FakeArr(np.ndarray):
    """A NumPy array that looks like a CuPy array to the code under test."""

    @property
    def data(self):  # noqa: D401 - mimics cupy.ndarray.data.ptr
        return types.SimpleNamespace(ptr=self.ctypes.data)

    def get(self):
        return np.asarray(self).copy()


FakeArr.__module__ = "cupy._fake"


def _w(fn):
    def wrapped(*args, **kwargs):
        out = fn(*[np.asarray(a) if isinstance(a, FakeArr) else a for a in args], **kwargs)
        return np.asarray(out).view(FakeArr)
    return wrapped


class FakeEvent:
    def __init__(self, done=True):
        self.done = done


class FakeStream:
    def __init__(self, ptr=7, done=True):
        self.ptr = ptr
        self.done = done
        self.waited = []

    def record(self, event=None):
        if event is None:
            return FakeEvent(self.done)
        event.done = self.done
        return event

    def wait_event(self, ev):
        self.waited.append(ev)


def make_fake_cupy():
    cp = types.ModuleType("cupy")
    cp.ndarray = FakeArr
    for name in ("zeros", "ones", "arange", "asarray", "ascontiguousarray", "sort", "ldexp",
                 "isnan", "cumsum"):
        setattr(cp, name, _w(getattr(np, name)))
    cp.empty = _w(np.zeros)             # no garbage: the fake kernels never write
    current = FakeStream(ptr=1)
    runtime = types.SimpleNamespace(getDevice=lambda: 0, getDeviceCount=lambda: 1,
                                    memcpyDeviceToDevice=3, copies=[],
                                    memcpyAsync=lambda *a: runtime.copies.append(a))
    cp.cuda = types.SimpleNamespace(runtime=runtime, Stream=lambda non_blocking=True: FakeStream(),
                                    get_current_stream=lambda: current,
                                    Event=lambda block=False, disable_timing=False: FakeEvent())
    return cp


@pytest.fixture(scope="module")
def ptx_params():
    params = kernels.ptx_params()
    if params is None:
        pytest.skip("nvcc not found (install the CUDA toolkit)")
    return params


@pytest.fixture
def fake_gpu(monkeypatch, ptx_params):
    """compression.gpu wired to a fake CuPy; launches are checked against the PTX."""
    cp = make_fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", cp)
    calls: list[tuple[str, str]] = []

    def get_function(module, func):
        def launch(grid, block, args):
            kernels.check_launch(ptx_params, module, func, grid, block, args,
                                 lambda a: isinstance(a, FakeArr), kc.THREADS)
            calls.append((module, func))
            emulate(func, args)
        return launch

    monkeypatch.setattr(kc, "get_function", get_function)
    from lightcc.common.compression import gpu

    return gpu, cp, calls


def test_gpu_launches_match_kernel_signatures(fake_gpu, ptx_params):
    gpu, cp, calls = fake_gpu
    from lightcc.common.compression.fp import FloatCodec
    from lightcc.common.kernels import floatcast as fc

    x = cp.asarray(np.random.default_rng(0).standard_normal(5000).astype(np.float32))
    for bs in (256, 4999, 10000, 100000):
        gpu.block_amax(x, bs)
    for f in fc.FORMATS.values():
        for scaling in (None, "bucket", "block"):
            codes, scales = gpu.quantize(x, f.name, scaling, 128)
            gpu.dequantize(codes, f, scales, scaling, 128)
            codec = FloatCodec(f, scaling, 128)
            payload = cp.zeros(2 * codec.nbytes(x.size), np.uint8)
            gpu.encode_into(codec, x, payload[:codec.nbytes(x.size)])
            gpu.decode_into(codec, payload, x.size, cp.zeros(x.size, np.float32), True, nsrc=2)
        stacked = cp.zeros(2 * x.size, f.code_dtype)
        gpu.decode_sum(stacked, f, cp.ones(2, np.float32), x.size, nsrc=2)
    big = cp.asarray(np.random.default_rng(1).standard_normal(200_000).astype(np.float32))
    ties = cp.asarray(np.ones(200_000, np.float32))     # the sample cannot separate: retry loop
    for arr, k in ((x, 50), (big, 2000), (ties, 2000)):
        got = gpu.topk_indices(arr, k).get()
        np.testing.assert_array_equal(got, sparse.topk_indices(np.asarray(arr), k))
    out = cp.zeros(100, np.float32)
    for dt in (np.int32, np.int64):
        gpu.scatter_add(cp.arange(10, dtype=dt), cp.ones(10, np.float32), out)
    for dt in (np.float32, np.float16, np.uint8, np.int64):
        parts = [cp.zeros(n, dt) for n in (3, 0, 5000, 1)]
        _POINTEES.update({p.data.ptr: np.asarray(p) for p in parts})
        bucket = gpu.pack(parts)
        gpu.unpack(bucket, parts)
    parts = [cp.zeros(n, np.float32) for n in (10, 20)]
    _POINTEES.update({p.data.ptr: np.asarray(p) for p in parts})
    gpu.unpack(gpu.pack(parts, scale=0.5), parts, scale=2.0)
    launched = {f for _, f in calls}
    every = {name for entries in ptx_params.values() for name in entries}
    assert every - launched == set(), f"kernels never launched: {sorted(every - launched)}"


def test_gpu_argument_errors(fake_gpu):
    gpu, cp, _ = fake_gpu
    from lightcc.common.kernels import floatcast as fc

    with pytest.raises(InvalidArgumentError, match="CuPy array"):
        gpu.encode(np.zeros(4, np.float32), fc.E4M3)
    with pytest.raises(InvalidArgumentError, match="float32"):
        gpu.encode(cp.zeros(4, np.float64), fc.E4M3)
    with pytest.raises(InvalidArgumentError, match="3 indices but 2 values"):
        gpu.scatter_add(cp.zeros(3, np.int32), cp.zeros(2, np.float32), cp.zeros(4, np.float32))
    with pytest.raises(InvalidArgumentError, match="smaller than"):
        gpu.unpack(cp.zeros(3, np.float32), [cp.zeros(4, np.float32)])
    with pytest.raises(InvalidArgumentError, match="needs float32"):
        gpu.pack([cp.zeros(4, np.float16)], scale=0.5)
    assert gpu.codec_module(cp.zeros(2, np.float32)) is gpu
    assert gpu.topk_indices(cp.zeros(5, np.float32), 5).tolist() == [0, 1, 2, 3, 4]
    assert gpu.topk_indices(cp.zeros(5, np.float32), 0).size == 0


# ---- NumPy emulation of the kernels (their documented semantics) ------------------------------
_POINTEES: dict[int, np.ndarray] = {}     # device pointer -> array, for pack/unpack tables


def _arr(a):
    return None if not isinstance(a, FakeArr) else np.asarray(a)


def emulate(func: str, args: tuple) -> None:
    """The kernels' NumPy emulation (tests/doubles/kernels.py) on FakeArr arguments."""
    kernels.emulate(func, args, lambda v: _arr(v) if isinstance(v, FakeArr) else None,
                    lambda ptr, dtype, n: _POINTEES[ptr])


def test_gpu_orchestration_matches_cpu(fake_gpu):
    """gpu.py's bookkeeping (offsets, retries, payload layout) gives the CPU codecs' results."""
    gpu, cp, _ = fake_gpu
    from lightcc.common.compression.fp import FloatCodec
    from lightcc.common.kernels import floatcast as fc
    from lightcc.common.kernels import sparse

    rng = np.random.default_rng(3)
    x = (rng.standard_normal(300_001) * np.exp2(rng.integers(-20, 20, 300_001))).astype(np.float32)
    x[[5, 77, 1000]] = [np.nan, np.inf, -np.inf]
    x[::101] = 2.0                                          # ties
    dx = cp.asarray(x)
    for k in (1, 3000, 40_000, 300_000):
        np.testing.assert_array_equal(gpu.topk_indices(dx, k).get(), sparse.topk_indices(x, k))
    for f in fc.FORMATS.values():
        for scaling in (None, "bucket", "block"):
            codec = FloatCodec(f, scaling, 256)
            nb = codec.nbytes(x.size)
            want = np.empty(nb, np.uint8)
            codec.encode_into(x, want)
            got = cp.zeros(2 * nb + 1, np.uint8)
            gpu.encode_into(codec, dx, got[1:nb + 1])           # odd offset, like fp.py slices
            got[nb + 1:] = got[1:nb + 1]
            np.testing.assert_array_equal(got[1:nb + 1].get(), want)
            acc = np.ones(x.size, np.float32)
            for _ in range(2):
                codec.decode_into(want, x.size, acc, True)
            dacc = cp.ones(x.size, np.float32)
            gpu.decode_into(codec, got[1:], x.size, dacc, True, nsrc=2)
            np.testing.assert_array_equal(dacc.get(), acc)
    parts = [cp.asarray(rng.standard_normal(n).astype(np.float32)) for n in (7, 0, 9000, 1)]
    for p in parts:
        _POINTEES[p.data.ptr] = np.asarray(p)
    host = [p.get() for p in parts]
    bucket = gpu.pack(parts, scale=0.5)
    np.testing.assert_array_equal(bucket.get(), np.concatenate(host) * np.float32(0.5))
    gpu.unpack(bucket, parts, scale=2.0)
    for h, p in zip(host, parts):
        np.testing.assert_array_equal(p.get(), h)
    out = cp.zeros(10, np.float32)
    gpu.scatter_add(cp.asarray(np.array([1, 3], np.int64)), cp.ones(2, np.float32), out)
    assert out.get().tolist() == [0, 1, 0, 1, 0, 0, 0, 0, 0, 0]


# ---- NCCL communicator logic against a fake NCCL ---------------------------------------------
class FakeNcclError(RuntimeError):
    pass


class FakeComm:
    def __init__(self, size, uid, rank):
        self.calls = []
        self.async_error = None
        self.aborted = False

    def __getattr__(self, name):
        if name in ("allReduce", "reduceScatter", "allGather", "broadcast", "bcast", "reduce",
                    "send", "recv"):
            return lambda *args: self.calls.append((name, args))
        raise AttributeError(name)

    def check_async_error(self):
        if self.async_error:
            raise FakeNcclError(self.async_error)

    def abort(self):
        self.aborted = True

    def destroy(self):
        self.calls.append(("destroy", ()))


class FakeMPIComm:
    def __init__(self, rank=0, size=3):
        self.rank, self.size = rank, size

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.size

    def bcast(self, obj, root=0):
        return obj

    def Barrier(self):
        pass


@pytest.fixture
def fake_nccl(monkeypatch):
    cp = make_fake_cupy()
    groups = []
    nccl = types.SimpleNamespace(
        available=True, NcclCommunicator=FakeComm, NcclError=FakeNcclError,
        get_unique_id=lambda: b"x" * 128, groupStart=lambda: groups.append("start"),
        groupEnd=lambda: groups.append("end"),
        **{c: i for i, c in enumerate(
            ["NCCL_SUM", "NCCL_PROD", "NCCL_MAX", "NCCL_MIN", "NCCL_INT8", "NCCL_UINT8",
             "NCCL_INT32", "NCCL_UINT32", "NCCL_INT64", "NCCL_UINT64", "NCCL_FLOAT16",
             "NCCL_FLOAT32", "NCCL_FLOAT64", "NCCL_BFLOAT16"])})
    cuda_mod = types.ModuleType("cupy.cuda")
    cuda_mod.__dict__.update(vars(cp.cuda))
    cuda_mod.nccl = nccl
    cp.cuda = cuda_mod
    monkeypatch.setitem(sys.modules, "cupy", cp)
    monkeypatch.setitem(sys.modules, "cupy.cuda", cuda_mod)
    monkeypatch.setitem(sys.modules, "cupy.cuda.nccl", nccl)
    from lightcc.common.backends import nccl as mod

    return mod, cp, nccl, groups


def test_nccl_collectives_issue_expected_calls(fake_nccl):
    mod, cp, nccl, groups = fake_nccl
    c = mod.NCCLCommunicator(FakeMPIComm(rank=1, size=3), "world", timeout=1.0)
    buf = cp.zeros(12, np.float32)
    c.allreduce(buf, "max")
    name, args = c.comm.calls[-1]
    assert name == "allReduce" and args[2:5] == (12, nccl.NCCL_FLOAT32, nccl.NCCL_MAX)
    c.allgatherv(cp.zeros(4, np.float32), buf, [4, 4, 4])
    assert c.comm.calls[-1][0] == "allGather" and c.comm.calls[-1][1][2] == 16  # bytes
    c.comm.calls.clear()
    c.allgatherv(cp.zeros(5, np.float32), buf, [3, 5, 4])       # unequal: grouped broadcasts
    roots = [(a[2], a[4]) for n, a in c.comm.calls if n == "broadcast"]
    assert roots == [(12, 0), (20, 1), (16, 2)] and groups[-2:] == ["start", "end"]
    c.comm.calls.clear()
    c.reduce_scatterv(buf, cp.zeros(5, np.float32), [3, 5, 4])
    assert [(a[2], a[5]) for n, a in c.comm.calls if n == "reduce"] == [(3, 0), (5, 1), (4, 2)]
    c.comm.calls.clear()
    c.alltoallv(cp.zeros(6, np.float32), [1, 2, 3], cp.zeros(6, np.float32), [2, 2, 2])
    sends = [(a[1], a[3]) for n, a in c.comm.calls if n == "send"]
    recvs = [(a[1], a[3]) for n, a in c.comm.calls if n == "recv"]
    assert sends == [(4, 0), (12, 2)] and recvs == [(8, 0), (8, 2)]
    assert cp.cuda.runtime.copies and cp.cuda.runtime.copies[-1][2] == 8   # own block, 2 floats
    c.bcast(buf, root=2)
    assert c.comm.calls[-1][0] == "bcast" and c.comm.calls[-1][1][1:4] == (48, nccl.NCCL_UINT8, 2)
    with pytest.raises(TypeError, match="cannot reduce"):
        c.allreduce(cp.zeros(2, np.complex64))
    n_calls = len(c.comm.calls)
    for op in ("band", "bor", "bxor"):       # NCCL has no bitwise ops: refused, nothing issued
        with pytest.raises(InvalidArgumentError, match=f"no bitwise reduction \\({op}\\)"):
            c.allreduce(cp.zeros(2, np.int32), op)
    assert len(c.comm.calls) == n_calls
    assert c.stats.calls["allreduce"] == 1


def test_nccl_p2p_is_deferred_and_grouped(fake_nccl):
    mod, cp, nccl, groups = fake_nccl
    c = mod.NCCLCommunicator(FakeMPIComm(rank=0, size=2), "world", timeout=1.0)
    r1 = c.isend(cp.zeros(3, np.float32), 1)
    r2 = c.irecv(cp.zeros(3, np.float32), 1)
    assert not any(n in ("send", "recv") for n, _ in c.comm.calls)   # nothing issued yet
    n_groups = groups.count("start")
    r2.wait()
    assert [n for n, _ in c.comm.calls] == ["send", "recv"]
    assert groups.count("start") == n_groups + 1
    assert r1.test()                                                 # same group, done
    r1.wait()
    assert [n for n, _ in c.comm.calls] == ["send", "recv"]          # not issued twice


def test_nccl_timeout_and_async_error_raise(fake_nccl, monkeypatch):
    mod, cp, nccl, _ = fake_nccl
    monkeypatch.setattr(mod, "_SLEEP", 0.0)
    c = mod.NCCLCommunicator(FakeMPIComm(), "local", timeout=0.05)
    c.stream.done = False                                           # the collective never ends
    with pytest.raises(CollectiveError, match=r"allreduce on 'local' did not finish within"):
        c.allreduce(cp.zeros(4, np.float32))
    assert c.comm.aborted
    with pytest.raises(CollectiveError, match="aborted"):
        c.allreduce(cp.zeros(4, np.float32))
    c2 = mod.NCCLCommunicator(FakeMPIComm(), "cross", timeout=5.0)
    c2.comm.async_error = "unhandled system error"
    with pytest.raises(CollectiveError, match="unhandled system error"):
        c2.bcast(cp.zeros(4, np.float32), 0)
    assert c2.comm.aborted


def test_nccl_nonblocking_orders_caller_stream(fake_nccl):
    mod, cp, nccl, _ = fake_nccl
    c = mod.NCCLCommunicator(FakeMPIComm(), "world", blocking=False)
    cur = cp.cuda.get_current_stream()
    before = len(cur.waited)
    c.allreduce(cp.zeros(4, np.float32))
    assert len(cur.waited) == before + 1            # caller's stream waits on the collective
    assert c.stream.waited                          # and the collective waited on the caller
    c.synchronize()
