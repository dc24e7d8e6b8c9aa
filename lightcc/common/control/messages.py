"""Request, Response and their wire encoding.

A :class:`Request` is what one rank asks for (one tensor, one collective). The coordinator
(rank 0) turns requests that every rank has made into a :class:`Response`: the agreed
description of the collective, including per-rank data that differs legitimately (allgather
first dimensions, alltoall splits). Responses travel in a :class:`Batch`; a response already
in every rank's response cache travels as its integer id only.

Up the control tree (tree.py) travels a :class:`Report` per message: what a subtree
agreed on in the steady state (bit vectors of response-cache ids, ordered positions), and the
:class:`RankMessage` of each rank that needs rank 0's attention, relayed as opaque bytes.

Messages are plain tuples pickled with the highest protocol: small (tens of bytes for a cached
steady-state round) and fast to encode, without a schema compiler.
"""
from __future__ import annotations

import math
import pickle
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, NamedTuple

from .. import dtypes


class Coll(IntEnum):
    """Collective types. Tensor names are scoped per type."""

    ALLREDUCE = 0
    ALLGATHER = 1
    BROADCAST = 2
    ALLTOALL = 3
    REDUCESCATTER = 4
    BARRIER = 5
    JOIN = 6
    ADD_PSET = 7
    REMOVE_PSET = 8


COLL_NAMES = {c: c.name.lower() for c in Coll}


