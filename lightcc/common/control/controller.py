"""Negotiation as pure logic: what every rank reported -> ordered responses.

The :class:`Coordinator` runs on rank 0 inside the engine but does no communication. It decides
which collectives are ready on every rank, validates that the ranks agree (shape, dtype, op,
root, scale factors, compressor, collective type), holds small ready tensors up to the cycle
time while others are still arriving (so they can be fused), reports stalls, and tracks join()
and process sets; :meth:`Coordinator.tick` returns the next :class:`~.messages.Batch`.
Unit-tested without MPI.

It hears about requests in two ways (tree.py has the control tree):

- **complete, from the tree** (:meth:`Coordinator.take`): response-cache ids every member
  reported, and ordered positions, agreed in bit vectors on the way up. The steady state: the
  work here is per tensor, not per (rank, tensor) pair.
- **rank by rank**: :meth:`Coordinator.receive` takes one rank's
  :class:`~.messages.RankMessage` (new and changed requests, joins, shutdowns, everything in
  the slow mode), and the tree's *details* say which ranks reported a demoted id or position.
  While such a request is incomplete and others may have reported it in bit vectors, the next
  batch demotes it (``Batch.demote``) so that every node reports it rank by rank too.

Two ways to match requests across ranks:

- **by name** (Horovod's model): key ``(collective type, process set, name)``; ranks may submit
  in any order. A request already agreed on travels as its response-cache id.
- **by position** on an *ordered stream* (torch.distributed's model, and Horovod's unnamed
  collectives): key ``(ORDERED, process set, stream, seq)``, where ``seq`` is the request's
  position on its stream. No names are needed; a request whose signature was agreed before
  travels as its signature-cache id. Positions of a stream are answered in order.

The work per message and per tick is proportional to what arrived and what became ready, not to
everything pending: readiness is tracked as requests arrive, ranks are looked up in dicts, and
the scan for stalls, departed ranks and joins runs at most once a second (or when a rank joins
or leaves).
"""
from __future__ import annotations

import math
import time
from typing import Any, Callable

from .cache import ResponseCache, SignatureCache
from .checks import JOIN_OK, _fmt_ranks, _is_ordered, _Pending, validate  # noqa: F401
from .messages import ORDERED, Batch, Coll, OrderedItem, RankMessage, Report, Request, Response
from .tree import bits, members_in
from .outcomes import SCAN_PERIOD_S, Outcomes  # noqa: F401


