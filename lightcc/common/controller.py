"""Negotiation as pure logic: requests from all ranks -> ordered responses.

The :class:`Coordinator` runs on rank 0 inside the engine thread but does no communication:
the engine feeds it each rank's :class:`~.messages.RankMessage` and asks :meth:`tick` for the
next :class:`~.messages.Batch`. It decides which tensors are ready on every rank, validates
that the ranks agree (shape, dtype, op, root, scale factors, compressor, collective type),
holds small ready tensors up to the cycle time while others are still arriving (so they can
be fused), reports stalls, and tracks join() and process sets. Unit-tested without MPI.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

from .cache import ResponseCache
from .messages import COLL_NAMES, Batch, Coll, RankMessage, Request, Response

JOIN_OK = (Coll.ALLREDUCE, Coll.ALLGATHER, Coll.BARRIER)


@dataclass
class _Pending:
    first_seen: float
    reqs: dict[int, Request] = field(default_factory=dict)
    ids: dict[int, int] = field(default_factory=dict)
    warned_at: float = -math.inf
    ready_at: float | None = None


def _fmt_ranks(ranks) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


class Coordinator:
    """Rank 0's decision maker (see module docstring). Times are seconds."""

    def __init__(self, size: int, cache_capacity: int, cycle_time: float,
                 fusion_threshold: int, stall_check: float = 60.0, stall_shutdown: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.size = size
        self.cache = ResponseCache(cache_capacity)
        self.cycle_time = cycle_time
        self.fusion_threshold = fusion_threshold
        self.stall_check = stall_check
        self.stall_shutdown = stall_shutdown
        self.clock = clock
        self.psets: dict[int, tuple[int, ...]] = {0: tuple(range(size))}
        self._next_pset = 1
        self.pending: dict[tuple, _Pending] = {}
        self.joined: list[int] = []
        self.gone: set[int] = set()
        self.pending_settings: dict = {}
        self.warnings: list[str] = []

    # -- input ------------------------------------------------------------------------------
    def receive(self, rank: int, msg: RankMessage) -> None:
        """Record what ``rank`` submitted (cache ids are expanded to its full requests)."""
        now = self.clock()
        for cid in msg.cached:
            resp = self.cache.get(cid)
            members = self.psets.get(resp.request.pset, ())
            index = members.index(rank) if rank in members else 0
            self._add(rank, resp.request_of(index), cid, now)
        for req in msg.requests:
            self._add(rank, req, -1, now)
        if msg.shutdown:
            self.gone.add(rank)

    def _add(self, rank: int, req: Request, cid: int, now: float) -> None:
        if req.coll == Coll.JOIN:
            if rank not in self.joined:
                self.joined.append(rank)
            return
        entry = self.pending.setdefault(req.key, _Pending(first_seen=now))
        entry.reqs[rank] = req
        if cid >= 0:
            entry.ids[rank] = cid

    # -- decisions --------------------------------------------------------------------------
    def _missing(self, key: tuple, entry: _Pending) -> tuple[set[int], set[int]]:
        """(ranks still missing, ranks that shut down before submitting) for one key."""
        members = self.psets.get(key[1])
        if members is None:
            return set(), set()
        present = set(entry.reqs)
        joined = set(self.joined) if key[1] == 0 and key[0] in JOIN_OK else set()
        missing = set(members) - present - joined
        return missing - self.gone, missing & self.gone

    def tick(self) -> Batch | None:
        """The next batch to execute, or None when nothing should be sent now."""
        now = self.clock()
        self.warnings = []
        errors: list[Response] = self._type_mismatches()
        ready: list[tuple] = []
        partial = False
        for key, entry in self.pending.items():
            missing, gone = self._missing(key, entry)
            if gone:
                errors.append(self._error(entry, "shutdown",
                                          f"{_fmt_ranks(gone)} shut down before submitting it"))
            elif missing and key[1] == 0 and key[0] not in JOIN_OK and \
                    missing <= set(self.joined):
                errors.append(self._error(entry, "join",
                                          f"{_fmt_ranks(missing)} called join(); only allreduce "
                                          f"and allgather work while ranks are joined"))
            elif not missing:
                if entry.ready_at is None:
                    entry.ready_at = now
                ready.append(key)
            else:
                partial = True
                self._check_stall(key, entry, missing, now, errors)
        for resp in errors:
            self.pending.pop(resp.request.key, None)
        ready = [k for k in ready if k in self.pending]
        ready.sort(key=lambda k: self.pending[k].ready_at)
        if ready and partial and not self._must_flush(ready, now):
            ready = []
        items: list = [*errors]
        batch_joined = tuple(sorted(self.joined))
        for key in ready:
            items.append(self._respond(key, self.pending.pop(key), batch_joined))
        alive = set(range(self.size)) - self.gone
        if self.joined and alive <= set(self.joined):
            req = Request(Coll.JOIN, "join")
            items.append(Response(req, value=self.joined[-1]))
            self.joined = []
        if not items and not self.pending_settings:
            return None
        batch = Batch(items=items, joined=batch_joined, settings=self.pending_settings)
        self.pending_settings = {}
        return batch

    def _must_flush(self, ready: list[tuple], now: float) -> bool:
        waited = now - min(self.pending[k].ready_at for k in ready)
        if waited >= self.cycle_time:
            return True
        nbytes = 0
        for k in ready:
            req = next(iter(self.pending[k].reqs.values()))
            if req.coll != Coll.ALLREDUCE:
                return True
            nbytes += req.nbytes
        return nbytes >= self.fusion_threshold

    def _check_stall(self, key: tuple, entry: _Pending, missing: set[int], now: float,
                     errors: list[Response]) -> None:
        age = now - entry.first_seen
        desc = next(iter(entry.reqs.values())).describe()
        if self.stall_shutdown > 0 and age >= self.stall_shutdown:
            errors.append(self._error(entry, "stall",
                                      f"stalled for {age:.1f} s: submitted by "
                                      f"{_fmt_ranks(entry.reqs)}, never by {_fmt_ranks(missing)}"))
        elif self.stall_check > 0 and age >= self.stall_check and \
                now - entry.warned_at >= self.stall_check:
            entry.warned_at = now
            self.warnings.append(
                f"stall: {desc} has waited {age:.1f} s; ready on {_fmt_ranks(entry.reqs)}, "
                f"missing {_fmt_ranks(missing)}")

    def _type_mismatches(self) -> list[Response]:
        """Errors for names that every member submitted, but under different collective types."""
        by_name: dict[tuple[int, str], list[tuple]] = {}
        for key in self.pending:
            if key[0] not in (Coll.BARRIER, Coll.ADD_PSET, Coll.REMOVE_PSET):
                by_name.setdefault((key[1], key[2]), []).append(key)
        errors = []
        for (pset, name), keys in by_name.items():
            if len(keys) < 2:
                continue
            members = set(self.psets.get(pset, ()))
            entries = [self.pending[k] for k in keys]
            if any(not (members - set(e.reqs)) for e in entries):
                continue  # one type is complete: a legitimate reuse of the name
            if members - set().union(*(set(e.reqs) for e in entries)):
                continue
            detail = "; ".join(f"{_fmt_ranks(e.reqs)} submitted {COLL_NAMES[Coll(k[0])]}"
                               for k, e in zip(keys, entries))
            for e in entries:
                errors.append(self._error(e, "mismatch",
                                          f"collective type differs across ranks: {detail}"))
        return errors

    def _error(self, entry: _Pending, kind: str, text: str) -> Response:
        ref = next(iter(entry.reqs.values()))
        return Response(ref, error=f"{ref.describe()}: {text}", error_kind=kind)

    def _respond(self, key: tuple, entry: _Pending, joined: tuple[int, ...]) -> int | Response:
        members = self.psets[key[1]]
        ids = set(entry.ids.values())
        if not joined and len(ids) == 1 and len(entry.ids) == len(entry.reqs) == len(members):
            return ids.pop()
        resp = validate(members, entry.reqs, joined if key[1] == 0 else ())
        if resp.error:
            return resp
        if resp.request.coll == Coll.ADD_PSET:
            resp = Response(resp.request, value=self._next_pset)
            self.psets[self._next_pset] = tuple(resp.request.splits)
            self._next_pset += 1
        elif resp.request.coll == Coll.REMOVE_PSET:
            self.psets.pop(resp.request.root, None)
        if not joined:
            self.cache.add(resp, None)
        return resp


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
                                   f"only allreduce and allgather work while ranks are joined",
                        error_kind="join")
    checks = [("dtype", lambda q: q.dtype, str), ("op", lambda q: q.op, str),
              ("prescale factor", lambda q: q.prescale, str),
              ("postscale factor", lambda q: q.postscale, str),
              ("compression", lambda q: q.compression, str)]
    if ref.coll in (Coll.ALLREDUCE, Coll.BROADCAST, Coll.REDUCESCATTER):
        checks.append(("shape", lambda q: q.shape, _shape))
    if ref.coll in (Coll.ALLGATHER, Coll.ALLTOALL):
        checks.append(("number of dimensions", lambda q: len(q.shape), str))
        checks.append(("shape after the first dimension", lambda q: q.shape[1:], _shape))
    if ref.coll == Coll.BROADCAST:
        checks.append(("root rank", lambda q: q.root, str))
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
