"""Shared skip logic of the GPU tests: CuPy must import and see a CUDA device."""
from __future__ import annotations

import pytest


def require_gpu():
    """The ``cupy`` module, or skip the calling test module with the reason."""
    cupy = pytest.importorskip("cupy", reason="GPU tests need CuPy (pip install cupy-cuda13x)")
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no driver / insufficient driver
        pytest.skip(f"GPU tests need a CUDA device: {exc}", allow_module_level=True)
    if count < 1:
        pytest.skip("GPU tests need a CUDA device (none found)", allow_module_level=True)
    return cupy
