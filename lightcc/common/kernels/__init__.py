"""CPU kernels (numba, with NumPy fallbacks giving identical results).

``floatcast``: fp32 <-> fp16/bf16/fp8 with power-of-two block scales; ``sparse``: top-k
selection and scatter-add. GPU kernels live in ``kernels/cuda.py``.

The names below are loaded on first access (PEP 562), so importing ``kernels.cuda`` (the GPU
path) does not pay for numba's start-up.
"""
from __future__ import annotations

import importlib
from typing import Any

_FROM = {"floatcast": ("BF16", "E4M3", "E5M2", "FORMATS", "FP16", "HAVE_NUMBA", "FloatFormat",
                       "block_amax", "decode", "encode", "exps_to_scales", "scale_exponents"),
         "sparse": ("scatter_add", "topk_indices")}
_WHERE = {name: mod for mod, names in _FROM.items() for name in names}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{mod}", __name__), name)
    globals()[name] = value
    return value
