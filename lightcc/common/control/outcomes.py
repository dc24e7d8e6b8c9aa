"""What the coordinator answers besides "ready": stalls, ranks that left, collective-type
mismatches, and the responses it builds (validated, cached) for what every member submitted.

:class:`Outcomes` is a mixin of :class:`~.controller.Coordinator` (it reads and updates the
coordinator's pending table, process sets, caches and joined/gone ranks).
"""
from __future__ import annotations

from typing import Any

from .checks import _fmt_ranks, _is_ordered, _Pending, validate
from .messages import COLL_NAMES, Coll, OrderedItem, Request, Response

SCAN_PERIOD_S = 1.0     # longest time between two scans for stalls


#: Bytes of prioritized allreduces (``Request.priority``) one batch carries at most (at least
#: one request; 0: no limit). Rank 0 agrees the next batch before the last bucket of this one
#: (execution/batches.py), so what completes meanwhile with a higher priority overtakes what
#: was held: a first layer's gradient completed at the end of backward waits for at most this
#: much of the later layers' instead of every gradient completed before it. Each batch costs
#: a control message and its buckets a call each: on 2 simulated hosts at 1 Gbit (resmlp fp16,
#: load 4-8) cross-barrier/barrier step time was 1.39x with 4 MB (and 1 MB first buckets),
#: 1.02-1.08x with 16 MB, 1.09-1.15x without a window (docs/cross-barrier.md).
PRIORITY_WINDOW_BYTES = 16 << 20


class Outcomes:
    """Errors and responses of the coordinator (see module docstring)."""

    def _missing(self, key: tuple, entry: _Pending) -> tuple[set[int], set[int]]:
        """(ranks still missing, members that shut down or exited: it cannot run) for one
        key."""
        members = self.psets.get(key[1])
        if members is None:
            return set(), set()
        present = entry.reqs.keys()
        if len(present) == len(members) and not self.gone:
            return set(), set()
        joined = set(self.joined) if key[1] == 0 else set()   # validate() rejects what
        missing = set(members) - set(present) - joined
        return missing - self.gone, self.gone.intersection(members)

    def _scan(self, now: float, errors: list) -> None:
        """Stalls, ranks that left, joins: one pass over everything pending."""
        self._rescan = False
        self._next_scan = now + min(SCAN_PERIOD_S, self.stall_check or SCAN_PERIOD_S)
        for key, entry in self.pending.items():
            missing, gone = self._missing(key, entry)
            if gone:
                how = ("exited or lost its connection" if gone <= self.lost
                       else "shut down")
                when = "submitting it" if gone - entry.reqs.keys() else "it could run"
                errors.append((key, self._error(entry, key, "shutdown",
                                                f"{_fmt_ranks(gone)} {how} before {when}")))
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

    def _forget_name(self, key: tuple) -> None:
        if not _is_ordered(key):
            types = self._names.get((key[1], key[2]))
            if types is not None:
                types.discard(key[0])
                if not types:
                    del self._names[(key[1], key[2])]

    def _respond(self, key: tuple, payload: Any, joined: tuple[int, ...]):
        if type(payload) is int:
            return payload                      # a cache id agreed in the tree
        if isinstance(payload, OrderedItem):
            return payload                      # agreed in the tree, or an error
        entry: _Pending = payload
        del self.pending[key]
        self._forget_name(key)
        members = self.psets[key[1]]
        ordered = _is_ordered(key)
        cache = self.sigcache if ordered else self.cache
        joined_here = joined if key[1] == 0 else ()
        ids = set(entry.ids.values())
        if not joined and len(ids) == 1 and len(entry.ids) == len(entry.reqs) == len(members):
            cid = ids.pop()
            return OrderedItem(key[1], key[2], cid) if ordered else cid
        resp = validate(members, entry.reqs, joined_here)
        if not resp.error:
            if resp.request.coll == Coll.ADD_PSET:
                resp = Response(resp.request, value=self._next_pset)
                self._add_pset(self._next_pset, tuple(resp.request.splits))
                self._next_pset += 1
            elif resp.request.coll == Coll.REMOVE_PSET:
                self.psets.pop(resp.request.root, None)
                self._where.pop(resp.request.root, None)
                self._sorted.pop(resp.request.root, None)
            if not joined:
                cache.add(resp, None)
        return OrderedItem(key[1], key[2], resp) if ordered else resp

    def _add_pset(self, pset: int, ranks: tuple[int, ...]) -> None:
        self.psets[pset] = ranks
        self._where[pset] = {r: i for i, r in enumerate(ranks)}
        self._sorted[pset] = tuple(sorted(ranks))

    def _request_of(self, payload: Any) -> Request | None:
        if type(payload) is int:
            return self.cache.get(payload).request
        if isinstance(payload, _Pending):
            return next(iter(payload.reqs.values()))
        return None                         # an ordered position: never held back

    def _by_priority(self, ready: dict) -> list:
        """What of ``ready`` goes in this batch, in order: requests without a priority in
        completion order, then those with one in ascending priority (ties: completion order),
        at most :data:`PRIORITY_WINDOW_BYTES` of them when it is set (at least one). The rest
        stays ready for the next batch, which rank 0 makes after executing this one, so a higher-priority
        request completed meanwhile overtakes it (decided here, once, for every rank)."""
        plain, ranked = [], []
        for key, payload in ready.items():
            req = self._request_of(payload)
            if req is None or not req.priority:
                plain.append((key, payload))
            else:
                ranked.append((req.priority, len(ranked), key, payload, req))
        if not ranked:
            return plain
        ranked.sort(key=lambda t: t[:2])
        sent, window = 0, PRIORITY_WINDOW_BYTES
        for i, (_, _, key, payload, req) in enumerate(ranked):
            if i and window and sent + req.nbytes > window:
                for _, _, k, p, r in ranked[i:]:      # held: still ready, flushed next tick
                    self._push(k, p, r)
                self._ready_urgent = True
                break
            sent += req.nbytes
            plain.append((key, payload))
        return plain
