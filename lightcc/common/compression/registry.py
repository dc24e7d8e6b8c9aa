"""The compressor registry: spec string -> compressor (``make``), and ``register``."""
from __future__ import annotations

import importlib

from .base import Compressor

_FACTORIES: dict = {}
# built-in formats and the module that registers each; imported on first use so that
# `import lightcc` does not pay for numba's start-up when compression is off
_BUILTIN = {"auto": "auto", "fp16": "fp", "bf16": "fp", "fp8": "fp", "fp8_e5m2": "fp", "topk": "topk",
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
        importlib.import_module(f".{_BUILTIN[name]}", __package__)
    if name not in _FACTORIES:
        raise ValueError(f"unknown compressor {spec!r}; known: {', '.join(available_compressors())}")
    return _FACTORIES[name](options)
