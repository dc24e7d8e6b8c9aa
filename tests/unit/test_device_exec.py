"""The engine's GPU path (execution/gpu.py, backends/factory.py, backends/staged.py) against the
CuPy/NCCL doubles, with thread ranks: results equal the host path's bit for bit, the stream and
event order is the documented one with no host synchronization, buckets never mix host and
device tensors, and the MPI staging and CPU-reduce paths copy through pinned memory.
"""
from __future__ import annotations

import math
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from lightcc.common import dtypes
from lightcc.common import gpu_arrays as device
from lightcc.common.backends.staged import StagedCommunicator
from lightcc.common.control.messages import Coll, Request, Response
from lightcc.common.engine import Handle
from lightcc.common.exceptions import LightCCError
from lightcc.common.execution import fusion, run
from lightcc.common.execution.group import ExecSettings, Group
from lightcc.common.execution.reduction import LocalEntry
from lightcc.common.topology import build
from tests.doubles import fake_cupy, fake_nccl, install

BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.fixture
def gpu(monkeypatch):
    return install(monkeypatch)


def _data(rank: int, n: int, dtype: str, seed: int = 0, exact: bool = True) -> np.ndarray:
    """Data in ``dtype``: integer-valued when ``exact`` (sums do not depend on the order),
    else normal floats (fp16/bf16 results then depend on rounding)."""
    rng = np.random.default_rng([seed, rank, n])
    if exact or dtype in dtypes.INTEGER or dtype == "bool":
        x = rng.integers(-8, 9, n).astype(np.float32)
    else:
        x = rng.standard_normal(n).astype(np.float32) * 3
    if dtype == "bfloat16":
        return x.astype(BF16)
    if dtype == "bool":
        return x > 0
    return x.astype(dtype)


def _device(cupy, x: np.ndarray) -> device.DeviceTensor:
    """What the torch layer hands the core: bf16 as int16 bits, bool as uint8."""
    if x.dtype == BF16:
        return device.adopt(device.DeviceTensor(cupy.asarray(x.view(np.int16)), BF16), "t")
    if x.dtype == bool:
        return device.adopt(device.DeviceTensor(cupy.asarray(x.view(np.uint8)), bool), "t")
    return device.adopt(cupy.asarray(x), "t")


def _host_result(x) -> np.ndarray:
    if isinstance(x, fake_cupy.ndarray):
        return x.get()
    return np.asarray(x)


def run_bucket(gpu, size: int, shapes: list, dtype: str = "float32", op: str = "sum",
               pre: float = 1.0, post: float = 1.0, comp: str = "none", on_device: bool = True,
               local_size: int = 0, seed: int = 0, exact: bool = True,
               **settings) -> list[list[np.ndarray]]:
    """One allreduce bucket on ``size`` thread ranks; every rank's results as NumPy arrays."""
    worlds = fake_nccl.thread_worlds(size)

    def rank(r: int) -> list[np.ndarray]:
        topo = build(worlds[r], ["h"] * size, local_size)
        group = Group(0, tuple(range(size)), topo, ExecSettings(**settings))
        resps, entries = [], []
        for i, shape in enumerate(shapes):
            req = Request(Coll.ALLREDUCE, f"t{i}", dtype, tuple(shape), op, -1, pre, post, (),
                          comp, 0, on_device)
            x = _data(r, math.prod(shape), dtype, seed + i, exact).reshape(shape)
            arr = _device(gpu.cupy, x) if on_device else x
            resps.append(Response(req))
            entries.append(LocalEntry(req.key, arr, None, Handle(req), request=req))
        results = run.execute(group, resps, entries)
        for e, res in zip(entries, results):
            e.handle._set(result=res)
        out = [e.handle.wait() for e in entries]
        group.free()
        return out

    results = fake_nccl.run_ranks(size, rank)       # read back after every rank is done
    return [[_host_result(x) for x in res] for res in results]


def _same(a: list, b: list) -> None:
    for ra, rb in zip(a, b):
        for x, y in zip(ra, rb):
            assert x.dtype == y.dtype or x.view(np.uint8).size == y.view(np.uint8).size
            np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8))


# ---- results: the device path gives the host path's bits -------------------------------------
@pytest.mark.parametrize("dtype,op,pre,post", [
    ("float32", "average", 1.0, 1.0), ("float32", "sum", 0.5, 3.0),
    ("float16", "average", 1.0, 1.0), ("bfloat16", "sum", 2.0, 0.25),
    ("int32", "average", 1.0, 1.0), ("float64", "max", 1.0, 1.0),
    ("bool", "sum", 1.0, 1.0), ("int64", "min", 1.0, 1.0), ("int16", "average", 1.0, 1.0),
    ("uint16", "max", 1.0, 1.0), ("int32", "sum", 2.0, 1.0), ("int64", "average", 1.5, 0.5),
    ("int32", "sum", 1.0, 0.3)])
