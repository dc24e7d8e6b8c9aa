"""``Compression``: the core's compression namespace, under horovod.torch's name.

``hvd.Compression.none`` and ``hvd.Compression.fp16`` work as in Horovod; lightcc adds its own
formats (``bf16``, ``fp8(...)``, ``topk(...)``, ``powersgd(...)``). Each value carries a ``spec``
string; the engine compresses whole fused buckets with it, so the torch layer never compresses
tensor by tensor. A Horovod-style custom compressor (an object with ``compress(tensor) ->
(tensor, ctx)`` and ``decompress(tensor, ctx)`` but no ``spec``) is still accepted and applied
per tensor, as Horovod does.
"""
from __future__ import annotations

from typing import Any

from ..common.compression.api import Compression, CompressionSpec
from ..common.exceptions import InvalidArgumentError


def spec_of(compression: Any) -> str | None:
    """The engine spec of ``compression`` ("none" for None), or None for a custom compressor."""
    if compression is None:
        return "none"
    if isinstance(compression, str):
        return compression
    spec = getattr(compression, "spec", None)
    if isinstance(spec, str):
        return spec
    if callable(getattr(compression, "compress", None)) and \
            callable(getattr(compression, "decompress", None)):
        return None
    raise InvalidArgumentError(f"compression must be a Compression value (e.g. "
                               f"Compression.fp16), a spec string or an object with "
                               f"compress/decompress; got {compression!r}")


__all__ = ["Compression", "CompressionSpec", "spec_of"]
