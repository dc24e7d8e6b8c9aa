"""fp16, bf16 and scaled fp8 (E4M3 / E5M2) compression over the two-phase scheme.

Wire format of ``n`` elements of one tensor: ``nscales`` float32 scales (powers of two; none
for fp16/bf16, one per :attr:`FloatCodec.unit` elements for fp8: ``block_size`` for ``block``
scaling, :data:`BUCKET_UNIT` for ``bucket`` scaling, i.e. one scale per tensor up to 64 Ki
elements) followed by ``n`` codes (2 bytes for fp16/bf16, 1 for fp8). An fp8 scale is the
smallest power of two ``2**e`` with ``amax / 2**e <= format max`` (amax over the finite values
of its block), so the largest value lands in the format's top binade. Scaling blocks start at
each tensor's start and never span two tensors, and the two-phase scheme cuts a bucket only
between blocks, so a tensor's scales (and result) never depend on the tensors it was fused
with. Finite values beyond a format's range saturate (fp16 at ±65504, E4M3 at ±448, E5M2 at
±57344) instead of becoming Inf; NaN stays NaN, ±Inf stays ±Inf (NaN in E4M3, which has no
infinity). GPU buffers (CuPy) are encoded and decoded by the CUDA kernels of
``compression/gpu.py``, bit for bit the same.
"""
from __future__ import annotations

import numpy as np

from ..exceptions import ConfigError
from ..kernels import floatcast as fc
from . import gpu
from .registry import register
from .twophase import TwoPhaseCompressor

#: Elements per scale of ``bucket``-scaled fp8: one scale per tensor of up to this many
#: elements (256 KB of fp32), one per this many of a larger tensor. Blocks this size are
#: scaled in one pass while in cache (kernels/floatcast.encode_scaled), and the two-phase
#: scheme may cut a large tensor between them to share it among the ranks.
BUCKET_UNIT = 1 << 16


class FloatCodec:
    """Encodes one tensor's elements in ``fmt`` with optional power-of-two scales
    (``scaling``: None, ``bucket``: per :data:`BUCKET_UNIT` elements, ``block``: per
    ``block_size``)."""

    def __init__(self, fmt: fc.FloatFormat, scaling: str | None = None,
                 block_size: int = 256) -> None:
        self.fmt = fmt
        self.scaling = scaling
        self.block_size = int(block_size)
        #: elements per scale, counted from the start of what is encoded (0: no scales)
        self.unit = 0 if scaling is None else \
            (self.block_size if scaling == "block" else BUCKET_UNIT)

    def nscales(self, n: int) -> int:
        return 0 if self.unit == 0 else -(-n // self.unit)

    def _bs(self, n: int) -> int:
        return self.unit or max(n, 1)

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


class RawCodec:
    """float32 sent as it is: the two-phase scheme with this codec is an exact allreduce in
    which every element is summed in rank order (0 + x0 + x1 + ...) by its chunk's owner, so
    its bits do not depend on where the element lies in a bucket (``LCC_DETERMINISTIC``)."""

    unit = 0

    def nbytes(self, n: int) -> int:
        return 4 * n

    def encode_into(self, x: np.ndarray, out: np.ndarray) -> None:
        out.view(np.float32)[:] = x

    def decode_into(self, payload: np.ndarray, n: int, out: np.ndarray,
                    accumulate: bool) -> None:
        values = payload.view(np.float32)
        if accumulate:
            out += values
        else:
            out[:] = values


def ordered_sum() -> TwoPhaseCompressor:
    """The exact, rank-ordered float32 sum (:class:`RawCodec`); not a user-facing format."""
    return TwoPhaseCompressor("ordered", RawCodec())


register("fp16", make_fp16)
register("bf16", make_bf16)
register("fp8", make_fp8)
register("fp8_e5m2", lambda options: make_fp8(options, default_fmt="e5m2"))