def test_fused_bucket_matches_host_path(gpu, dtype, op, pre, post):
    shapes = [(3, 5), (7,), (2, 2, 2)]           # flat: both sum in rank order
    dev = run_bucket(gpu, 3, shapes, dtype, op, pre, post, exact=False)
    host = run_bucket(gpu, 3, shapes, dtype, op, pre, post, on_device=False, exact=False)
    _same(dev, host)


@pytest.mark.parametrize("shapes", [[(4,)], [(3, 5), (7,)]])       # alone, and fused
def test_integer_scaling_on_device_is_horovods(gpu, shapes):
    """Horovod scales integers by a float64 product truncated toward zero, before the sum
    (prescale) and after it (postscale, with an Average's 1/size folded in). The device path
    once skipped both (int32 prescale 2: [-8 0 -13 7] where the host gives [-16 0 -26 14])."""
    size, pre, post = 3, 2.0, 0.3
    got = run_bucket(gpu, size, shapes, "int32", "sum", pre, post)
    for i, shape in enumerate(shapes):
        n = math.prod(shape)
        total = sum(np.trunc(_data(r, n, "int32", i).astype(np.float64) * pre)
                    for r in range(size))
        want = np.trunc(total * post).astype(np.int32).reshape(shape)
        for r in range(size):
            np.testing.assert_array_equal(got[r][i], want)


@pytest.mark.parametrize("algorithm", ["flat", "ring", "tree", "hierarchical", "2d"])
@pytest.mark.parametrize("backend", ["nccl", "mpi"])
def test_every_algorithm_over_both_backends(gpu, algorithm, backend):
    shapes = [(100_000,)]                       # one large tensor: reduced in place
    dev = run_bucket(gpu, 4, shapes, algorithm=algorithm, backend=backend, local_size=2)
    host = run_bucket(gpu, 4, shapes, on_device=False)
    _same(dev, host)


@pytest.mark.parametrize("comp", ["fp16", "bf16", "fp8", "fp8:e5m2:block:64", "topk:0.05",
                                  "powersgd"])
def test_compressors_on_device_match_host(gpu, comp):
    shapes = [(64, 48), (3000,)]
    dev = run_bucket(gpu, 3, shapes, comp=comp, seed=5)
    host = run_bucket(gpu, 3, shapes, comp=comp, on_device=False, seed=5)
    _same(dev, host)
    assert any(f.startswith(("lcc_quantize", "lcc_topk")) for _, f in gpu.launches) or \
        comp == "powersgd"


def test_large_compressed_bucket_on_nccl_uses_the_collective_scheme(gpu):
    """A chunk above twophase.PIECE_BYTES is pipelined over send/recv on the host; over NCCL
    that exchange would deadlock (its groups do not match), so device buckets never use it."""
    shapes = [(700_000,)]
    dev = run_bucket(gpu, 2, shapes, comp="fp16", backend="nccl", seed=3)
    _same(dev, run_bucket(gpu, 2, shapes, comp="fp16", on_device=False, seed=3))
    assert {r[2][0] for r in gpu.log.of("nccl")} == {"allgather", "send", "recv"}


def test_single_rank_average_returns_input_on_device(gpu):
    out = run_bucket(gpu, 1, [(4,), (5,)], "float16", "average")
    np.testing.assert_array_equal(out[0][0], _data(0, 4, "float16"))


