"""One rank's side of negotiation, as pure logic: caches, its tree node, and the slow mode.

The engine hands it what the rank submitted (:meth:`Negotiator.submit_named`,
:meth:`Negotiator.submit_ordered`), its children's reports, and every batch
(:meth:`Negotiator.absorb`); :meth:`Negotiator.outgoing` says what to send up the control tree
(rank 0 feeds its :class:`~.controller.Coordinator` instead). A request goes into the tree's bit
vectors when this rank's response (or signature) cache already holds it and no rank has joined
or left; otherwise it goes to rank 0 in this rank's :class:`~.messages.RankMessage`.
Transport, threads and execution stay in the engine, so a whole job can be simulated in one
process (``benchmarks/control_scale.py``, tests/unit/test_negotiation.py).
"""
from __future__ import annotations

import time
from typing import Callable

from .cache import ResponseCache, SignatureCache
from .controller import Coordinator
from .messages import Batch, Coll, OrderedItem, RankMessage, Report, Request, Response, signature
from .tree import DEFAULT_FANOUT, Node


class Negotiator:
    """See module docstring. ``coordinator`` is given on rank 0 only."""

    def __init__(self, rank: int, size: int, cache_capacity: int,
                 fanout: int = DEFAULT_FANOUT, demote_after: float = 10.0,
                 coordinator: Coordinator | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.rank, self.size = rank, size
        self.cache = ResponseCache(cache_capacity)
        self.sigcache = SignatureCache(cache_capacity)
        self.node = Node(rank, size, fanout, demote_after, clock)
        self.coordinator = coordinator
        if coordinator is not None:
            coordinator.partial = self.node.has_partial
        self._where: dict[int, dict[int, int]] = {0: {r: r for r in range(size)}}
        self.slow_mode = False
        self._msg = RankMessage()
        self._own = 0                  # cache ids submitted since the last outgoing()

    @property
    def parent(self) -> int | None:
        return self.node.parent

    @property
    def children(self) -> tuple[int, ...]:
        return self.node.children

    def index(self, pset: int) -> int | None:
        """This rank's position in process set ``pset`` (None: not a member, or unknown)."""
        where = self._where.get(pset)
        return None if where is None else where.get(self.rank)

    # -- this rank's submissions ------------------------------------------------------------
    def submit_named(self, req: Request) -> None:
        where = self._where.get(req.pset)
        cid = self.cache.lookup(req) if where is not None and self.rank in where else -1
        if cid < 0:
            self._msg.requests.append(req)
        elif self.slow_mode:
            self._msg.cached.append(cid)
        else:
            self._own |= 1 << cid

    def submit_ordered(self, pset: int, stream: int, seq: int, req: Request) -> None:
        sid = self.sigcache.lookup(signature(req)) if self.index(pset) is not None else -1
        if sid >= 0 and not self.slow_mode:
            self.node.own_ordered(pset, stream, seq, sid)
        else:
            self._msg.ordered.append((pset, stream, seq, sid if sid >= 0 else req))

    def submit_shutdown(self) -> None:
        self._msg.shutdown = True

    # -- the tree ---------------------------------------------------------------------------
    def from_child(self, child: int, data: bytes) -> None:
        self.node.receive(child, Report.decode(data))

    def child_lost(self, child: int) -> None:
        self.node.lost(child)

    def outgoing(self) -> bytes | None:
        """The report to send the parent now (None: nothing). On rank 0 everything goes to
        the coordinator here and None is returned."""
        if self._own:
            self.node.own_named(self._own)
            self._own = 0
        msg = self._msg
        if msg:
            self._msg = RankMessage()
        if self.coordinator is not None:
            if msg:
                self.coordinator.receive(self.rank, msg)
            rep = self.node.collect()
            if rep is not None:
                self.coordinator.take(rep)
            return None
        if msg:
            self.node.relay(self.rank, msg.encode())
        rep = self.node.collect()
        return rep.encode() if rep is not None else None

    def scan(self, now: float) -> bool:
        """The node's stall scan; True when it has a report to send."""
        return self.node.scan(now)

    def next_deadline(self, now: float) -> float:
        return self.node.next_deadline(now)

    # -- batches ----------------------------------------------------------------------------
    def absorb(self, batch: Batch) -> list[Response]:
        """Apply ``batch`` to the caches, the process sets and the tree node (before it is
        passed to the children and executed); returns its responses, in order."""
        cache, sigcache, node = self.cache, self.sigcache, self.node
        joined = batch.joined
        responses: list[Response] = []
        named: list[int] = []
        ordered: list[tuple[int, int]] = []
        for item in batch.items:
            if type(item) is int:
                resp = cache.get(item)
                named.append(item)
            elif isinstance(item, OrderedItem):
                resp = item.payload
                if isinstance(resp, int):
                    resp = sigcache.get(resp)
                elif not joined:
                    sigcache.add(resp, self.index(resp.request.pset))
                ordered.append((item.pset, item.stream))
            else:
                resp = item
                req = resp.request
                old = cache.id_of(req.key)
                if old >= 0:
                    named.append(old)
                if not joined:
                    new = cache.add(resp, self.index(req.pset))
                    if new >= 0:
                        node.add_id(new, req.pset)
                if not resp.error:
                    if req.coll == Coll.ADD_PSET:
                        self._where[resp.value] = {r: i for i, r in enumerate(req.splits)}
                        node.add_pset(resp.value, tuple(req.splits))
                    elif req.coll == Coll.REMOVE_PSET:
                        self._where.pop(req.root, None)
                        node.remove_pset(req.root)
            responses.append(resp)
        node.resolve(named, ordered)
        if batch.demote or batch.demote_ordered:
            node.demote(batch.demote, batch.demote_ordered)
        slow = bool(batch.joined or batch.gone)
        if slow != self.slow_mode:
            self.slow_mode = slow
            node.set_slow(slow)
        return responses
