"""``Compression``: the public, Horovod-compatible way to name a compressor.

``Compression.none`` and ``Compression.fp16`` are attributes, as in Horovod; ``bf16`` and
``auto`` too (``Compression.auto(accuracy="lossy")`` lets it choose lossy formats). The
configurable ones are functions: ``Compression.fp8(format="e4m3", scaling="bucket",
block_size=256)``, ``Compression.topk(ratio=0.01, error_feedback=True)``,
``Compression.powersgd(rank=2, warm_start=True, error_feedback=True)``. Each value is a frozen
:class:`CompressionSpec` whose ``.spec`` (and ``str()``) is the string ``compression.make``
accepts, so the engine can keep one compressor (and its state) per spec.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..exceptions import ConfigError
from .registry import make


@dataclass(frozen=True)
class CompressionSpec:
    """A compressor by name, e.g. ``CompressionSpec("fp8:e4m3:block:256")``."""

    spec: str

    def __str__(self) -> str:
        return self.spec

    def make(self):
        """A fresh compressor for this spec (``None`` for ``none``)."""
        return make(self.spec)


ACCURACIES = ("lossless", "lossy")


def auto_spec(accuracy: str | None = None) -> str:
    """``auto`` (accuracy from ``LCC_COMPRESSION_ACCURACY``) or ``auto:<accuracy>``."""
    if accuracy is None:
        return "auto"
    if accuracy not in ACCURACIES:
        raise ConfigError(f"Compression.auto: accuracy must be one of {', '.join(ACCURACIES)}, "
                          f"got {accuracy!r}")
    return f"auto:{accuracy}"


class AutoSpec(CompressionSpec):
    """``Compression.auto``: usable as is, or called with ``accuracy="lossless"|"lossy"``."""

    def __call__(self, accuracy: str | None = None) -> "AutoSpec":
        return AutoSpec(auto_spec(accuracy))


class Compression:
    """Namespace of compression choices (Horovod names plus auto, bf16, fp8, topk,
    powersgd)."""

    none = CompressionSpec("none")
    #: chosen per tensor from measurements of the link and the codecs (docs/compression.md):
    #: ``Compression.auto`` or ``Compression.auto(accuracy="lossy")``
    auto = AutoSpec("auto")
    fp16 = CompressionSpec("fp16")
    bf16 = CompressionSpec("bf16")

    @staticmethod
    def fp8(format: str = "e4m3", scaling: str = "bucket", block_size: int = 256) -> CompressionSpec:
        """Scaled FP8: ``format`` e4m3 | e5m2; a power-of-two scale per tensor (``bucket``;
        per 64 Ki elements of a larger one) or per ``block_size`` elements of a tensor."""
        if format not in ("e4m3", "e5m2"):
            raise ConfigError(f"fp8 format must be 'e4m3' or 'e5m2', got {format!r}")
        if scaling not in ("bucket", "block"):
            raise ConfigError(f"fp8 scaling must be 'bucket' or 'block', got {scaling!r}")
        if int(block_size) < 1:
            raise ConfigError(f"fp8 block_size must be >= 1, got {block_size}")
        tail = f":{int(block_size)}" if scaling == "block" else ""
        return CompressionSpec(f"fp8:{format}:{scaling}{tail}")

    @staticmethod
    def topk(ratio: float = 0.01, error_feedback: bool = True) -> CompressionSpec:
        """Top ``ratio`` of each tensor by magnitude, with error feedback by default."""
        if not 0.0 < float(ratio) <= 1.0:
            raise ConfigError(f"topk ratio must be in (0, 1], got {ratio}")
        return CompressionSpec(f"topk:{float(ratio):g}:{'ef' if error_feedback else 'noef'}")

    @staticmethod
    def powersgd(rank: int = 2, warm_start: bool = True,
                 error_feedback: bool = True) -> CompressionSpec:
        """Rank-``rank`` PowerSGD per tensor (warm start and error feedback by default)."""
        if int(rank) < 1:
            raise ConfigError(f"powersgd rank must be >= 1, got {rank}")
        return CompressionSpec(f"powersgd:{int(rank)}" + ("" if warm_start else ":nowarm")
                               + ("" if error_feedback else ":noef"))


def spec_of(value) -> str:
    """The spec string of a ``CompressionSpec``, a string, ``None`` or a Horovod-style class."""
    if value is None:
        return "none"
    if isinstance(value, CompressionSpec):
        return value.spec
    if isinstance(value, str):
        return value.strip().lower() or "none"
    spec = getattr(value, "spec", None)
    if isinstance(spec, str):
        return spec
    horovod = {"nonecompressor": "none", "fp16compressor": "fp16"}   # horovod's class names
    name = getattr(value, "__name__", "").lower()
    if name in horovod:
        return horovod[name]
    raise ConfigError(f"not a compression choice: {value!r} (use lightcc.Compression.*)")


__all__ = ["AutoSpec", "Compression", "CompressionSpec", "auto_spec", "spec_of"]