class Request(NamedTuple):
    """One rank's request; ``key`` (type, process set, name) identifies it across ranks.

    A named tuple rather than a dataclass: it is built, hashed (response-cache lookup) and
    pickled on every collective, and tuples do all three several times faster.
    """

    coll: Coll
    name: str
    dtype: str = ""
    shape: tuple[int, ...] = ()
    op: str = ""
    root: int = -1
    prescale: float = 1.0
    postscale: float = 1.0
    splits: tuple[int, ...] = ()
    compression: str = "none"
    pset: int = 0
    device: bool = False          # the tensor lives in GPU memory (never fused with host ones)
    #: 0: none. 1, 2, ...: the coordinator sends ready allreduces with a priority in ascending
    #: order, at most PRIORITY_WINDOW_BYTES per batch (cross-barrier mode: forward order).
    priority: int = 0

    @property
    def key(self) -> tuple[int, int, str]:
        return (int(self.coll), self.pset, self.name)

    def to_tuple(self) -> tuple:
        return (int(self.coll), *self[1:])

    @classmethod
    def from_tuple(cls, t: tuple) -> "Request":
        return cls(Coll(t[0]), *t[1:])

    def describe(self) -> str:
        return f"{COLL_NAMES[self.coll]} '{self.name}'"

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor (0 for requests without one: barrier, join, process sets)."""
        if self.dtype not in dtypes.SUPPORTED:
            return 0
        return int(math.prod(self.shape)) * dtypes.itemsize(self.dtype)


@dataclass(frozen=True)
class Response:
    """The agreed collective for one key, or an error for it.

    ``request`` is the canonical request (rank-specific fields taken from the first rank);
    ``per_rank`` holds per-rank data in rank order of the process set: first dimensions for
    allgather, split lists for alltoall, empty otherwise. ``error`` is set for failures.
    """

    request: Request
    per_rank: tuple = ()
    error: str = ""
    error_kind: str = ""          # "mismatch", "stall", "shutdown", "join", ...
    value: int = -1               # JOIN: last rank to join; ADD_PSET: new process set id

    def to_tuple(self) -> tuple:
        return (self.request.to_tuple(), self.per_rank, self.error, self.error_kind, self.value)

    @classmethod
    def from_tuple(cls, t: tuple) -> "Response":
        return cls(Request.from_tuple(t[0]), t[1], t[2], t[3], t[4])

    def request_of(self, index_in_set: int) -> Request:
        """The request a given member rank must have made for this response to match it."""
        req = self.request
        if req.coll == Coll.ALLGATHER and self.per_rank:
            first = self.per_rank[index_in_set]
            return _replace(req, shape=(first, *req.shape[1:]))
        if req.coll == Coll.ALLTOALL and self.per_rank:
            splits = self.per_rank[index_in_set]
            first = int(sum(splits))
            return _replace(req, shape=(first, *req.shape[1:]), splits=tuple(splits))
        return req


def _replace(req: Request, **changes: Any) -> Request:
    return req._replace(**changes)


#: ``stream`` of the shared ordered stream of a process set (every collective type); streams
#: ``0..`` are per collective type (``int(Coll)``), used for Horovod's unnamed collectives.
SHARED_STREAM = -1
#: First element of an ordered request's key, ``(ORDERED, pset, stream, seq)``.
ORDERED = -1


def signature(req: Request) -> Request:
    """What ranks must agree on for an ordered request: the request without its local label."""
    return req._replace(name="")


class OrderedItem(NamedTuple):
    """A batch entry for the next request of an ordered stream: ``payload`` is a
    signature-cache id, or a (new or failed) :class:`Response`."""

    pset: int
    stream: int
    payload: Any


# ---- rank -> coordinator ------------------------------------------------------------------
@dataclass
class RankMessage:
    """What a rank tells the coordinator since its last message.

    ``cached`` are response-cache ids of resubmitted tensors, ``requests`` new ones,
    ``shutdown`` that this rank is leaving. ``ordered`` lists this rank's new ordered requests
    as ``(pset, stream, seq, payload)``: ``seq`` is the request's position on its stream (the
    rank's count of its requests there, positions skipped while joined included) and
    ``payload`` a signature-cache id or the full :class:`Request`.

    In the steady state most requests do not travel here at all: cached ones are agreed in
    the control tree's bit vectors (tree.py). A rank sends a message only for what is
    new, changed, or while ranks have joined or left.
    """

    cached: list[int] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)
    shutdown: bool = False
    ordered: list[tuple[int, int, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.cached or self.requests or self.shutdown or self.ordered)

    def encode(self) -> bytes:
        ordered = [(ps, st, sq, p if isinstance(p, int) else p.to_tuple())
                   for ps, st, sq, p in self.ordered]
        return pickle.dumps((self.cached, [r.to_tuple() for r in self.requests], self.shutdown,
                             ordered), protocol=pickle.HIGHEST_PROTOCOL)

    @classmethod
    def decode(cls, data: bytes) -> "RankMessage":
        cached, reqs, shutdown, ordered = pickle.loads(data)
        return cls(list(cached), [Request.from_tuple(t) for t in reqs], bool(shutdown),
                   [(ps, st, sq, p if isinstance(p, int) else Request.from_tuple(p))
                    for ps, st, sq, p in ordered])


# ---- coordinator -> ranks -----------------------------------------------------------------
@dataclass
class Batch:
    """An ordered list of responses every rank executes in the same order.

    Each item is an ``int`` (a cached response id), a ``Response``, or an :class:`OrderedItem`
    (the next request of an ordered stream); a new response
    that fits in the cache is added to every rank's cache in the order it appears here, so
    ids agree everywhere. ``joined`` are the ranks that had called ``join()`` when the batch
    was made (they contribute zeros). ``shutdown`` carries a reason when the job's lightcc
    must stop on every rank (coordinator shutdown). ``settings`` holds tuned settings (fusion
    threshold, algorithm, ...) that take effect from this batch on, on every rank at once.
    ``gone`` are the ranks that shut down or exited so far (the direct path of small unnamed
    allreduces stops waiting for them, direct.py). While ``joined`` or ``gone`` is non-empty
    every rank reports to rank 0 directly (the *slow mode*, tree.py).

    ``demote`` (response-cache ids) and ``demote_ordered`` (``(pset, stream, seq)``) name what
    rank 0 needs reported rank by rank: a request some rank sent in full while others may have
    reported it in the control tree's bit vectors (tree.py).
    """

    items: list[Any] = field(default_factory=list)
    joined: tuple[int, ...] = ()
    shutdown: str = ""
    settings: dict[str, Any] = field(default_factory=dict)
    gone: tuple[int, ...] = ()
    demote: tuple[int, ...] = ()
    demote_ordered: tuple[tuple[int, int, int], ...] = ()

    def encode(self) -> bytes:
        return pickle.dumps(([_encode_item(i) for i in self.items], self.joined, self.shutdown,
                             self.settings, self.gone, self.demote, self.demote_ordered),
                            protocol=pickle.HIGHEST_PROTOCOL)

    @classmethod
    def decode(cls, data: bytes) -> "Batch":
        items, joined, shutdown, settings, gone, demote, demote_ordered = pickle.loads(data)
        return cls([_decode_item(i) for i in items], tuple(joined), shutdown, dict(settings),
                   tuple(gone), tuple(demote), tuple(demote_ordered))


def _encode_item(item: Any) -> Any:
    """int (cached id) as is; a Response as its tuple; an OrderedItem as a 3-list."""
    if isinstance(item, int):
        return item
    if isinstance(item, OrderedItem):
        p = item.payload
        return [item.pset, item.stream, p if isinstance(p, int) else p.to_tuple()]
    return item.to_tuple()


def _decode_item(item: Any) -> Any:
    if isinstance(item, int):
        return item
    if isinstance(item, list):
        pset, stream, p = item
        return OrderedItem(pset, stream, p if isinstance(p, int) else Response.from_tuple(p))
    return Response.from_tuple(item)


# ---- up the control tree ------------------------------------------------------------------
@dataclass
class Report:
    """What a node of the control tree sends its parent (tree.py), in this order of
    meaning: ``slow`` are ``(rank, RankMessage bytes)`` relayed unopened; ``named_details``
    ``(cache id, ((lo, hi), ...), age s)`` and ``ordered_details`` ``(pset, stream, seq,
    ((lo, hi, signature id), ...), age s)`` say which ranks of the subtree reported something
    that is no longer agreed in bit vectors (it stalled, or rank 0 asked for it); ``lost`` are
    ranks cut off (their connection, or their relay's, closed). ``named`` is a bit vector of
    response-cache ids that every member in the subtree reported; ``ordered`` lists complete
    ordered positions as ``(pset, stream, seq, value)`` with ``value`` one signature id, or
    ``((lo, hi, id), ...)`` when ranks reported different ids. Ranges are of world ranks.
    """

    named: int = 0
    ordered: list = field(default_factory=list)
    named_details: list = field(default_factory=list)
    ordered_details: list = field(default_factory=list)
    slow: list = field(default_factory=list)
    lost: list = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.named or self.ordered or self.named_details or self.ordered_details
                    or self.slow or self.lost)

    def encode(self) -> bytes:
        return pickle.dumps((self.named, self.ordered, self.named_details, self.ordered_details,
                             self.slow, self.lost), protocol=pickle.HIGHEST_PROTOCOL)

    @classmethod
    def decode(cls, data: bytes) -> "Report":
        return cls(*pickle.loads(data))
