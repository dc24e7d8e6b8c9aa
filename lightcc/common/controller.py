"""Negotiation as pure logic: requests from all ranks -> ordered responses.

The :class:`Coordinator` runs on rank 0 inside the engine but does no communication: the engine
feeds it each rank's :class:`~.messages.RankMessage` and asks :meth:`Coordinator.tick` for the
next :class:`~.messages.Batch`. It decides which tensors are ready on every rank, validates that
the ranks agree (shape, dtype, op, root, scale factors, compressor, collective type), holds small
ready tensors up to the cycle time while others are still arriving (so they can be fused),
reports stalls, and tracks join() and process sets. Unit-tested without MPI.

Two ways to match requests across ranks:

- **by name** (Horovod's model): key ``(collective type, process set, name)``; ranks may submit
  in any order. A request already agreed on travels as its response-cache id.
- **by position** on an *ordered stream* (torch.distributed's model, and Horovod's unnamed
  collectives): key ``(ORDERED, process set, stream, seq)``, where ``seq`` counts a rank's
  requests on that stream. No names are needed; a request whose signature was agreed before
  travels as its signature-cache id.

The work per message and per tick is proportional to what arrived and what became ready, not to
everything pending: readiness is tracked as requests arrive, and the scan for stalls, departed
ranks and joins runs at most once a second (or when a rank joins or leaves).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

from .cache import ResponseCache, SignatureCache
from .messages import (COLL_NAMES, ORDERED, Batch, Coll, OrderedItem, RankMessage, Request,
                       Response)

#: What works while some ranks have called join() (they contribute zeros to an allreduce), as
#: in Horovod; allgather, broadcast, alltoall and reducescatter fail with an error instead.
JOIN_OK = (Coll.ALLREDUCE, Coll.BARRIER)
SCAN_PERIOD_S = 1.0     # longest time between two scans for stalls


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


def _is_ordered(key: tuple) -> bool:
    return key[0] == ORDERED


class Coordinator:
    """Rank 0's decision maker (see module docstring). Times are seconds."""

    def __init__(self, size: int, cache_capacity: int, cycle_time: float,
                 fusion_threshold: int, stall_check: float = 60.0, stall_shutdown: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.size = size
        self.cache = ResponseCache(cache_capacity)
        self.sigcache = SignatureCache(cache_capacity)
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
        self.lost: set[int] = set()          # gone without a shutdown message (exited, died)
        self._gone_sent = 0                  # how many gone ranks the last batch announced
        self.pending_settings: dict = {}
        self.warnings: list[str] = []
        self._ready: dict[tuple, None] = {}          # complete keys, in completion order
        self._ready_bytes = 0
        self._ready_urgent = False                    # a ready non-allreduce: flush at once
        self._names: dict[tuple[int, str], set[int]] = {}   # (pset, name) -> pending types
        self._suspects: set[tuple[int, str]] = set()        # names pending under 2+ types
        self._next_seq: dict[tuple[int, int, int], int] = {}  # (rank, pset, stream) -> seq
        self._rescan = False
        self._next_scan = -math.inf

    # -- input ------------------------------------------------------------------------------
    def receive(self, rank: int, msg: RankMessage) -> None:
        """Record what ``rank`` submitted (cache ids are expanded to its full requests)."""
        now = self.clock()
        for cid in msg.cached:
            resp = self.cache.get(cid)
            self._add(rank, resp.request_of(self._index(resp.request.pset, rank)), cid, now,
                      None)
        for req in msg.requests:
            self._add(rank, req, -1, now, None)
        for pset, stream, payload in msg.ordered:
            k = (rank, pset, stream)
            seq = self._next_seq.get(k, 0)
            self._next_seq[k] = seq + 1
            key = (ORDERED, pset, stream, seq)
            if isinstance(payload, int):
                resp = self.sigcache.get(payload)
                self._add(rank, resp.request_of(self._index(pset, rank)), payload, now, key)
            else:
                self._add(rank, payload, -1, now, key)
        if msg.shutdown and rank not in self.gone:
            self.gone.add(rank)
            self._rescan = True

    def lose(self, rank: int) -> None:
        """``rank``'s connection ended without a shutdown message (the process is gone)."""
        if rank not in self.gone:
            self.lost.add(rank)
            self.gone.add(rank)
            self._rescan = True

    def _index(self, pset: int, rank: int) -> int:
        members = self.psets.get(pset, ())
        return members.index(rank) if rank in members else 0

    def _add(self, rank: int, req: Request, cid: int, now: float, key: tuple | None) -> None:
        if req.coll == Coll.JOIN:
            if rank not in self.joined:
                self.joined.append(rank)
                self._rescan = True
            return
        if key is None:
            key = req.key
            names = self._names.setdefault((req.pset, req.name), set())
            names.add(int(req.coll))
            if len(names) > 1 and req.coll not in (Coll.BARRIER, Coll.ADD_PSET,
                                                    Coll.REMOVE_PSET):
                self._suspects.add((req.pset, req.name))
        entry = self.pending.get(key)
        if entry is None:
            entry = self.pending[key] = _Pending(first_seen=now)
        entry.reqs[rank] = req
        if cid >= 0:
            entry.ids[rank] = cid
        if entry.ready_at is None:
            if self.joined or self.gone:
                if not self._missing(key, entry)[0]:
                    self._mark_ready(key, entry, now)
            elif len(entry.reqs) == len(self.psets.get(key[1], ())):
                self._mark_ready(key, entry, now)

    def _mark_ready(self, key: tuple, entry: _Pending, now: float) -> None:
        if self.gone and self._missing(key, entry)[1]:
            return       # a member shut down: the scan turns it into an error
        entry.ready_at = now
        self._ready[key] = None
        req = next(iter(entry.reqs.values()))
        if req.coll == Coll.ALLREDUCE:
            self._ready_bytes += req.nbytes
        else:
            self._ready_urgent = True

    # -- decisions --------------------------------------------------------------------------
    def _missing(self, key: tuple, entry: _Pending) -> tuple[set[int], set[int]]:
        """(ranks still missing, ranks that shut down before submitting) for one key."""
        members = self.psets.get(key[1])
        if members is None:
            return set(), set()
        present = entry.reqs.keys()
        if len(present) == len(members) and not self.gone:
            return set(), set()
        joined = set(self.joined) if key[1] == 0 else set()   # validate() rejects what
        missing = set(members) - set(present) - joined
        return missing - self.gone, missing & self.gone

    def next_deadline(self) -> float:
        """Seconds until :meth:`tick` has something time-driven to do (hold expiry, scan)."""
        now = self.clock()
        wait = self._next_scan - now if self.pending else math.inf
        if self._ready:
            first = self.pending.get(next(iter(self._ready)))
            if first is not None and first.ready_at is not None:
                wait = min(wait, first.ready_at + self.cycle_time - now)
        if self._rescan or self._suspects or self.pending_settings:
            wait = 0.0
        return max(wait, 0.0)

    def tick(self) -> Batch | None:
        """The next batch to execute, or None when nothing should be sent now."""
        now = self.clock()
        self.warnings = []
        errors: list = self._type_mismatches() if self._suspects else []
        if self._rescan or now >= self._next_scan:
            self._scan(now, errors)
        for item in errors:
            key = self._error_key(item)
            entry = self.pending.pop(key, None)
            if entry is not None and entry.ready_at is not None:
                self._unready(key, entry)
        items: list = [self._error_item(e) for e in errors]
        batch_joined = tuple(sorted(self.joined))
        if self._ready and (len(self._ready) == len(self.pending) or self._must_flush(now)):
            ready = list(self._ready)
            self._ready.clear()
            self._ready_bytes = 0
            self._ready_urgent = False
            for key in ready:
                items.append(self._respond(key, self.pending.pop(key), batch_joined))
        alive = set(range(self.size)) - self.gone
        if self.joined and alive <= set(self.joined):
            items.append(Response(Request(Coll.JOIN, "join"), value=self.joined[-1]))
            self.joined = []
            self._rescan = True
        gone_news = len(self.gone) != self._gone_sent
        if not items and not self.pending_settings and not gone_news:
            return None
        self._gone_sent = len(self.gone)
        batch = Batch(items=items, joined=batch_joined, settings=self.pending_settings,
                      gone=tuple(sorted(self.gone)))
        self.pending_settings = {}
        return batch

    def _must_flush(self, now: float) -> bool:
        first = self.pending[next(iter(self._ready))]
        return (self._ready_urgent or now - first.ready_at >= self.cycle_time
                or self._ready_bytes >= self.fusion_threshold)

    def _unready(self, key: tuple, entry: _Pending) -> None:
        self._ready.pop(key, None)
        req = next(iter(entry.reqs.values()))
        if req.coll == Coll.ALLREDUCE:
            self._ready_bytes -= req.nbytes

    def _scan(self, now: float, errors: list) -> None:
        """Stalls, ranks that left, joins: one pass over everything pending."""
        self._rescan = False
        self._next_scan = now + min(SCAN_PERIOD_S, self.stall_check or SCAN_PERIOD_S)
        for key, entry in self.pending.items():
            missing, gone = self._missing(key, entry)
            if gone:
                how = ("exited or lost its connection" if gone <= self.lost
                       else "shut down")
                errors.append((key, self._error(entry, key, "shutdown",
                                                f"{_fmt_ranks(gone)} {how} before "
                                                f"submitting it")))
            elif not missing:
                if entry.ready_at is None:
                    self._mark_ready(key, entry, now)
            else:
                self._check_stall(key, entry, missing, now, errors)

    def _check_stall(self, key: tuple, entry: _Pending, missing: set[int], now: float,
                     errors: list) -> None:
        age = now - entry.first_seen
        desc = self._describe(key, entry)
        if self.stall_shutdown > 0 and age >= self.stall_shutdown:
            errors.append((key, self._error(entry, key, "stall",
                                            f"stalled for {age:.1f} s: submitted by "
                                            f"{_fmt_ranks(entry.reqs)}, never by "
                                            f"{_fmt_ranks(missing)}; "
                                            f"{self._doing(missing, key)}")))
        elif self.stall_check > 0 and age >= self.stall_check and \
                now - entry.warned_at >= self.stall_check:
            entry.warned_at = now
            self.warnings.append(
                f"stall: {desc} has waited {age:.1f} s; ready on {_fmt_ranks(entry.reqs)}, "
                f"missing {_fmt_ranks(missing)}; {self._doing(missing, key)}")

    def _doing(self, ranks: set[int], skip: tuple, most: int = 3) -> str:
        """What ``ranks`` wait for instead: their other pending collectives (for stall text)."""
        parts = []
        for r in sorted(ranks)[:most]:
            waits = [e.reqs[r].describe() for k, e in self.pending.items()
                     if k != skip and r in e.reqs]
            if waits:
                more = f" and {len(waits) - 2} more" if len(waits) > 2 else ""
                parts.append(f"rank {r} waits in {', '.join(waits[:2])}{more}")
            else:
                parts.append(f"rank {r} has submitted nothing that is pending (busy outside "
                             f"lightcc, or it left the loop)")
        if len(ranks) > most:
            parts.append(f"{len(ranks) - most} more ranks")
        return "; ".join(parts)

    def _type_mismatches(self) -> list:
        """Errors for names that every member submitted, but under different collective types."""
        errors = []
        for pset, name in list(self._suspects):
            keys = [(t, pset, name) for t in self._names.get((pset, name), ())
                    if (t, pset, name) in self.pending]
            if len(keys) < 2:
                self._suspects.discard((pset, name))
                continue
            members = set(self.psets.get(pset, ()))
            entries = [self.pending[k] for k in keys]
            if any(not (members - set(e.reqs)) for e in entries):
                continue  # one type is complete: a legitimate reuse of the name
            if members - set().union(*(set(e.reqs) for e in entries)):
                continue
            self._suspects.discard((pset, name))
            detail = "; ".join(f"{_fmt_ranks(e.reqs)} submitted {COLL_NAMES[Coll(k[0])]}"
                               for k, e in zip(keys, entries))
            for k, e in zip(keys, entries):
                errors.append((k, self._error(e, k, "mismatch",
                                              f"collective type differs across ranks: {detail}")))
        return errors

    def _describe(self, key: tuple, entry: _Pending) -> str:
        return next(iter(entry.reqs.values())).describe()

    def _error(self, entry: _Pending, key: tuple, kind: str, text: str) -> Response:
        ref = next(iter(entry.reqs.values()))
        return Response(ref, error=f"{ref.describe()}: {text}", error_kind=kind)

    @staticmethod
    def _error_key(item: tuple) -> tuple:
        return item[0]

    def _error_item(self, item: tuple):
        key, resp = item
        self._forget_name(key)
        if _is_ordered(key):
            return OrderedItem(key[1], key[2], resp)
        return resp

    def _forget_name(self, key: tuple) -> None:
        if not _is_ordered(key):
            types = self._names.get((key[1], key[2]))
            if types is not None:
                types.discard(key[0])
                if not types:
                    del self._names[(key[1], key[2])]

    def _respond(self, key: tuple, entry: _Pending, joined: tuple[int, ...]):
        self._forget_name(key)
        members = self.psets[key[1]]
        ordered = _is_ordered(key)
        cache = self.sigcache if ordered else self.cache
        joined_here = joined if key[1] == 0 else ()
        if ordered and joined_here:
            for r in joined_here:       # a joined rank skips this request: keep it in step
                k = (r, key[1], key[2])
                self._next_seq[k] = max(self._next_seq.get(k, 0), key[3] + 1)
        ids = set(entry.ids.values())
        if not joined and len(ids) == 1 and len(entry.ids) == len(entry.reqs) == len(members):
            cid = ids.pop()
            return OrderedItem(key[1], key[2], cid) if ordered else cid
        resp = validate(members, entry.reqs, joined_here)
        if not resp.error:
            if resp.request.coll == Coll.ADD_PSET:
                resp = Response(resp.request, value=self._next_pset)
                self.psets[self._next_pset] = tuple(resp.request.splits)
                self._next_pset += 1
            elif resp.request.coll == Coll.REMOVE_PSET:
                self.psets.pop(resp.request.root, None)
            if not joined:
                cache.add(resp, None)
        return OrderedItem(key[1], key[2], resp) if ordered else resp


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
              ("memory", lambda q: "GPU" if q.device else "host", str)]
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
