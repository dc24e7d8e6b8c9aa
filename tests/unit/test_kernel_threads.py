"""numba's parallel kernels must not change torch's thread count (it broke reproducibility)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")


def test_kernels_keep_torch_thread_count():
    from lightcc.common.kernels import floatcast as fc
    from lightcc.common.kernels import sparse

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        x = np.random.default_rng(0).standard_normal(1 << 18).astype(np.float32)
        codes = fc.encode(x, fc.FP16)
        fc.decode(codes, fc.FP16)
        fc.block_amax(x, 256)
        idx = sparse.topk_indices(x, 1000)
        sparse.scatter_add(idx.astype(np.int32), x[idx], np.zeros_like(x))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
