"""Compressed gradient reduce-scatter for FSDP2 (``fully_shard``).

FSDP2 reduces each module's gradients with one reduce-scatter and lets a module replace it
(``FSDPModule.set_custom_reduce_scatter``); torch itself offers only a dtype cast
(``MixedPrecisionPolicy(reduce_dtype=...)``), whose sum is computed in the low precision.
lightcc's two-phase compressors are a reduce-scatter already (their first phase), so::

    import lightcc.torch.fsdp
    fully_shard(model, ...)
    lightcc.torch.fsdp.compress(model, lcc.Compression.fp8())

makes every FSDP module of ``model`` send its gradients in fp16, bf16 or fp8 and sum them in
fp32: each rank cuts the flat gradient into one chunk per rank, encodes every chunk with the
compressor's codec (fp8 with a power-of-two scale per chunk or per block), sends chunk r to
rank r with one ``all_to_all_single`` on FSDP's group, and decodes and sums the copies of its
own chunk in rank order in fp32 (its own copy included, so the result does not depend on
which rank owns a chunk). Bytes a rank sends for a gradient of ``N`` elements over ``n`` ranks:
``N (n-1)/n`` times 2 (fp16, bf16) or 1 (fp8, plus 4 bytes per scale), against 4 for
fp32's reduce-scatter. It runs on any backend with ``all_to_all_single`` (lightcc, gloo).
CUDA gradients are encoded on the host (a copy each way): correct, not fast.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

try:     # the interface FSDP2's set_custom_reduce_scatter takes (not exported by torch)
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
except ImportError:  # pragma: no cover - a torch without custom reduce-scatters
    ReduceScatter = object  # type: ignore[assignment,misc]

from ..common.compression.api import Compression, CompressionSpec, spec_of
from ..common.compression.twophase import TwoPhaseCompressor
from ..common.exceptions import InvalidArgumentError
from ._tensor import host_view

_R = dist.ReduceOp.RedOpType


class CompressedReduceScatter(ReduceScatter):
    """FSDP2's reduce-scatter with a two-phase compressor's codec (see module docstring).

    ``compression``: ``Compression.fp16``, ``Compression.bf16``, ``Compression.fp8(...)`` (or
    ``Compression.fp8`` itself, its defaults), or a spec string such as ``"fp8:e5m2:block"``.
    """

    def __init__(self, compression: Any = Compression.fp16) -> None:
        if callable(compression) and not isinstance(compression, CompressionSpec):
            compression = compression()          # Compression.fp8 given without arguments
        self.spec = spec_of(compression)
        comp = CompressionSpec(self.spec).make()
        if not isinstance(comp, TwoPhaseCompressor):
            raise InvalidArgumentError(
                f"FSDP compression {self.spec!r}: only the element-wise formats (fp16, bf16, "
                f"fp8) are a reduce-scatter; TopK and PowerSGD need the whole gradient")
        self.codec = comp.codec

    def allocate(self, size: Sequence[Any], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def wire_bytes(self, numel: int, nranks: int) -> int:
        """Bytes one rank sends to reduce-scatter ``numel`` elements (rank 0's share)."""
        count = numel // nranks
        return (nranks - 1) * self.codec.nbytes(count)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op: Any, async_op: bool = False) -> None:
        n = group.size()
        count = output_tensor.numel()
        what = f"compressed FSDP reduce-scatter ({self.spec})"
        if input_tensor.numel() != n * count:
            raise InvalidArgumentError(f"{what}: input has {input_tensor.numel()} elements, "
                                       f"expected {n} x {count}")
        factor, average = _scaling(op, what)
        x = input_tensor.detach().reshape(n, count).to("cpu", torch.float32)
        if factor != 1.0:
            x = x * factor
        x = np.ascontiguousarray(host_view(x.contiguous()))
        enc = self.codec.nbytes(count)
        send = torch.empty(n * enc, dtype=torch.uint8)
        payload = host_view(send)
        for r in range(n):
            self.codec.encode_into(x[r], payload[r * enc:(r + 1) * enc])
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        acc = torch.zeros(count, dtype=torch.float32)
        got, out = host_view(recv), host_view(acc)
        for r in range(n):                       # rank order: the same sum on every rank
            self.codec.decode_into(got[r * enc:(r + 1) * enc], count, out, True)
        if average:
            acc /= n
        output_tensor.copy_(acc.reshape(output_tensor.shape))
        return None


def _scaling(op: Any, what: str) -> tuple[float, bool]:
    """(factor applied before encoding, divide the sum by the group size) for FSDP's op."""
    kind = getattr(op, "op", op)
    if kind == _R.SUM:
        return 1.0, False
    if kind == _R.AVG:
        return 1.0, True
    if kind == _R.PREMUL_SUM:
        factor = op.factor
        return float(factor.item() if isinstance(factor, torch.Tensor) else factor), False
    raise InvalidArgumentError(f"{what}: reduce op {kind} is not supported (SUM, AVG, "
                               f"PREMUL_SUM)")


def compress(model: torch.nn.Module, compression: Any = Compression.fp16) -> CompressedReduceScatter:
    """Make every FSDP2 module in ``model`` (``fully_shard`` applied) reduce-scatter its
    gradients with ``compression``; returns the reduce-scatter object they share."""
    comm = CompressedReduceScatter(compression)
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise InvalidArgumentError("lightcc.torch.fsdp.compress: the model has no FSDP2 module "
                                   "(call fully_shard on it first)")
    if not hasattr(modules[0], "set_custom_reduce_scatter"):
        raise InvalidArgumentError(f"lightcc.torch.fsdp.compress: FSDP2 of torch "
                                   f"{torch.__version__} has no set_custom_reduce_scatter "
                                   f"(torch 2.13 has it)")
    for m in modules:
        m.set_custom_reduce_scatter(comm)
    return comm


__all__ = ["CompressedReduceScatter", "compress"]
