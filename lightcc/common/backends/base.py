"""The ``Communicator`` protocol: the only thing algorithms and compressors see.

A communicator is a fixed group of ranks (world, the ranks on one node, or the ranks with the
same local rank on every node). Buffers are 1-D, C-contiguous arrays (NumPy, or CuPy for a
device backend) of a dtype the backend supports; counts and displacements are in elements.
Every call is blocking from the caller's view and must be made by all members in the same
order (the engine's negotiation guarantees that). Implementations count the bytes they send
and receive in :attr:`Communicator.stats` so benchmarks can report wire bytes.

Reduction ops are the strings in :data:`REDUCE_OPS`; averaging is done by the caller
(sum, then scale), so backends never see it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

REDUCE_OPS = ("sum", "min", "max", "prod", "band", "bor", "bxor")


@dataclass
class WireStats:
    """Bytes and calls moved by one communicator, as counted by its backend."""

    bytes_sent: int = 0
    bytes_received: int = 0
    calls: dict[str, int] = field(default_factory=dict)

    def add(self, call: str, sent: int, received: int) -> None:
        self.bytes_sent += int(sent)
        self.bytes_received += int(received)
        self.calls[call] = self.calls.get(call, 0) + 1

    def snapshot(self) -> dict[str, Any]:
        return {"bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received,
                "calls": dict(self.calls)}


class Request(Protocol):
    """A non-blocking operation. A completed receive also tells ``source`` (the sending rank)
    and ``nbytes`` (bytes received)."""

    def wait(self) -> None:
        """Block until the operation completes (raises the backend's error if it failed)."""

    def test(self) -> bool:
        """True once complete; never blocks."""

    def cancel(self) -> None:
        """Withdraw a pending receive; returns once the buffer is free."""


@runtime_checkable
class Communicator(Protocol):
    """A group of ranks that run collectives together (see module docstring)."""

    rank: int
    size: int
    name: str            # "world", "local", "cross", "row", ... (for logs and the timeline)
    stats: WireStats
    is_device: bool      # True when buffers live on a GPU (CuPy arrays)
    # called between the pieces of a long point-to-point exchange (None: nothing to do); the
    # engine passes new submissions on to the coordinator there, see Engine._pump
    progress: Callable[[], None] | None

    def allreduce(self, buf: Any, op: str = "sum") -> None:
        """Reduce ``buf`` over all ranks, in place."""

    def prepare_agreement(self) -> None:
        """Collective, before a bucket whose success the ranks must agree on (see agree)."""

    def agree(self, failed: bool, what: str, timeout: float) -> list[int]:
        """Ranks (of this communicator) on which the bucket failed, exchanged on a channel
        that no data collective uses; a failed rank gives up after ``timeout`` seconds."""

    def allgatherv(self, sendbuf: Any, recvbuf: Any, counts: Sequence[int]) -> None:
        """Concatenate every rank's ``sendbuf`` (``counts[r]`` elements) into ``recvbuf``."""

    def reduce_scatterv(self, sendbuf: Any, recvbuf: Any, counts: Sequence[int],
                        op: str = "sum") -> None:
        """Reduce ``sendbuf`` over ranks; rank r receives block r (``counts[r]`` elements)."""

    def alltoallv(self, sendbuf: Any, sendcounts: Sequence[int], recvbuf: Any,
                  recvcounts: Sequence[int]) -> None:
        """Block r of ``sendbuf`` goes to rank r; block s of ``recvbuf`` comes from rank s."""

    def bcast(self, buf: Any, root: int) -> None:
        """Copy ``root``'s ``buf`` into every rank's ``buf``."""

    def isend(self, buf: Any, dest: int, tag: int = 0) -> Request:
        """Start sending ``buf`` to ``dest``."""

    def irecv(self, buf: Any, source: int | None, tag: int = 0) -> Request:
        """Start receiving into ``buf`` from ``source`` (None: from any rank)."""

    def barrier(self) -> None:
        """Wait until every rank has called it."""

    def split(self, color: int, key: int, name: str) -> "Communicator":
        """A sub-communicator of the ranks that passed the same ``color``, ordered by ``key``."""

    def free(self) -> None:
        """Release the communicator's resources (collective)."""


def even_counts(total: int, parts: int) -> list[int]:
    """Split ``total`` elements into ``parts`` blocks, the first ``total % parts`` one larger."""
    base, extra = divmod(int(total), int(parts))
    return [base + (1 if i < extra else 0) for i in range(parts)]


def displacements(counts: Sequence[int]) -> list[int]:
    """Start offsets of consecutive blocks of the given sizes."""
    out, acc = [], 0
    for c in counts:
        out.append(acc)
        acc += int(c)
    return out


def num_pieces(nbytes: int, piece_bytes: int, max_pieces: int | None = None) -> int:
    """``ceil(nbytes / piece_bytes)``, at least 1 and at most ``max_pieces`` (None: no cap)."""
    n = -(-int(nbytes) // max(1, int(piece_bytes)))
    return max(1, n if max_pieces is None else min(int(max_pieces), n))


def sub_blocks(counts: Sequence[int], k: int) -> tuple[list[list[int]], list[list[int]]]:
    """Cut each block of a buffer of consecutive blocks (``counts``) into ``k`` sub-blocks.

    Returns ``(sizes, starts)``: sub-block ``j`` of block ``r`` is ``sizes[r][j]`` elements
    starting at offset ``starts[r][j]`` of the whole buffer (the same split on every rank).
    """
    sizes = [even_counts(c, k) for c in counts]
    starts = [[base + off for off in displacements(sz)]
              for base, sz in zip(displacements(counts), sizes)]
    return sizes, starts
