"""CUDA kernels against the CPU codecs (bit-exact where the docs promise it). Needs a GPU."""
from __future__ import annotations

import numpy as np
import pytest

from .gpu_common import require_gpu

pytestmark = pytest.mark.gpu
cupy = require_gpu()

from lightcc.common.compression import gpu  # noqa: E402
from lightcc.common.compression.fp import FloatCodec  # noqa: E402
from lightcc.common.kernels import cuda as kc  # noqa: E402
from lightcc.common.kernels import floatcast as fc  # noqa: E402
from lightcc.common.kernels import sparse  # noqa: E402

FLT_MIN = np.float32(1.17549435e-38)


def _data(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * np.exp2(rng.integers(-20, 20, n))).astype(np.float32)
    x[rng.integers(0, n, 8)] = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-42, 7e4, -3e38]
    return x


def _same_bits(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b))


def test_every_module_compiles_on_device():
    for name in kc.kernel_sources():
        mod = kc.get_module(name)
        assert kc.get_module(name) is mod          # cached per process and device


@pytest.mark.parametrize("bs", [1, 32, 256, 1000, 8192, 8193, 100_000, 1 << 22])
def test_block_amax_matches_cpu(bs):
    x = _data(1_000_003, seed=bs)
    got = gpu.block_amax(cupy.asarray(x), bs).get()
    np.testing.assert_array_equal(got, fc.block_amax(x, bs))


@pytest.mark.parametrize("fmt", list(fc.FORMATS))
@pytest.mark.parametrize("scaling", [None, "bucket", "block"])
def test_quantize_roundtrip_bit_exact(fmt, scaling):
    f = fc.FORMATS[fmt]
    x = _data(300_001, seed=len(fmt))
    codec = FloatCodec(f, scaling, 256)
    cpu_payload = np.empty(codec.nbytes(x.size), np.uint8)
    codec.encode_into(x, cpu_payload)
    dev_payload = cupy.empty(codec.nbytes(x.size), np.uint8)
    gpu.encode_into(codec, cupy.asarray(x), dev_payload)
    np.testing.assert_array_equal(dev_payload.get(), cpu_payload)
    want = np.zeros(x.size, np.float32)
    codec.decode_into(cpu_payload, x.size, want, False)
    got = cupy.zeros(x.size, np.float32)
    gpu.decode_into(codec, dev_payload, x.size, got, False)
    got = got.get()
    tiny = np.abs(want) < FLT_MIN            # the one documented difference: FTZ on the GPU
    assert _same_bits(got, want)[~tiny].all()
    assert (got[tiny] == 0).all() or np.allclose(got[tiny], want[tiny], atol=FLT_MIN)


@pytest.mark.parametrize("fmt", ["fp16", "e4m3"])
def test_decode_payload_sums_sources_in_order(fmt):
    f = fc.FORMATS[fmt]
    codec = FloatCodec(f, "block", 128)
    n, p = 10_007, 5
    nb = codec.nbytes(n)
    payloads = np.empty(nb * p, np.uint8)
    for r in range(p):
        codec.encode_into(_data(n, seed=r), payloads[r * nb:(r + 1) * nb])
    want = np.full(n, 0.25, np.float32)
    for r in range(p):
        codec.decode_into(payloads[r * nb:(r + 1) * nb], n, want, True)
    got = cupy.full(n, 0.25, np.float32)
    gpu.decode_into(codec, cupy.asarray(payloads), n, got, True, nsrc=p)
    assert _same_bits(got.get(), want).all()


def test_saturation_never_makes_inf():
    x = np.array([1e30, -1e30, 65519.0, 65520.0, 3.4e38, 500.0, 60000.0], np.float32)
    for f in fc.FORMATS.values():
        codes = gpu.encode(cupy.asarray(x), f).get()
        vals = fc.decode(codes, f)
        assert np.isfinite(vals).all(), (f.name, vals)
        assert np.abs(vals).max() == f.max


@pytest.mark.parametrize("n,k", [(1000, 10), (100_000, 1), (1 << 20, 10_486), (3_000_001, 30_000)])
def test_topk_matches_cpu(n, k):
    x = _data(n, seed=k)
    x[::97] = 1.0                                     # many ties
    got = gpu.topk_indices(cupy.asarray(x), k).get()
    want = sparse.topk_indices(x, k)
    assert got.size == k
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("case", ["all-equal", "k=n", "k=1-nan", "zeros-and-inf", "odd-n"])
def test_topk_edge_cases_match_cpu(case):
    """The radix select and the ordered emit against the CPU kernel where ties or non-finite
    values decide: every value equal (only the index breaks ties), k = n, NaN and Inf at the
    top, n not a multiple of 32 (the last bitmask word is partial)."""
    rng = np.random.default_rng(11)
    n, k = 200_003, 2_000
    x = rng.standard_normal(n).astype(np.float32)
    if case == "all-equal":
        x[:] = 0.5
    elif case == "k=n":
        n, k = 5_001, 5_001
        x = x[:n].copy()
    elif case == "k=1-nan":
        k = 1
        x[[10, 20]] = [np.inf, np.nan]
    elif case == "zeros-and-inf":
        x[:] = 0.0
        x[rng.integers(0, n, 50)] = -np.inf
    else:
        n, k = 1_000_037, 9_999
        x = rng.standard_normal(n).astype(np.float32)
        x[::3] = 2.0
    got = gpu.topk_indices(cupy.asarray(x), k).get()
    np.testing.assert_array_equal(got, sparse.topk_indices(x, k))