class Coordinator(Outcomes):
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
        self._where: dict[int, dict[int, int]] = {0: {r: r for r in range(size)}}
        self._sorted: dict[int, tuple[int, ...]] = {0: self.psets[0]}
        self._next_pset = 1
        self.pending: dict[tuple, _Pending] = {}
        self.joined: list[int] = []
        self.gone: set[int] = set()
        self.lost: set[int] = set()          # gone without a shutdown message (exited, died)
        self.newly_lost: list[int] = []      # lost since the engine last logged them
        self._gone_sent = 0                  # how many gone ranks the last batch announced
        self._joined_sent: tuple[int, ...] = ()
        self.pending_settings: dict = {}
        self.warnings: list[str] = []
        #: complete keys in completion order -> a cache id (agreed in the tree), an
        #: OrderedItem (ordered: agreed in the tree, or an error), or a _Pending to validate
        self._ready: dict[tuple, Any] = {}
        self._ready_since = 0.0                       # when _ready became non-empty
        self._ready_bytes = 0
        self._ready_urgent = False                    # a ready non-allreduce: flush at once
        self._open = 0                                # pending entries not complete yet
        self._names: dict[tuple[int, str], set[int]] = {}   # (pset, name) -> pending types
        self._suspects: set[tuple[int, str]] = set()        # names pending under 2+ types
        self._next_pos: dict[tuple[int, int], int] = {}     # (pset, stream) -> next seq
        self._parked: dict[tuple[int, int], dict[int, Any]] = {}   # complete, out of order
        self._undemoted: set[tuple] = set()
        self._slow_sent = False              # the last batch put the ranks in the slow mode
        self._info: dict[int, tuple] = {}    # cache id -> (key, nbytes, allreduce?)
        self.partial: Callable[[], bool] = lambda: False   # rank 0's node has partial state
        self.fast_keys = 0                   # keys agreed in the tree (statistics)
        self.slow_pairs = 0                  # (rank, request) pairs handled one by one
        self.demoted_keys = 0                # keys the tree was asked to detail
        self._rescan = False
        self._next_scan = -math.inf

    # -- input: rank by rank ----------------------------------------------------------------
    def receive(self, rank: int, msg: RankMessage) -> None:
        """Record what ``rank`` submitted (cache ids are expanded to its full requests)."""
        now = self.clock()
        for cid in msg.cached:
            resp = self.cache.get(cid)
            self._add(rank, resp.request_of(self._index(resp.request.pset, rank)), cid, now,
                      None)
        for req in msg.requests:
            self._add(rank, req, -1, now, None)
        for pset, stream, seq, payload in msg.ordered:
            if seq < self._next_pos.get((pset, stream), 0):
                continue            # that position was decided without it (a late report)
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
            self.newly_lost.append(rank)
            self._rescan = True

    # -- input: from the control tree -------------------------------------------------------
    def take(self, rep: Report) -> None:
        """What rank 0's node collected: relayed messages, details, lost ranks, then what the
        tree agreed on (in this order: see tree.py)."""
        for rank, data in rep.slow:
            self.receive(rank, RankMessage.decode(data))
        for cid, ranges, age in rep.named_details:
            resp = self.cache.get(cid)
            self._expand(resp, ranges, cid, age, None)
        for pset, stream, seq, parts, age in rep.ordered_details:
            self._ordered_parts(pset, stream, seq, parts, age)
        for rank in rep.lost:
            self.lose(rank)
        if rep.named:
            self._complete_named(rep.named)
        for pset, stream, seq, value in rep.ordered:
            if type(value) is int:
                if seq >= self._next_pos.get((pset, stream), 0):
                    self.fast_keys += 1
                    resp = self.sigcache.get(value)
                    self._enqueue((ORDERED, pset, stream, seq), OrderedItem(pset, stream, value),
                                  resp.request)
            else:
                self._ordered_parts(pset, stream, seq, value, 0.0)

    def _complete_named(self, done: int) -> None:
        info = self._info
        for cid in bits(done):
            got = info.get(cid)
            if got is None:
                req = self.cache.get(cid).request
                got = info[cid] = (req.key, req.nbytes, req.coll == Coll.ALLREDUCE)
            key, nbytes, allreduce = got
            if key in self.pending:       # a late report of an earlier round: this one wins
                self._drop(key)
            if not self._ready:
                self._ready_since = self.clock()
            self._ready[key] = cid
            if allreduce:
                self._ready_bytes += nbytes
            else:
                self._ready_urgent = True
        self.fast_keys += done.bit_count()

    def _ordered_parts(self, pset: int, stream: int, seq: int, parts: tuple, age: float) -> None:
        if seq < self._next_pos.get((pset, stream), 0):
            return
        key = (ORDERED, pset, stream, seq)
        for lo, hi, sid in parts:
            self._expand(self.sigcache.get(sid), ((lo, hi),), sid, age, key)

    def _expand(self, resp: Response, ranges, cid: int, age: float, key: tuple | None) -> None:
        """Every member of the response's set in ``ranges`` reported it (as id ``cid``)."""
        pset = resp.request.pset
        where = self._where.get(pset)
        if where is None:
            return
        now = self.clock() - age
        for lo, hi in ranges:
            for r in members_in(self._sorted[pset], lo, hi):
                self._add(r, resp.request_of(where[r]), cid, now, key)

    def _index(self, pset: int, rank: int) -> int:
        where = self._where.get(pset)
        return where.get(rank, 0) if where is not None else 0

    def _add(self, rank: int, req: Request, cid: int, now: float, key: tuple | None) -> None:
        self.slow_pairs += 1
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
            self._open += 1
            self._undemoted.add(key)
            if self.gone and not self.gone.isdisjoint(self._where.get(key[1], ())):
                self._rescan = True          # it needs a rank that left: fail it soon
        elif now < entry.first_seen:
            entry.first_seen = now
        entry.reqs[rank] = req
        if cid >= 0:
            entry.ids[rank] = cid
        if entry.ready_at is None:
            size = len(self.psets.get(key[1], ()))
            if self.joined or self.gone:
                if len(entry.reqs) + len(self.joined) >= size and \
                        not self._missing(key, entry)[0]:
                    self._mark_ready(key, entry, now)
            elif len(entry.reqs) == size:
                self._mark_ready(key, entry, now)

    def _mark_ready(self, key: tuple, entry: _Pending, now: float) -> None:
        if self.gone and self._missing(key, entry)[1]:
            return       # a member shut down: the scan turns it into an error
        entry.ready_at = now
        self._open -= 1
        self._enqueue(key, entry, next(iter(entry.reqs.values())))

    def _enqueue(self, key: tuple, payload: Any, req: Request) -> None:
        """Make ``key`` ready; ordered positions wait for the earlier ones of their stream."""
        if _is_ordered(key):
            stream = key[1:3]
            nxt = self._next_pos.get(stream, 0)
            if key[3] != nxt:
                self._parked.setdefault(stream, {})[key[3]] = (payload, req)
                return
            self._push(key, payload, req)
            parked = self._parked.get(stream)
            nxt += 1
            while parked and nxt in parked:
                self._push((ORDERED, *stream, nxt), *parked.pop(nxt))
                nxt += 1
            self._next_pos[stream] = nxt
        else:
            self._push(key, payload, req)

    def _push(self, key: tuple, payload: Any, req: Request) -> None:
        if not self._ready:
            self._ready_since = self.clock()
        self._ready[key] = payload
        if isinstance(payload, OrderedItem) and isinstance(payload.payload, Response):
            self._ready_urgent = True          # an error: deliver it now
        elif req.coll == Coll.ALLREDUCE:
            self._ready_bytes += req.nbytes
        else:
            self._ready_urgent = True

    # -- decisions --------------------------------------------------------------------------
    def apply_settings(self, settings: dict, fusion_threshold: int) -> None:
        """Tuned settings of a batch as rank 0 executes it: the cycle time (ms in ``settings``)
        and the fusion threshold every rank now uses (bytes)."""
        if "cycle_time" in settings:
            self.cycle_time = float(settings["cycle_time"]) / 1000.0
        if "fusion_threshold" in settings:
            self.fusion_threshold = fusion_threshold

    def next_deadline(self) -> float:
        """Seconds until :meth:`tick` has something time-driven to do (hold expiry, scan)."""
        now = self.clock()
        wait = self._next_scan - now if self.pending else math.inf
        if self._ready:
            wait = min(wait, self._ready_since + self.cycle_time - now)
        if self._rescan or self._ready_urgent or self._suspects or self.pending_settings or \
                (self._undemoted and not self._slow_sent):
            wait = 0.0
        return max(wait, 0.0)

    def tick(self) -> Batch | None:
        """The next batch to execute, or None when nothing should be sent now."""
        now = self.clock()
        self.warnings = []
        errors: list = self._type_mismatches() if self._suspects else []
        if self._rescan or now >= self._next_scan:
            self._scan(now, errors)
        items: list = []
        for key, resp in errors:
            entry = self.pending.pop(key, None)
            if entry is None:
                continue
            self._forget_name(key)
            if entry.ready_at is None:
                self._open -= 1
                if _is_ordered(key):       # in its stream's order, like an answer
                    self._enqueue(key, OrderedItem(key[1], key[2], resp), resp.request)
                    continue
            else:
                self._unready(key, entry)
                if _is_ordered(key):       # an answered position: the error takes its place
                    self._replace(key, OrderedItem(key[1], key[2], resp))
                    continue
            items.append(resp)
        batch_joined = tuple(sorted(self.joined))
        if self._ready and ((not self._open and not self.partial()) or self._must_flush(now)):
            ready, self._ready = self._ready, {}
            self._ready_bytes = 0
            self._ready_urgent = False
            for key, payload in self._by_priority(ready):
                items.append(self._respond(key, payload, batch_joined))
        if self.joined and len(self.gone | set(self.joined)) == self.size:   # all alive joined
            items.append(Response(Request(Coll.JOIN, "join"), value=self.joined[-1]))
            self.joined = []
            self._rescan = True
        demote, demote_ordered = self._demotions()
        news = len(self.gone) != self._gone_sent or batch_joined != self._joined_sent
        if not (items or self.pending_settings or news or demote or demote_ordered):
            return None
        self._gone_sent = len(self.gone)
        self._joined_sent = batch_joined
        batch = Batch(items=items, joined=batch_joined, settings=self.pending_settings,
                      gone=tuple(sorted(self.gone)), demote=demote,
                      demote_ordered=demote_ordered)
        slow = bool(batch_joined or self.gone)
        if self._slow_sent and not slow:    # back to bit vectors: ask for the rest in detail
            self._undemoted = {k for k, e in self.pending.items() if not e.demoted}
        self._slow_sent = slow
        self.pending_settings = {}
        return batch

    def _demotions(self) -> tuple[tuple[int, ...], tuple[tuple[int, int, int], ...]]:
        """Incomplete requests that some ranks may have reported in bit vectors: the tree
        must report them rank by rank (not needed in the slow mode: everything is)."""
        if not self._undemoted or self._slow_sent:
            self._undemoted.clear()
            return (), ()
        named, ordered = [], []
        for key in self._undemoted:
            entry = self.pending.get(key)
            if entry is None or entry.ready_at is not None or entry.demoted:
                continue
            entry.demoted = True
            self.demoted_keys += 1
            if _is_ordered(key):
                ordered.append(key[1:])
            else:
                cid = self.cache.id_of(key)
                if cid >= 0:
                    named.append(cid)
        self._undemoted.clear()
        return tuple(named), tuple(ordered)

    def _must_flush(self, now: float) -> bool:
        return (self._ready_urgent or now - self._ready_since >= self.cycle_time
                or self._ready_bytes >= self.fusion_threshold)

    def _unready(self, key: tuple, entry: _Pending) -> None:
        if key in self._ready:
            req = next(iter(entry.reqs.values()))
            if req.coll == Coll.ALLREDUCE:
                self._ready_bytes -= req.nbytes
            if not _is_ordered(key):
                del self._ready[key]

    def _drop(self, key: tuple) -> None:
        entry = self.pending.pop(key)
        self._forget_name(key)
        if entry.ready_at is None:
            self._open -= 1
        else:
            self._unready(key, entry)

    def _replace(self, key: tuple, item: OrderedItem) -> None:
        """An error for an ordered position already complete (ready, or parked behind an
        earlier one): it goes out in that position's place."""
        if key in self._ready:
            self._ready[key] = item
            self._ready_urgent = True
        else:
            parked = self._parked.setdefault(key[1:3], {})
            parked[key[3]] = (item, item.payload.request)