# ---- streams and events -----------------------------------------------------------------------
def test_stream_order_and_no_host_sync(gpu):
    """ready event -> pack -> NCCL (after the engine stream) -> unpack -> done event; the
    consumer's stream waits on it; nothing waits on the host."""
    run_bucket(gpu, 2, [(10,), (20,)], "float32", "average", backend="nccl")
    log = gpu.log.records
    log = log[:log.index(("sync", -1, "ndarray.get"))]      # the test reading results
    assert not [r for r in log if r[0] == "sync"], [r for r in log if r[0] == "sync"]
    for rank in range(2):
        nccl = [i for i, r in enumerate(log) if r[0] == "nccl" and r[2] == ("allreduce", rank)
                and i > 0]
        call = nccl[-1]                               # the bucket (the first is the flag)
        comm_stream = log[call][1]
        # the two ranks' records interleave: this rank's pack is the last one on a stream
        # whose event, recorded after it, NCCL's stream waits for before the call
        packs = [i for i, r in enumerate(log[:call]) if r[0] == "launch"
                 and r[2].startswith("lcc_pack")]

        def ordered_before_call(pack):
            events = [r[2] for r in log[pack:call] if r[0] == "record" and r[1] == log[pack][1]]
            return any(("wait", comm_stream, e) in log[pack:call] for e in events)

        mine = [i for i in packs if ordered_before_call(i)]
        assert packs and mine, "NCCL's stream did not wait for the pack kernel"
        pack = mine[-1]
        engine = log[pack][1]
        assert engine not in (0, comm_stream)
        ready = [r[2] for r in log[:pack] if r[0] == "record" and r[1] == 0]
        waited = [r[2] for r in log[:pack] if r[0] == "wait" and r[1] == engine]
        assert set(ready) & set(waited), "engine stream never waited on the producer's event"
        unpack = next(i for i, r in enumerate(log) if i > call and r[0] == "launch"
                      and r[2].startswith("lcc_unpack") and r[1] == engine)
        after = [r[2] for r in log[call:unpack] if r[0] == "record" and r[1] == comm_stream]
        assert any(("wait", engine, e) in log[call:unpack] for e in after), \
            "unpack was not ordered after the collective"
        done = next(r[2] for r in log[unpack:] if r[0] == "record" and r[1] == engine)
        assert ("wait", 0, done) in log[unpack:], "the consumer never waited for the result"


def test_consumer_is_the_callers_current_stream(gpu):
    cupy = gpu.cupy
    worlds = fake_nccl.thread_worlds(1)
    group = Group(0, (0,), build(worlds[0], ["h"], 0), ExecSettings(backend="nccl"))
    side = cupy.cuda.Stream(non_blocking=True)
    with side:
        x = device.adopt(cupy.ones(8, np.float32), "x")
    req = Request(Coll.ALLREDUCE, "x", "float32", (8,), "sum", -1, 2.0, 1.0, device=True)
    entry = LocalEntry(req.key, x, None, Handle(req), request=req)
    (res,) = run.execute(group, [Response(req)], [entry])
    entry.handle._set(result=res)
    waits_before = len(gpu.log.of("wait", side.ptr))
    with side:
        np.testing.assert_array_equal(entry.handle.wait().get(), np.full(8, 2.0, np.float32))
    assert len(gpu.log.of("wait", side.ptr)) == waits_before + 1
    assert gpu.log.of("record", side.ptr)[0][2] in [w[2] for w in gpu.log.of("wait")]
    group.free()


# ---- buckets: host and device never share one ---------------------------------------------------
def test_fusion_keeps_host_and_device_apart():
    def resp(name: str, dev: bool) -> Response:
        return Response(Request(Coll.ALLREDUCE, name, "float32", (10,), "sum", device=dev))

    resps = [resp("a", False), resp("b", True), resp("c", False), resp("d", True)]
    assert fusion.plan(resps, 1 << 20) == [[0, 2], [1, 3]]
    assert fusion.fusion_key(resps[0]) != fusion.fusion_key(resps[1])


def test_controller_reports_host_device_mismatch():
    from lightcc.common.control.controller import validate

    a = Request(Coll.ALLREDUCE, "g", "float32", (4,), "sum")
    resp = validate((0, 1), {0: a, 1: a._replace(device=True)})
    assert resp.error_kind == "mismatch" and "memory GPU" in resp.error, resp.error


# ---- backends: routing, staging, CPU reduce -----------------------------------------------------
def _on_engine_streams(gpu, kind: str) -> None:
    """Every ``kind`` record is on a stream that ran the bucket's pack kernel (the engine's)."""
    engine = {r[1] for r in gpu.log.of("launch") if r[2].startswith("lcc_pack")}
    assert engine and engine.isdisjoint({0}), engine
    assert {r[1] for r in gpu.log.of(kind)} <= engine, (gpu.log.of(kind), engine)


def test_mpi_backend_stages_through_pinned_memory(gpu):
    dev = run_bucket(gpu, 2, [(50,), (30,)], backend="mpi")
    _same(dev, run_bucket(gpu, 2, [(50,), (30,)], on_device=False))
    copies = gpu.log.of("copy")
    assert copies and all(info[2] == "pinned" for _, _, info in copies), copies
    _on_engine_streams(gpu, "copy")
    assert {info[0] for _, _, info in copies} == {1, 2}        # both directions
    assert not gpu.log.of("nccl")