@pytest.mark.parametrize("fmt", list(fc.FORMATS))
@pytest.mark.parametrize("offset", [0, 1, 3])
def test_encode_decode_vector_and_scalar_paths_agree(fmt, offset):
    """Views that start 4 or 12 bytes into an allocation take the kernels' scalar loop, aligned
    ones the 8-wide vector loop; n % 8 != 0 exercises the tail. Both match the CPU codec."""
    f = fc.FORMATS[fmt]
    x = _data(100_013, seed=offset)
    dev = cupy.asarray(x)[offset:]
    host = x[offset:]
    exps = fc.scale_exponents(fc.block_amax(host, 64), f.max)
    codes = cupy.zeros(host.size + offset, f.code_dtype)[offset:]
    gpu.encode(dev, f, cupy.asarray(exps.astype(np.int32)), 64, out=codes)
    want = fc.encode(host, f, exps.astype(np.int64), 64)
    np.testing.assert_array_equal(codes.get(), want)
    acc_host = np.full(host.size, 0.5, np.float32)
    fc.decode(want, f, fc.exps_to_scales(exps), 64, out=acc_host, accumulate=True)
    acc = cupy.full(host.size + offset, 0.5, np.float32)[offset:]
    gpu.decode(codes, f, cupy.asarray(fc.exps_to_scales(exps)), 64, out=acc, accumulate=True)
    got = acc.get()
    tiny = np.abs(acc_host) < FLT_MIN
    assert _same_bits(got, acc_host)[~tiny].all()


@pytest.mark.parametrize("offset", [0, 1])
def test_pack_unaligned_views_and_scale(offset):
    """Tensors that start off a 16-byte boundary take pack's scalar loop; aligned ones the
    16-byte loop (the bucket slot of the second tensor is unaligned when the first has an odd
    size)."""
    rng = np.random.default_rng(3)
    host = [rng.standard_normal(s).astype(np.float32) for s in (4097, 10_001, 7)]
    dev = [cupy.asarray(np.concatenate([np.zeros(offset, np.float32), h]))[offset:]
           for h in host]
    bucket = gpu.pack(dev, scale=0.25)
    np.testing.assert_array_equal(bucket.get(), np.concatenate(host) * np.float32(0.25))
    gpu.unpack(bucket, dev, scale=4.0)
    for h, d in zip(host, dev):
        np.testing.assert_array_equal(d.get(), h)


def test_scatter_add_matches_numpy():
    rng = np.random.default_rng(5)
    out = rng.standard_normal(10_000).astype(np.float32)
    dev = cupy.asarray(out)
    for dt in (np.int32, np.int64):
        idx = rng.choice(out.size, 3000, replace=False).astype(dt)
        vals = rng.standard_normal(3000).astype(np.float32)
        gpu.scatter_add(cupy.asarray(idx), cupy.asarray(vals), dev)
        np.add.at(out, idx, vals)
    np.testing.assert_array_equal(dev.get(), out)
    with pytest.raises(Exception, match="outside"):
        gpu.scatter_add(cupy.asarray(np.array([0, 10_000], np.int32)),
                        cupy.ones(2, np.float32), dev)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.uint8, np.int64])
def test_pack_unpack_roundtrip(dtype):
    rng = np.random.default_rng(2)
    sizes = [1, 0, 4095, 4096, 4097, 100_000, 3]
    host = [rng.integers(0, 100, s).astype(dtype) for s in sizes]
    dev = [cupy.asarray(h) for h in host]
    bucket = gpu.pack(dev)
    np.testing.assert_array_equal(bucket.get(), np.concatenate(host))
    for d in dev:
        d.fill(0)
    gpu.unpack(bucket, dev)
    for h, d in zip(host, dev):
        np.testing.assert_array_equal(d.get(), h)


def test_pack_unpack_scale_f32():
    parts = [cupy.arange(n, dtype=np.float32) for n in (10, 5000)]
    bucket = gpu.pack(parts, scale=0.5)
    np.testing.assert_array_equal(bucket.get(), np.concatenate([np.arange(10), np.arange(5000)])
                                  .astype(np.float32) * 0.5)
    gpu.unpack(bucket, parts, scale=4.0)
    np.testing.assert_array_equal(parts[1].get(), np.arange(5000, dtype=np.float32) * 2)


def test_as_cupy_is_zero_copy_for_torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    t = torch.arange(10, dtype=torch.float32, device="cuda")[2:]
    arr = kc.as_cupy(t)
    assert arr.data.ptr == t.data_ptr()
    arr[0] = 42
    assert float(t[0]) == 42.0
