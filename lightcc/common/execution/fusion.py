"""Bucket planning, and packing tensors into a reusable fusion buffer.

:func:`plan` is pure: every rank runs it on the same batch and gets the same buckets.
Allreduces with the same dtype, op, scale factors, compressor, process set and memory (host
or GPU: a bucket never mixes them) share a bucket, in batch order, until the bucket would
exceed the fusion threshold; a tensor larger than the threshold gets a bucket of its own (it is
never truncated). Some tensors are reduced in place, alone, without copies (see
:func:`direct_bytes`): on one host an uncompressed tensor of at least :data:`DIRECT_BYTES`;
across hosts any tensor of at least :data:`MULTI_HOST_DIRECT_BYTES`, compressed or not (the
compressor then acts on that tensor alone). Whether a tensor is compressed is decided per
tensor (:func:`effective_compression`), never by its bucket.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..control.messages import Coll, Response


def compression_applies(compression: str, op: str, dtype: str, nbytes: int,
                        min_compress_bytes: int = 0) -> str:
    """The compressor a tensor really gets (the one rule, for the engine and the direct path):
    none for integer/bool tensors, for ops other than Sum/Average, for float64 (compressors
    work on float32 buckets) and for tensors under ``min_compress_bytes``. Decided per tensor,
    so a tensor's treatment does not depend on which other tensors it happened to be fused
    with."""
    if (compression in ("", "none") or op not in ("sum", "average")
            or dtype not in ("float32", "float16", "bfloat16") or nbytes < min_compress_bytes):
        return "none"
    return compression


def effective_compression(resp: Response, min_compress_bytes: int = 0) -> str:
    """:func:`compression_applies` for one response's request."""
    req = resp.request
    return compression_applies(req.compression, req.op, req.dtype, req.nbytes,
                               min_compress_bytes)


def fusion_key(resp: Response, min_compress_bytes: int = 0) -> tuple | None:
    """What must be equal for two responses to share a bucket (None: never fused)."""
    req = resp.request
    if resp.error or req.coll != Coll.ALLREDUCE:
        return None
    return (req.dtype, req.op, req.prescale, req.postscale,
            effective_compression(resp, min_compress_bytes), req.pset, req.device)


def nbytes(resp: Response) -> int:
    return resp.request.nbytes


#: A tensor at least this large (bytes) is never fused: packing it and copying the result back
#: moves it through memory twice more (~70 us for 256 KB at the ~5 GB/s one core copies here),
#: more than the collective call it saves; alone it is reduced in place.
DIRECT_BYTES = 256 << 10


#: Across hosts, a tensor at least this large (bytes) is reduced alone and in place, compressed
#: or not: at 1 Gbit it is 32 ms on the wire, so the call it would share costs ~1 % of it, while
#: packing it and copying the result back cost ~5 ms per 29 MB each way here (mlp's TopK step:
#: 13 of 85 ms).
MULTI_HOST_DIRECT_BYTES = 4 << 20


def direct_bytes(num_nodes: int) -> tuple[int, int]:
    """``(uncompressed, compressed)``: the sizes from which a tensor is reduced alone and in
    place on a job on ``num_nodes`` hosts (0: never, always fuse).

    On one host a collective is a memory copy, so the two extra copies of fusing cost as much as
    the call they save; compressed tensors are fused there (a compressor acts per bucket, and
    a call per tensor costs more than the copies). Across hosts a collective pays a network
    round trip and a negotiation that a copy does not: resmlp's 40 weights of 700 KB, reduced
    one by one on two hosts at 1 Gbit, trained at 0.79-0.84x DDP's speed against 0.97x fused
    (benchmarks/training.py --netns), so there only tensors of MULTI_HOST_DIRECT_BYTES or more
    go alone.
    """
    if num_nodes <= 1:
        return DIRECT_BYTES, 0
    return MULTI_HOST_DIRECT_BYTES, MULTI_HOST_DIRECT_BYTES


#: Prioritized allreduces (``Request.priority``, cross-barrier mode) are fused into buckets
#: that grow within a batch: the first holds at most this many bytes, each next one twice as
#: many (up to the fusion threshold). The batch is in priority order, so what the next forward
#: needs first is reduced first, in a small bucket, and its handles complete while the rest of
#: the batch is still on the wire; the later, larger buckets keep the number of calls at
#: about log2(batch bytes / this).
PRIORITY_BUCKET_BYTES = 2 << 20


def plan(responses: Sequence[Response], threshold: int,
         min_compress_bytes: int = 0, direct: int = DIRECT_BYTES,
         direct_compressed: int = 0) -> list[list[int]]:
    """Group response indices into buckets (see module docstring); order follows the batch.
    ``direct`` / ``direct_compressed``: uncompressed / compressed tensors of at least this many
    bytes get a bucket of their own (0: none do). Prioritized requests: see
    :data:`PRIORITY_BUCKET_BYTES`."""
    buckets: list[list[int]] = []
    open_bucket: dict[tuple, tuple[int, int]] = {}  # key -> (bucket index, bytes so far)
    caps: dict[tuple, int] = {}                     # key -> cap of its prioritized buckets
    for i, resp in enumerate(responses):
        key = fusion_key(resp, min_compress_bytes)
        size = nbytes(resp) if key is not None else 0
        limit = threshold
        if key is not None:
            # auto: reduced like an uncompressed tensor wherever it chose none (one host)
            alone = direct if key[4] == "none" or key[4].startswith("auto") \
                else direct_compressed
            if alone and size >= alone:
                buckets.append([i])       # large: its own bucket, reduced in place
                continue
            if resp.request.priority:
                key = key + (True,)
                limit = min(threshold, caps.setdefault(key, PRIORITY_BUCKET_BYTES))
        if key is not None and key in open_bucket:
            b, used = open_bucket[key]
            if used + size <= limit:
                buckets[b].append(i)
                open_bucket[key] = (b, used + size)
                continue
            if key in caps:                # the next prioritized bucket may be larger
                caps[key] *= 2
                limit = min(threshold, caps[key])
        buckets.append([i])
        if key is not None and size < limit:
            open_bucket[key] = (len(buckets) - 1, size)   # a big one leaves the open bucket be
    return buckets


class FusionBuffer:
    """A growable 1-D buffer per dtype, reused across buckets to avoid allocations."""

    def __init__(self) -> None:
        self._bufs: dict[Any, np.ndarray] = {}

    def get(self, dtype: np.dtype, numel: int, xp: Any = np) -> np.ndarray:
        """A view of ``numel`` elements (contents undefined)."""
        key = (np.dtype(dtype), xp.__name__)
        buf = self._bufs.get(key)
        if buf is None or buf.size < numel:
            buf = xp.empty(max(numel, 1), dtype=dtype)
            self._bufs[key] = buf
        return buf[:numel]

    def release(self) -> None:
        self._bufs.clear()

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._bufs.values())
