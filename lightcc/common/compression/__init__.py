"""Compressors for fused buckets; :func:`make` builds one from its spec string.

Specs: ``none``, ``fp16``, ``bf16``, ``fp8`` (= ``fp8:e4m3``), ``fp8_e5m2``, ``topk`` (ratio
0.01, error feedback), ``powersgd`` (rank 2). See docs/compression.md.
"""
from __future__ import annotations

from .base import BucketContext, Compressor
from .registry import available_compressors, make, register

__all__ = ["BucketContext", "Compressor", "available_compressors", "make", "register"]

from .api import Compression, CompressionSpec  # noqa: E402,F401
