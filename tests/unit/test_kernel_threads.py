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


def test_codec_threads_default_divides_cores_among_host_ranks(monkeypatch):
    from lightcc.common.kernels import _threads

    monkeypatch.setattr(_threads, "usable_cores", lambda: 8)
    monkeypatch.setattr(_threads, "CODEC_THREADS", 0)
    numba = pytest.importorskip("numba")
    cap = numba.config.NUMBA_NUM_THREADS
    assert _threads.configure(0, 4) == min(2, cap)
    assert _threads.configure(0, 16) == 1          # never below one thread
    assert _threads.configure(3, 4) == min(3, cap)  # an explicit value wins
    assert _threads.configure(10 ** 6, 1) == cap    # capped by numba's pool


def test_kernel_launch_uses_codec_threads(monkeypatch):
    """numba's thread count is per calling thread: every launch that may use threads (arrays
    of two tiles or more; smaller ones run the serial kernels) applies CODEC_THREADS."""
    import threading

    numba = pytest.importorskip("numba")
    if numba.config.NUMBA_NUM_THREADS < 3:
        pytest.skip("numba pool has fewer than 3 threads")
    from lightcc.common.kernels import _threads, floatcast as fc

    monkeypatch.setattr(_threads, "CODEC_THREADS", 2)
    seen = []

    def launch():
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
        fc.encode(np.ones(2 * fc.TILE, np.float32), fc.FP16)
        seen.append(numba.get_num_threads())

    t = threading.Thread(target=launch)
    t.start()
    t.join()
    assert seen == [2]


@pytest.mark.parametrize("threads,parallel", [(1, False), (2, True)])
def test_one_codec_thread_runs_serial_kernels(monkeypatch, threads, parallel):
    """With one codec thread the serial builds run (no numba pool, no OpenMP side effects);
    with more, arrays of two tiles or more go to the threaded builds, smaller ones do not."""
    numba = pytest.importorskip("numba")
    if numba.config.NUMBA_NUM_THREADS < threads:
        pytest.skip(f"numba pool has fewer than {threads} threads")
    from lightcc.common.kernels import _castkernels, _threads, floatcast as fc

    monkeypatch.setattr(_threads, "CODEC_THREADS", threads)
    asked = []
    real = _castkernels.encoder

    def spy(fmt, par, hw=None):
        asked.append(par)
        return real(fmt, par, hw)

    monkeypatch.setattr(fc, "encoder", spy)
    fc.encode(np.ones(2 * fc.TILE, np.float32), fc.FP16)
    fc.encode(np.ones(100, np.float32), fc.FP16)
    assert asked == [parallel, False]
