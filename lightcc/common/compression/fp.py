"""fp16, bf16 and scaled fp8 (E4M3 / E5M2) compression over the two-phase scheme.

Wire format of one chunk of ``n`` elements: ``nscales`` float32 scales (powers of two; none for
fp16/bf16, one per chunk for ``bucket`` scaling, one per ``block_size`` elements for ``block``)
followed by ``n`` codes (2 bytes for fp16/bf16, 1 for fp8). An fp8 scale is the smallest power
of two ``2**e`` with ``amax / 2**e <= format max`` (amax over the finite values of the chunk or
block), so the largest value lands in the format's top binade. Finite values beyond a format's
range saturate (fp16 at ±65504, E4M3 at ±448, E5M2 at ±57344) instead of becoming Inf; NaN
stays NaN, ±Inf stays ±Inf (NaN in E4M3, which has no infinity). GPU buffers (CuPy) are
encoded and decoded by the CUDA kernels of ``compression/gpu.py``, bit for bit the same.
"""
from __future__ import annotations

import numpy as np

from ..exceptions import ConfigError
from ..kernels import floatcast as fc
from . import gpu, register
from .twophase import TwoPhaseCompressor


class FloatCodec:
    """Encodes chunks in ``fmt`` with optional power-of-two scales (``scaling``: None/bucket/block)."""

    def __init__(self, fmt: fc.FloatFormat, scaling: str | None = None,
                 block_size: int = 256) -> None:
        self.fmt = fmt
        self.scaling = scaling
        self.block_size = int(block_size)

    def nscales(self, n: int) -> int:
        if self.scaling is None or n == 0:
            return 0
        if self.scaling == "bucket":
            return 1
        return -(-n // self.block_size)

    def _bs(self, n: int) -> int:
        return self.block_size if self.scaling == "block" else max(n, 1)

    def nbytes(self, n: int) -> int:
        """Encoded size of ``n`` elements: scales (4 bytes each) + codes."""
        return 4 * self.nscales(n) + self.fmt.itemsize * n

    def encode_into(self, x: np.ndarray, out: np.ndarray) -> None:
        """Scales (as float32 bytes) then codes of ``x`` into the uint8 payload ``out``."""
        if not isinstance(x, np.ndarray):      # a GPU buffer: the CUDA kernels, same bits
            return gpu.encode_into(self, x, out)
        n, ns = x.size, self.nscales(x.size)
        codes = out[4 * ns:].view(self.fmt.code_dtype)
        if ns == 0:
            fc.encode(x, self.fmt, out=codes)
        else:
            fc.encode_scaled(x, self.fmt, self._bs(n), out[:4 * ns], codes)

    def decode_into(self, payload: np.ndarray, n: int, out: np.ndarray, accumulate: bool) -> None:
        """Decode the payload of ``n`` elements into ``out`` (``out +=`` when ``accumulate``).

        The scales are read from the payload's bytes where they lie (no alignment needed, no
        copy)."""
        if not isinstance(out, np.ndarray):
            return gpu.decode_into(self, payload, n, out, accumulate)
        ns = self.nscales(n)
        codes = payload[4 * ns:].view(self.fmt.code_dtype)
        scales = payload[:4 * ns] if ns else None
        fc.decode(codes, self.fmt, scales, self._bs(n), out=out, accumulate=accumulate)


def _no_options(name: str, options: list[str]) -> None:
    if options:
        raise ConfigError(f"compressor {name!r} takes no options, got {':'.join(options)!r}")


def make_fp16(options: list[str]) -> TwoPhaseCompressor:
    _no_options("fp16", options)
    return TwoPhaseCompressor("fp16", FloatCodec(fc.FP16))


def make_bf16(options: list[str]) -> TwoPhaseCompressor:
    _no_options("bf16", options)
    return TwoPhaseCompressor("bf16", FloatCodec(fc.BF16))


def fp8_spec(fmt: str = "e4m3", scaling: str = "bucket", block_size: int = 256) -> str:
    """Canonical spec string, e.g. ``fp8:e4m3:bucket`` or ``fp8:e5m2:block:256``."""
    return f"fp8:{fmt}:{scaling}" + (f":{int(block_size)}" if scaling == "block" else "")


def make_fp8(options: list[str], default_fmt: str = "e4m3") -> TwoPhaseCompressor:
    """Options in any order: ``e4m3``/``e5m2``, ``bucket``/``block``, a block size (implies block)."""
    fmt, scaling, bs = default_fmt, "bucket", 256
    for opt in options:
        if opt in ("e4m3", "e5m2"):
            fmt = opt
        elif opt in ("bucket", "block"):
            scaling = opt
        elif opt.isdigit() and int(opt) > 0:
            bs, scaling = int(opt), "block"
        else:
            raise ConfigError(f"fp8 option {opt!r} not understood (use e4m3|e5m2, bucket|block, "
                              "a block size)")
    return TwoPhaseCompressor(fp8_spec(fmt, scaling, bs),
                              FloatCodec(fc.FORMATS[fmt], scaling, bs))


register("fp16", make_fp16)
register("bf16", make_bf16)
register("fp8", make_fp8)
register("fp8_e5m2", lambda options: make_fp8(options, default_fmt="e5m2"))
