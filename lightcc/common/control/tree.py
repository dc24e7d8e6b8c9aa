"""The control tree: steady-state negotiation without a central bottleneck (pure logic).

Before, every rank told rank 0 the response-cache ids it had ready and rank 0 matched every
(rank, tensor) pair: O(ranks x tensors) work on one core per step (1.7 s per step at 1,024
ranks for a 164-tensor model). Horovod's answer (``CoordinateCacheAndState``) is a bitwise-AND
``MPI_Allreduce`` of per-rank bit vectors of cached tensors every cycle. lightcc keeps its
waiting in the kernel instead (an MPI collective every cycle would spin on a core that training
needs), so it does the same reduction *asynchronously* over a tree of TCP connections:

- The ranks form a tree of fanout ``LCC_CONTROL_FANOUT`` (:func:`layout`; each subtree is a
  contiguous range of ranks, rank 0 is the root). Each rank is a :class:`Node` that aggregates
  what its own rank and its children's subtrees reported.
- **Named cached requests** are bits of a bit vector per source (the rank itself, each child):
  a response-cache id is complete in a subtree when every source has it or has no member of
  the id's process set (``vac``: one mask per source, so a process set waits for its members
  only). A node forwards the ids that became complete and forgets them: one Python-int AND per
  source per message, O(tensors / 8) bytes on the wire, the same work at every rank.
- **Ordered positions** (unnamed calls, torch.distributed) are ``(set, stream, seq)`` keys with
  a signature-cache id per source; a complete position goes up as one id, or as the ranges of
  ranks and the ids they sent when those differ (allgather sizes that changed).
- Rank 0's node feeds what completed to the :class:`~.controller.Coordinator`, which orders it
  into batches (the same order on every rank) and sends them down the tree.

Everything else goes to rank 0 as before, relayed through the tree as opaque bytes: new and
changed requests, joins, process-set changes, shutdowns. When rank 0 cannot decide from bit
vectors it asks for detail: a *demotion* (of one id or position, or of everything while ranks
have joined or left: the *slow mode*) makes every node report which ranks of its subtree
reported it, as ranges, so rank 0 validates rank by rank as before. A node also demotes on its
own what has waited for ``demote_after`` seconds, so stall warnings can still name who is
missing and what each missing rank waits in. Per round of a key, rank 0 hears about it either
entirely through bit vectors or entirely rank by rank: a node that demoted a key never forwards
it as complete, and each connection delivers in order.
"""
from __future__ import annotations

import bisect
import math
import time
from typing import Callable, Iterator

from .messages import Report

DEFAULT_FANOUT = 4


def layout(size: int, fanout: int) -> tuple[list[int], list[tuple[int, ...]], list[int]]:
    """``(parent, children, end)`` per rank of a tree over ``range(size)`` rooted at 0: rank
    ``r``'s subtree is ``range(r, end[r])``, split into at most ``fanout`` near-equal contiguous
    child ranges (``parent[0] == -1``). Depth is about log_fanout(size)."""
    if fanout < 1:
        raise ValueError(f"fanout must be >= 1, got {fanout}")
    parent, children, end = [-1] * size, [()] * size, [size] * size
    stack = [(0, size)] if size else []
    while stack:
        r, hi = stack.pop()
        end[r] = hi
        rest = hi - r - 1
        k = min(fanout, rest)
        kids, lo = [], r + 1
        for i in range(k):
            n = rest // k + (1 if i < rest % k else 0)
            kids.append(lo)
            parent[lo] = r
            stack.append((lo, lo + n))
            lo += n
        children[r] = tuple(kids)
    return parent, children, end


def bits(x: int) -> Iterator[int]:
    """The positions of the set bits of ``x`` (>= 0), lowest first."""
    while x:
        low = x & -x
        yield low.bit_length() - 1
        x ^= low


def members_in(members: tuple[int, ...], lo: int, hi: int) -> list[int]:
    """The members (sorted world ranks) in ``range(lo, hi)``."""
    return list(members[bisect.bisect_left(members, lo):bisect.bisect_left(members, hi)])


