"""``Compression``: Horovod's compressor interface, backed by lightcc's in-engine compressors.

In Horovod a compressor is a class with static ``compress(tensor) -> (tensor, ctx)`` and
``decompress(tensor, ctx) -> tensor``; ``Compression.none`` and ``Compression.fp16`` are such
classes, and users write their own the same way (subclassing :class:`Compressor`). Here:

- ``Compression.none``, ``.fp16`` and ``.bf16`` are those classes (``hvd.Compression.fp16
  .compress(t)`` casts a floating-point tensor to float16, as in Horovod), and they also carry
  a ``spec``: passed as ``compression=`` they are not applied tensor by tensor, the engine
  compresses whole fused buckets with the matching format instead.
- ``Compression.auto`` (``auto(accuracy="lossy")``), ``.fp8(...)``, ``.topk(...)`` and
  ``.powersgd(...)`` (lightcc additions) exist
  only as bucket compressors: their ``compress`` raises, because their output is not a
  tensor other ranks can sum.
- Any other object with ``compress``/``decompress`` (a user-written class, or a subclass of a
  built-in one that overrides either method) is applied per tensor, exactly as Horovod does;
  :func:`per_tensor` wraps a built-in one the same way.
"""
from __future__ import annotations

from typing import Any

import torch

from ..common.compression.api import Compression as _CoreCompression
from ..common.compression.api import CompressionSpec, auto_spec
from ..common.compression.api import spec_of as _core_spec_of
from ..common.exceptions import ConfigError, InvalidArgumentError


class Compressor:
    """Horovod's compressor interface: override both static methods."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Return the tensor to communicate and the context ``decompress`` needs."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Return the communicated ``tensor`` in its original form."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """No compression (the default)."""

    spec = "none"

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class _CastCompressor(Compressor):
    """Casts floating-point tensors to ``wire`` and back; other dtypes pass unchanged."""

    wire: torch.dtype = torch.float16

    @classmethod
    def compress(cls, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if tensor.dtype.is_floating_point:
            return tensor.to(cls.wire), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        if ctx is not None and ctx.is_floating_point and tensor.dtype != ctx:
            return tensor.to(ctx)
        return tensor


class FP16Compressor(_CastCompressor):
    """Floating-point tensors travel as float16 (Horovod's ``Compression.fp16``)."""

    spec = "fp16"
    wire = torch.float16


class BF16Compressor(_CastCompressor):
    """Floating-point tensors travel as bfloat16 (a lightcc addition)."""

    spec = "bf16"
    wire = torch.bfloat16


_BUILTIN = (NoneCompressor, FP16Compressor, BF16Compressor)


class BucketCompressor(CompressionSpec):
    """A lightcc compressor that works only on fused buckets inside the engine (fp8, topk,
    powersgd): usable as ``compression=``, not as a per-tensor Horovod compressor."""

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        raise InvalidArgumentError(
            f"Compression {self.spec!r} runs only inside the engine on fused buckets (its "
            f"output is not a tensor the ranks can sum); pass it as compression= to "
            f"DistributedOptimizer or allreduce instead of calling compress()")

    def decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        raise InvalidArgumentError(f"Compression {self.spec!r} has no per-tensor decompress()")


class AutoCompression(BucketCompressor):
    """``Compression.auto``: the engine picks none, fp16 or bf16 per tensor from measurements
    of the link and the codecs (lossy formats too with ``Compression.auto(accuracy="lossy")``;
    plain ``Compression.auto`` takes ``LCC_COMPRESSION_ACCURACY``, default lossless)."""

    def __call__(self, accuracy: str | None = None) -> "AutoCompression":
        return AutoCompression(auto_spec(accuracy))


class Compression:
    """Compression choices: Horovod's ``none`` and ``fp16``, plus ``auto``, ``bf16``,
    ``fp8(...)``, ``topk(...)`` and ``powersgd(...)`` (see docs/compression.md)."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
    auto = AutoCompression("auto")

    @staticmethod
    def fp8(format: str = "e4m3", scaling: str = "bucket",
            block_size: int = 256) -> BucketCompressor:
        """Scaled FP8 on fused buckets: ``format`` e4m3 | e5m2, a scale per tensor or per
        block of one."""
        return BucketCompressor(_CoreCompression.fp8(format, scaling, block_size).spec)

    @staticmethod
    def topk(ratio: float = 0.01, error_feedback: bool = True) -> BucketCompressor:
        """Top ``ratio`` of each tensor by magnitude, with error feedback by default."""
        return BucketCompressor(_CoreCompression.topk(ratio, error_feedback).spec)

    @staticmethod
    def powersgd(rank: int = 2, warm_start: bool = True,
                 error_feedback: bool = True) -> BucketCompressor:
        """Rank-``rank`` PowerSGD per tensor (warm start and error feedback by default)."""
        return BucketCompressor(_CoreCompression.powersgd(rank, warm_start,
                                                          error_feedback).spec)


class _PerTensor:
    """Applies a compressor's ``compress``/``decompress`` tensor by tensor (see per_tensor)."""

    def __init__(self, compressor: Any) -> None:
        self._inner = compressor

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return self._inner.compress(tensor)

    def decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return self._inner.decompress(tensor, ctx)

    def __repr__(self) -> str:
        return f"per_tensor({self._inner!r})"


def per_tensor(compressor: Any) -> Any:
    """``compressor`` applied tensor by tensor, as Horovod applies every compressor.

    ``per_tensor(Compression.fp16)`` reproduces Horovod's fp16 exactly: each gradient is
    cast to float16, summed in float16 and cast back, instead of lightcc's per-bucket fp16
    with float32 accumulation.
    """
    if not (callable(getattr(compressor, "compress", None))
            and callable(getattr(compressor, "decompress", None))):
        raise InvalidArgumentError(f"per_tensor needs an object with compress/decompress, got "
                                   f"{compressor!r}")
    return _PerTensor(compressor)


def _builtin_spec(compression: Any) -> str | None:
    """The spec of a built-in compressor class (or instance) whose methods are not overridden;
    None when a class between it and the built-in one redefines compress or decompress."""
    cls = compression if isinstance(compression, type) else type(compression)
    for klass in cls.__mro__:
        if klass in _BUILTIN:
            return klass.spec
        if "compress" in vars(klass) or "decompress" in vars(klass):
            return None
    return None


def spec_of(compression: Any) -> str | None:
    """The engine spec of ``compression`` ("none" for None), or None for a compressor that
    must be applied per tensor (user-written, Horovod-style, or a built-in one whose methods
    a subclass overrides). Everything else is the core's :func:`spec_of`."""
    if compression is not None and not isinstance(compression, (str, CompressionSpec)):
        builtin = _builtin_spec(compression)
        if builtin is not None:
            return builtin
        if callable(getattr(compression, "compress", None)) and \
                callable(getattr(compression, "decompress", None)):
            return None
    try:
        return _core_spec_of(compression)
    except ConfigError:
        raise InvalidArgumentError(f"compression must be a Compression value (e.g. "
                                   f"Compression.fp16), a spec string or an object with "
                                   f"compress/decompress; got {compression!r}") from None


__all__ = ["AutoCompression", "BF16Compressor", "BucketCompressor", "Compression", "CompressionSpec", "Compressor",
           "FP16Compressor", "NoneCompressor", "per_tensor", "spec_of"]
