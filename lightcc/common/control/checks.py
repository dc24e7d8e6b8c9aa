"""Cross-rank validation of what the members submitted for one collective (pure logic): one
response, or one error naming the ranks and the difference. Also the coordinator's pending-entry
record and small formatting helpers."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .messages import COLL_NAMES, ORDERED, Coll, Request, Response

#: What works while some ranks have called join() (they contribute zeros to an allreduce), as
#: in Horovod; allgather, broadcast, alltoall and reducescatter fail with an error instead.
JOIN_OK = (Coll.ALLREDUCE, Coll.BARRIER)

@dataclass
class _Pending:
    first_seen: float
    reqs: dict[int, Request] = field(default_factory=dict)
    ids: dict[int, int] = field(default_factory=dict)
    warned_at: float = -math.inf
    ready_at: float | None = None
    demoted: bool = False        # the tree was asked to report it rank by rank


def _fmt_ranks(ranks) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def _is_ordered(key: tuple) -> bool:
    return key[0] == ORDERED


def _shape(s: tuple) -> str:
    return "(" + ", ".join(str(d) for d in s) + ("," if len(s) == 1 else "") + ")"


def validate(members: tuple[int, ...], reqs: dict[int, Request],
             joined: tuple[int, ...] = ()) -> Response:
    """One response for the requests of every member (missing ones must be joined ranks)."""
    present = [r for r in members if r in reqs]
    ref_rank = present[0]
    ref = reqs[ref_rank]
    if joined and ref.coll not in JOIN_OK:
        return Response(ref, error=f"{ref.describe()}: {_fmt_ranks(joined)} called join(); "
                                   f"{COLL_NAMES[ref.coll]} is not supported while ranks are "
                                   f"joined (only allreduce and barrier are, as in Horovod)",
                        error_kind="join")
    checks = [("collective", lambda q: COLL_NAMES[q.coll], str),
              ("dtype", lambda q: q.dtype, str), ("op", lambda q: q.op, str),
              ("prescale factor", lambda q: q.prescale, str),
              ("postscale factor", lambda q: q.postscale, str),
              ("compression", lambda q: q.compression, str),
              ("memory", lambda q: "GPU" if q.device else "host", str),
              ("priority", lambda q: q.priority, str)]
    if ref.coll in (Coll.ALLREDUCE, Coll.BROADCAST, Coll.REDUCESCATTER):
        checks.append(("shape", lambda q: q.shape, _shape))
    if ref.coll in (Coll.ALLGATHER, Coll.ALLTOALL):
        checks.append(("number of dimensions", lambda q: len(q.shape), str))
        checks.append(("shape after the first dimension", lambda q: q.shape[1:], _shape))
    if ref.coll == Coll.BROADCAST:
        # requests carry the root's position in the set; errors name the global rank
        checks.append(("root rank", lambda q: members[q.root] if 0 <= q.root < len(members)
                       else q.root, str))
    if ref.coll == Coll.ADD_PSET:
        checks.append(("process set ranks", lambda q: q.splits, str))
    if ref.coll == Coll.REMOVE_PSET:
        checks.append(("process set id", lambda q: q.root, str))
    for what, get, fmt in checks:
        for r in present[1:]:
            if get(reqs[r]) != get(ref):
                return Response(ref, error=f"{ref.describe()}: rank {r} has {what} "
                                           f"{fmt(get(reqs[r]))}, rank {ref_rank} has "
                                           f"{fmt(get(ref))}", error_kind="mismatch")
    per_rank: tuple = ()
    if ref.coll == Coll.ALLGATHER:
        per_rank = tuple(reqs[r].shape[0] if r in reqs else 0 for r in members)
    elif ref.coll == Coll.ALLTOALL:
        per_rank = tuple(tuple(reqs[r].splits) for r in members)
    return Response(ref, per_rank=per_rank)