class Node:
    """One rank's place in the control tree (see module docstring). Times are seconds.

    Source 0 is the rank itself, source ``i >= 1`` its ``i``-th child's subtree. The engine
    feeds it its own cached requests (:meth:`own_named`, :meth:`own_ordered`), its children's
    reports (:meth:`receive`), and every batch (:meth:`resolve`, :meth:`demote`,
    :meth:`set_slow`, :meth:`add_id`, :meth:`add_pset`); :meth:`collect` returns what to send
    to the parent. No communication happens here.
    """

    def __init__(self, rank: int, size: int, fanout: int = DEFAULT_FANOUT,
                 demote_after: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        parents, children, end = layout(size, fanout)
        self.rank, self.size = rank, size
        self.parent: int | None = parents[rank] if parents[rank] >= 0 else None
        self.children = children[rank]
        self.end = end[rank]                          # this subtree is range(rank, end)
        self.ranges = [(rank, rank + 1)] + [(c, end[c]) for c in self.children]
        self._src = {c: i + 1 for i, c in enumerate(self.children)}
        n = len(self.ranges)
        self.have = [0] * n          # per source: cache ids it reported (this round)
        self.any = 0                 # the union of ``have``: ids partial in this subtree
        self._fresh: list[tuple[float, int]] = []   # (when, ids that became partial then)
        self.vac = [0] * n           # per source: ids whose process set has no member there
        self.live = 0                # ids whose process set has a member in this subtree
        self.demoted = 0             # ids reported range by range until resolved
        self.slow_mode = False       # ranks joined or left: everything goes range by range
        self._members: dict[int, tuple[int, ...]] = {0: tuple(range(size))}
        self._need: dict[int, tuple[int, ...]] = {0: tuple(range(n))}  # pset -> sources
        self.pos: dict[tuple[int, int, int], list] = {}   # (pset, stream, seq) -> [born, {src: v}]
        self.pos_demoted: set[tuple[int, int, int]] = set()
        self.resolved: dict[tuple[int, int], int] = {}     # (pset, stream) -> positions done
        self.demote_after = demote_after
        self.clock = clock
        self._next_scan: float | None = None
        self._prev_partial = 0
        self._done_since = 0
        self._out = Report()

    # -- process sets and ids (from batches, the same on every rank) ------------------------
    def add_pset(self, pset: int, ranks: tuple[int, ...]) -> None:
        members = tuple(sorted(ranks))
        self._members[pset] = members
        self._need[pset] = tuple(i for i, (lo, hi) in enumerate(self.ranges)
                                 if members_in(members, lo, hi))

    def remove_pset(self, pset: int) -> None:
        self._members.pop(pset, None)
        self._need.pop(pset, None)

    def add_id(self, cid: int, pset: int) -> None:
        """A new response-cache id (every rank adds the same ids in batch order)."""
        need = self._need.get(pset)
        if not need:
            return                   # no member here (or an unknown set): never forwarded
        bit = 1 << cid
        self.live |= bit
        if len(need) < len(self.ranges):
            for i in range(len(self.ranges)):
                if i not in need:
                    self.vac[i] |= bit

    # -- input ------------------------------------------------------------------------------
    def own_named(self, ids: int) -> None:
        """This rank submitted the requests cached as the ids in the bit vector ``ids``."""
        self._named_in(0, ids)

    def own_ordered(self, pset: int, stream: int, seq: int, sid: int) -> None:
        """This rank's request at position ``seq`` of an ordered stream is signature ``sid``."""
        self._ordered_in(0, pset, stream, seq, sid)

    def relay(self, rank: int, data: bytes) -> None:
        """A :class:`~.messages.RankMessage` of ``rank`` for rank 0, passed on unopened."""
        self._out.slow.append((rank, data))

    def receive(self, child: int, rep: Report) -> None:
        """A child's report; what it relays is passed on before what it agreed."""
        out = self._out
        out.slow += rep.slow
        out.named_details += rep.named_details
        out.ordered_details += rep.ordered_details
        out.lost += rep.lost
        src = self._src[child]
        if rep.named:
            self._named_in(src, rep.named)
        for pset, stream, seq, value in rep.ordered:
            self._ordered_in(src, pset, stream, seq, value)

    def lost(self, child: int) -> None:
        """``child``'s connection closed: its whole subtree is cut off."""
        lo, hi = self.ranges[self._src[child]]
        self._out.lost += range(lo, hi)

    def _named_in(self, src: int, new: int) -> None:
        conv = new if self.slow_mode else new & self.demoted
        if conv:
            rng = (self.ranges[src],)
            self._out.named_details += [(cid, rng, 0.0) for cid in bits(conv)]
            new ^= conv
        fresh = new & ~self.any
        if fresh:
            self._fresh.append((self.clock(), fresh))
            self.any |= fresh
        self.have[src] |= new

    def _ordered_in(self, src: int, pset: int, stream: int, seq: int, value) -> None:
        if seq < self.resolved.get((pset, stream), 0):
            return                                     # a position already decided
        key = (pset, stream, seq)
        if self.slow_mode or key in self.pos_demoted:
            self._out.ordered_details.append((*key, self._parts({src: value}), 0.0))
            return
        state = self.pos.get(key)
        if state is None:
            state = self.pos[key] = [self.clock(), {}]
        got = state[1]
        got[src] = value
        need = self._need.get(pset)
        if need is not None and len(got) >= len(need):
            del self.pos[key]
            first = got[need[0]]
            if type(first) is int and all(got[i] == first for i in need):
                self._out.ordered.append((*key, first))
            else:
                self._out.ordered.append((*key, self._parts(got)))

    def _parts(self, got: dict) -> tuple:
        """``((lo, hi, signature id), ...)`` for the sources in ``got``."""
        parts: list = []
        for src in sorted(got):
            value = got[src]
            if type(value) is int:
                parts.append((*self.ranges[src], value))
            else:
                parts += value
        return tuple(parts)

    # -- output -----------------------------------------------------------------------------
    def collect(self) -> Report | None:
        """What to send up now (ids complete in this subtree, relayed and demoted reports), or
        None when there is nothing."""
        have = self.have
        done = self.live
        for h, v in zip(have, self.vac):
            done &= h | v
        if done:
            keep = ~done
            for i in range(len(have)):
                have[i] &= keep
            self.any &= keep
            if not self.any:
                self._fresh.clear()
            self._done_since |= done
            self._out.named = done
        if not self._out:
            return None
        out, self._out = self._out, Report()
        return out

    def has_partial(self) -> bool:
        """Whether some source reported something the subtree has not completed."""
        return bool(self.any or self.pos)

    # -- batches ----------------------------------------------------------------------------
    def resolve(self, named: list[int], ordered: list[tuple[int, int]]) -> None:
        """A batch decided the ids in ``named`` (cached, agreed, or failed) and the next
        position of each ``(pset, stream)`` in ``ordered`` (one entry per position): forget
        their state; what arrives for them later belongs to the next round."""
        state = self.demoted | self.any
        clear = 0
        if state:
            for cid in named:
                if state >> cid & 1:
                    clear |= 1 << cid
        if clear:
            keep = ~clear
            for i in range(len(self.have)):
                self.have[i] &= keep
            self.any &= keep
            self.demoted &= keep
            self._done_since |= clear
        for pair in ordered:
            seq = self.resolved.get(pair, 0)
            self.resolved[pair] = seq + 1
            key = (*pair, seq)
            self.pos.pop(key, None)
            self.pos_demoted.discard(key)

    def demote(self, named: tuple[int, ...], ordered: tuple[tuple[int, int, int], ...]) -> None:
        """Rank 0 asks for these rank by rank (until each is resolved)."""
        mask = 0
        for cid in named:
            mask |= 1 << cid
        if mask:
            self._demote_named(mask, None)
        now = self.clock()
        for key in ordered:
            key = tuple(key)
            if key[2] >= self.resolved.get(key[:2], 0):
                self._demote_pos(key, now)

    def set_slow(self, slow: bool) -> None:
        """Enter (demoting everything pending) or leave the slow mode."""
        if slow and not self.slow_mode:
            self._demote_named(self.any, None)
            now = self.clock()
            for key in list(self.pos):
                self._demote_pos(key, now)
        self.slow_mode = slow

    def _demote_named(self, mask: int, age: float | None) -> None:
        """Report the ids in ``mask`` range by range from now on; ``age`` (s) of what was
        reported so far, None: from when they became partial here."""
        now = self.clock()
        for cid in bits(mask & self.any):
            ranges = tuple(self.ranges[i] for i, h in enumerate(self.have) if h >> cid & 1)
            since = next((t for t, b in self._fresh if b >> cid & 1), now)
            self._out.named_details.append((cid, ranges, now - since if age is None else age))
        keep = ~mask
        for i in range(len(self.have)):
            self.have[i] &= keep
        self.any &= keep
        self.demoted |= mask

    def _demote_pos(self, key: tuple[int, int, int], now: float) -> None:
        state = self.pos.pop(key, None)
        if state is not None:
            self._out.ordered_details.append((*key, self._parts(state[1]), now - state[0]))
        self.pos_demoted.add(key)

    # -- stalls -----------------------------------------------------------------------------
    def next_deadline(self, now: float) -> float:
        """Seconds until :meth:`scan` has something to do (inf when nothing is partial)."""
        if self._next_scan is None:
            return math.inf
        return max(self._next_scan - now, 0.0)

    def scan(self, now: float) -> bool:
        """Demote what has been partial for at least ``demote_after`` seconds (an id partial
        at two scans in a row that did not complete in between; a position by its age).
        Returns whether anything was demoted (there is a report to send)."""
        if self._next_scan is not None and now < self._next_scan:
            return False
        partial = self.any
        if not partial and not self.pos:
            self._next_scan = None
            self._prev_partial = self._done_since = 0
            return False
        if self._next_scan is None:       # something partial appeared: start the clock
            self._next_scan = now + self.demote_after
            self._prev_partial, self._done_since = partial, 0
            return False
        self._next_scan = now + self.demote_after
        stuck = partial & self._prev_partial & ~self._done_since
        self._prev_partial, self._done_since = partial & ~stuck, 0
        if stuck:
            self._demote_named(stuck, None)
        self._fresh = [(t, b & self.any) for t, b in self._fresh if b & self.any]
        old = [k for k, st in self.pos.items() if now - st[0] >= self.demote_after]
        for key in old:
            self._demote_pos(key, now)
        return bool(stuck or old)


def demote_after(stall_check: float, stall_shutdown: float) -> float:
    """How long a node lets a partial report wait before rank 0 hears it rank by rank: a
    quarter of the shorter stall limit (so warnings and StallError come on time), between
    0.25 and 10 s; 10 s when both stall checks are off (collective type mismatches of cached
    requests are found then)."""
    limits = [t for t in (stall_check, stall_shutdown) if t > 0]
    if not limits:
        return 10.0
    return min(max(min(limits) / 4.0, 0.25), 10.0)
