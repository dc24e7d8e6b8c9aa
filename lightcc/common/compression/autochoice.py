"""What ``compression=auto`` chooses, as pure functions of measurements (no communication).

:class:`LinkModel` holds what the probe measured on one communicator: for each candidate
format, the time of a real allreduce of that format over the communicator, fitted as
``latency + seconds_per_byte * fp32_bytes`` from two probe sizes (the maximum over the ranks,
the minimum over repetitions), and each codec's local cost per fp32 byte (encode + decode
passes of the two-phase scheme, timed alone on this machine). :func:`predict` gives the time
of a tensor of ``nbytes`` fp32 bytes with a format; :func:`choose` picks, for each tensor,
the allowed format of the lowest predicted time, and keeps ``none`` unless a format is
predicted faster by more than :data:`MARGIN`.

Per tensor, not per bucket: a tensor's format then does not depend on which tensors it was
fused with (that depends on timing), and within a fused bucket the per-call latency is shared
by the bucket, so the bytes decide (the slope, :func:`predict` with ``latency=False``).

Which 16-bit format a tensor may use: :func:`range_errors` rounds a sample of its values (and
``n`` times them, what the owner re-encodes after summing ``n`` ranks) through fp16 and bf16
with the codecs' own kernels and sums the squared errors; fp16 keeps 3 more mantissa bits, bf16
keeps fp32's range, so bf16 is allowed in place of fp16 only where its error is smaller (values
beyond fp16's range, or mostly in its subnormals). The lossy tier (``auto:lossy``) adds
scaled fp8 (E4M3).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from ..kernels import floatcast as fc

#: A compressed format must be predicted this much faster (fraction) than ``none`` to be used.
MARGIN = 0.05

LOSSLESS = ("none", "fp16", "bf16")
LOSSY = ("fp8:e4m3:bucket",)
ACCURACIES = ("lossless", "lossy")

#: The 16-bit formats: a tensor uses one of them, chosen by :func:`range_errors`.
HALF = ("fp16", "bf16")


def candidates(accuracy: str) -> tuple[str, ...]:
    """The formats ``auto`` may choose for ``accuracy`` (lossless | lossy)."""
    if accuracy not in ACCURACIES:
        raise ValueError(f"compression accuracy must be one of {', '.join(ACCURACIES)}, "
                         f"got {accuracy!r}")
    return LOSSLESS + (LOSSY if accuracy == "lossy" else ())


@dataclass(frozen=True)
class LinkModel:
    """Measured on one communicator of ``nranks`` ranks (see module docstring); times in s,
    sizes in fp32 bytes of the buffer reduced."""

    nranks: int
    fit: dict[str, tuple[float, float]]            # format -> (latency s, s per byte)
    codec: dict[str, float] = field(default_factory=dict)   # format -> local s per byte

    def link_bytes_per_s(self) -> float:
        """Bytes per second one rank sends, uncompressed (ring volume 2(n-1)/n per byte)."""
        slope = self.fit["none"][1]
        return 2.0 * (self.nranks - 1) / self.nranks / slope if slope > 0 else float("inf")


def fit_line(sizes: Iterable[float], seconds: Iterable[float]) -> tuple[float, float]:
    """``(latency, slope)`` through the points at the smallest and largest size (both >= 0)."""
    pts = sorted(zip(sizes, seconds))
    (x0, y0), (x1, y1) = pts[0], pts[-1]
    slope = max((y1 - y0) / (x1 - x0), 0.0) if x1 > x0 else 0.0
    return max(y0 - slope * x0, 0.0), slope


def with_derived(model: LinkModel) -> LinkModel:
    """``model`` with bf16's fit derived from fp16's when only fp16 was probed: the same bytes
    on the wire, plus the difference of the two codecs' local costs."""
    if "bf16" in model.fit or "fp16" not in model.fit:
        return model
    lat, slope = model.fit["fp16"]
    extra = model.codec.get("bf16", 0.0) - model.codec.get("fp16", 0.0)
    fit = dict(model.fit)
    fit["bf16"] = (lat, max(slope + extra, 0.0))
    return LinkModel(model.nranks, fit, dict(model.codec))


def predict(model: LinkModel, fmt: str, nbytes: float, latency: bool = True) -> float:
    """Predicted seconds to reduce ``nbytes`` fp32 bytes with ``fmt`` (``latency=False``: the
    bytes' share alone, as inside a fused bucket)."""
    lat, slope = model.fit[fmt]
    return (lat if latency else 0.0) + slope * nbytes


def choose(model: LinkModel, nbytes: float, allowed: Iterable[str]) -> str:
    """The allowed format of the lowest predicted time for a tensor of ``nbytes`` fp32 bytes
    in a fused bucket; ``none`` unless another is faster by more than :data:`MARGIN`."""
    model = with_derived(model)
    base = predict(model, "none", nbytes, latency=False)
    best, best_t = "none", base
    for fmt in allowed:
        if fmt == "none" or fmt not in model.fit:
            continue
        t = predict(model, fmt, nbytes, latency=False)
        if t < best_t and t < base * (1.0 - MARGIN):
            best, best_t = fmt, t
    return best


def allowed_for(errors: tuple[float, float] | None, accuracy: str) -> tuple[str, ...]:
    """The formats a tensor may use given its ``(fp16, bf16)`` squared rounding errors
    (:func:`range_errors`; None: not sampled, fp16's precision assumed to fit)."""
    out = [f for f in candidates(accuracy) if f not in HALF]
    if errors is None or errors[0] <= errors[1]:
        out.append("fp16")
    else:
        out.append("bf16")
    return tuple(out)


def range_errors(sample: np.ndarray, nranks: int) -> tuple[float, float]:
    """Summed squared rounding errors of ``sample`` (float32) and ``nranks * sample`` through
    fp16 and through bf16 (the codecs' own kernels, saturation included)."""
    x = np.ascontiguousarray(sample, dtype=np.float32)
    x = x[np.isfinite(x)]
    if x.size == 0:
        return 0.0, 0.0
    xs = np.concatenate([x, x * np.float32(nranks)])
    out = []
    for f in (fc.FP16, fc.BF16):
        back = fc.decode(fc.encode(xs, f), f).astype(np.float64)
        out.append(float(np.sum((back - xs.astype(np.float64)) ** 2)))
    return out[0], out[1]


CODES = {"none": 0, "fp16": 1, "bf16": 2, "fp8:e4m3:bucket": 3}
FORMATS = {v: k for k, v in CODES.items()}


def describe(model: LinkModel, counts: dict[str, int], nbytes: dict[str, int]) -> str:
    """One line: the link, the codecs' cost and how many tensors (bytes) got each format."""
    link = model.link_bytes_per_s()
    parts = [f"{fmt} {counts[fmt]} tensors ({nbytes[fmt] / 1e6:.1f} MB)"
             for fmt in sorted(counts, key=lambda f: CODES.get(f, 9)) if counts[fmt]]
    codec = ", ".join(f"{f} {1e-9 / s:.1f} GB/s" for f, s in sorted(model.codec.items())
                      if s > 0)
    slopes = ", ".join(f"{f} {s * 1e9:.2f} ns/B" for f, (_, s) in sorted(model.fit.items()))
    return (f"link {link / 1e9:.3f} GB/s over {model.nranks} ranks; per fp32 byte {slopes}"
            + (f"; codecs {codec}" if codec else "") + "; chose " + ", ".join(parts or ["none"]))
