"""CPU kernels (numba, with NumPy fallbacks giving identical results).

``floatcast``: fp32 <-> fp16/bf16/fp8 with power-of-two block scales; ``sparse``: top-k
selection and scatter-add. GPU kernels live in ``kernels/cuda.py`` (GPU issue).
"""
from __future__ import annotations

from .floatcast import (BF16, E4M3, E5M2, FORMATS, FP16, HAVE_NUMBA, FloatFormat, block_amax,
                        decode, encode, exps_to_scales, scale_exponents)
from .sparse import scatter_add, topk_indices

__all__ = ["BF16", "E4M3", "E5M2", "FORMATS", "FP16", "HAVE_NUMBA", "FloatFormat", "block_amax",
           "decode", "encode", "exps_to_scales", "scale_exponents", "scatter_add", "topk_indices"]