def test_cpu_reduce_copies_bucket_once_each_way(gpu):
    dev = run_bucket(gpu, 2, [(50,), (30,)], cpu_reduce=True, backend="nccl")
    _same(dev, run_bucket(gpu, 2, [(50,), (30,)], on_device=False))
    copies = gpu.log.of("copy")
    assert sorted(info[:2] for _, _, info in copies) == [(1, 320), (1, 320), (2, 320), (2, 320)]
    _on_engine_streams(gpu, "copy")
    # NCCL carried only the backend agreement flag, not the bucket
    assert [r[2] for r in gpu.log.of("nccl")] == []


def _device_backends(size: int, setting: str, before: Any = None) -> list[str]:
    """Each thread rank's device communicator class (or error message) for ``setting``."""
    from lightcc.common.backends import factory

    worlds = fake_nccl.thread_worlds(size)

    def rank(r: int) -> str:
        if before is not None:
            before(r)
        topo = build(worlds[r], ["h"] * size, 0)
        try:
            comms = factory.make_device_comms(topo, setting, None)
        except LightCCError as exc:
            return str(exc)
        kind = type(comms.topo.world).__name__
        comms.free()
        return kind

    return fake_nccl.run_ranks(size, rank)


@pytest.mark.parametrize("setting,missing_on,want", [
    ("auto", None, "nccl"), ("auto", 1, "mpi"), ("mpi", None, "mpi"), ("nccl", 1, "error")])
def test_backend_choice_is_agreed(gpu, monkeypatch, setting, missing_on, want):
    from lightcc.common.backends import factory

    monkeypatch.setattr(factory, "nccl_usable", lambda: fake_nccl._tls.__dict__.get("ok", True))

    def before(r: int) -> None:
        fake_nccl._tls.ok = r != missing_on

    got = _device_backends(2, setting, before)
    if want == "error":
        assert all("LCC_BACKEND=nccl" in g for g in got), got
        assert "this rank" in got[1] and "another rank" in got[0]
    else:
        assert got == ["NCCLCommunicator" if want == "nccl" else "StagedCommunicator"] * 2


@pytest.mark.parametrize("setting", ["auto", "nccl"])
def test_ranks_sharing_a_gpu_never_get_nccl(gpu, monkeypatch, setting):
    """NCCL refuses two ranks on one GPU ("Duplicate GPU detected" at setup): ``auto`` takes
    MPI staging on every rank when any two share one, ``nccl`` raises on every rank."""
    from lightcc.common.backends import factory

    monkeypatch.setattr(factory, "device_key", lambda device: 7)   # ranks 0-2: the same GPU
    got = _device_backends(3, setting)
    if setting == "auto":
        assert got == ["StagedCommunicator"] * 3
    else:
        assert all("ranks 0 and 1" in g and "same GPU" in g for g in got), got


def test_staged_communicator_calls(gpu):
    cupy = gpu.cupy
    (world,) = fake_nccl.thread_worlds(1)
    comm = StagedCommunicator(world)
    buf = cupy.arange(6, dtype=np.float32)
    comm.allreduce(buf, "sum")
    recv = cupy.zeros(6, np.float32)
    comm.allgatherv(buf, recv, [6])
    np.testing.assert_array_equal(recv.get(), np.arange(6))
    comm.bcast(buf, 0)
    out = cupy.zeros(6, np.float32)
    comm.alltoallv(buf, [6], out, [6])
    np.testing.assert_array_equal(out.get(), np.arange(6))
    assert comm.stats is world.stats and comm.is_device
    kinds = [info[0] for _, _, info in gpu.log.of("copy")]
    assert kinds == [2, 1, 2, 1, 2, 2, 1], kinds    # the root's bcast does not copy back
    comm.free()


@pytest.mark.parametrize("on_gpu", [True, False])
def test_tensor_that_requires_grad_gets_a_lightcc_error(gpu, on_gpu):
    """The core API takes plain arrays: a torch tensor that requires grad (on the GPU: DLPack
    refuses to export it; on the CPU: NumPy conversion refuses) gets InvalidArgumentError
    naming the fix, not torch's RuntimeError."""
    import torch

    from lightcc.common import api
    from lightcc.common.exceptions import InvalidArgumentError
    from lightcc.common.kernels import cuda as kc
    from tests.doubles.fake_torch import cuda_tensor

    t = torch.ones(4, requires_grad=True)
    if on_gpu:
        t = cuda_tensor(t)
    with pytest.raises(InvalidArgumentError, match=r"requires grad.*detach\(\)"):
        api._as_array(t, "allreduce 'x'")
    if on_gpu:
        with pytest.raises(InvalidArgumentError, match="detach"):
            kc.as_cupy(t)
    assert api._as_array(t.detach(), "allreduce 'x'") is not None
