"""Compressors for fused buckets; :func:`make` builds one from its spec string.

Specs: ``none``, ``fp16``, ``bf16``, ``fp8`` (= ``fp8:e4m3``), ``fp8_e5m2``, ``topk`` (ratio
0.01, error feedback), ``powersgd`` (rank 2). See docs/compression.md.
"""
from __future__ import annotations

from .base import BucketContext, Compressor

import importlib

_FACTORIES: dict = {}
# built-in formats and the module that registers each; imported on first use so that
# `import lightcc` does not pay for numba's start-up when compression is off
_BUILTIN = {"fp16": "fp", "bf16": "fp", "fp8": "fp", "fp8_e5m2": "fp", "topk": "topk",
            "powersgd": "powersgd"}


def register(name: str, factory) -> None:
    """Make ``factory(options: list[str]) -> Compressor`` available under ``name``."""
    _FACTORIES[name] = factory


def available_compressors() -> list[str]:
    """Names accepted by ``LCC_COMPRESSION`` and ``lccrun --compression``."""
    return ["none", *sorted(set(_FACTORIES) | set(_BUILTIN))]


def make(spec: str) -> Compressor | None:
    """The compressor for ``spec`` (``None`` for ``none``); ValueError for an unknown name."""
    spec = (spec or "none").strip().lower()
    name, *options = spec.split(":")
    if name == "none":
        return None
    if name not in _FACTORIES and name in _BUILTIN:
        importlib.import_module(f".{_BUILTIN[name]}", __name__)
    if name not in _FACTORIES:
        raise ValueError(f"unknown compressor {spec!r}; known: {', '.join(available_compressors())}")
    return _FACTORIES[name](options)


__all__ = ["BucketContext", "Compressor", "available_compressors", "make", "register"]

from .api import Compression, CompressionSpec  # noqa: E402,F401
