"""Applying an agreed batch on this rank: tuned settings, gone ranks, the caches, the bucket
plan (fusion, remembered for repeated batches), process-set changes, then each bucket through
execution's door (:func:`.run.run`).

:class:`BatchRunner` is a mixin of :class:`~..engine.Engine` (it uses the engine's in-flight
table, ordered streams, groups and settings under the engine's locks).
"""
from __future__ import annotations

import time
from typing import Any

from ..control.messages import Batch, Coll, OrderedItem, Response
from . import fusion
from .run import run as run_bucket

PLAN_CACHE = 64             # remembered bucket plans of repeated batches


class _Work:
    """An agreed batch in the backlog: prepared (responses, entries, buckets) when it reaches
    the head, then executed bucket by bucket."""

    __slots__ = ("batch", "buckets", "entries", "next", "responses", "touched")

    def __init__(self, batch: Batch, responses: list) -> None:
        self.batch, self.responses = batch, responses
        self.buckets: list | None = None         # None: not prepared yet
        self.entries: list = []
        self.next = 0
        self.touched: set[int] = set()


class BatchRunner:
    """Executing agreed batches, as the engine does it (see module docstring)."""

    _driving_for: Any = None     # the handle the thread stepping now waits for (None: none)
    _running = False             # _run_backlog is on the stack (a batch agreed meanwhile waits)

    def _execute(self, batch: Batch) -> None:
        """Apply an agreed batch to the caches and the tree node (in arrival order, as it
        arrives), queue it behind the batches not yet executed, and execute what may run."""
        responses = self.neg.absorb(batch)
        self._send_up()           # what the batch demoted goes up rank by rank
        self._backlog.append(_Work(batch, responses))
        if not self._running:
            self._run_backlog()

    def _prepare(self, work: _Work) -> bool:
        """Apply a batch that reached the head of the backlog: settings, gone ranks, this
        rank's entries, the bucket plan. Done in backlog order on every rank, whenever the
        batch arrived. False when there is nothing to execute (lingering)."""
        batch, responses = work.batch, work.responses
        if batch.settings:
            self._apply_settings(batch.settings)
        if batch.gone:
            self.status.gone_ranks = frozenset(batch.gone)
        entries = self.submissions.claim(batch.items, responses,
                                         lambda pset: self.neg.index(pset) is not None)
        if self._lingering:       # shut down here: only relaying for the children
            if batch.shutdown:
                self._remote_shutdown(batch.shutdown)
            return False
        if self.tracer.enabled:
            self.tracer.instant("engine", "CYCLE", time.perf_counter(), step=self.batches,
                                responses=len(responses))
        work.entries = entries
        work.buckets = self._plan(batch, responses)
        return True

    def _run_backlog(self) -> None:
        """Execute agreed buckets in order, batch after batch, until none is left or the
        background thread should stop at a bucket boundary because a user thread waits
        (:meth:`_should_yield`). What is left stays in the backlog, which every step executes
        first, so the order is the same on every rank. Handles complete bucket by bucket, so
        a thread waiting without driving wakes when its own bucket is done.

        Before each bucket this rank reports what was submitted meanwhile (``_pump``: the
        backlog may never be empty while the wire is busy), and rank 0 asks the coordinator
        for the next batch before the last bucket of the last batch, so that the other ranks
        have it when they finish this one, and what completed meanwhile with a higher
        priority goes next."""
        backlog = self._backlog
        self._running = True
        try:
            while backlog:
                work = backlog[0]
                if work.buckets is None and not self._prepare(work):
                    backlog.popleft()
                    continue
                buckets, responses, entries = work.buckets, work.responses, work.entries
                while work.next < len(buckets):
                    if self._should_yield():
                        return
                    self._pump()        # report new submissions (children's reports, too)
                    if self.coordinator is not None and work.next == len(buckets) - 1 and \
                            len(backlog) == 1:
                        self._coordinate()            # queued behind this batch
                    bucket = buckets[work.next]
                    work.next += 1
                    first = responses[bucket[0]]
                    req = first.request
                    work.touched.add(req.pset)
                    if not first.error and req.coll in (Coll.ADD_PSET, Coll.REMOVE_PSET):
                        self.psets.change(first)      # the engine's groups change here
                    if run_bucket(self.groups.get(req.pset), [responses[i] for i in bucket],
                                  [entries[i] for i in bucket], self.status.joined, self.tracer,
                                  self._notify) and req.coll == Coll.JOIN:
                        self.status.joined = False
                backlog.popleft()
                self.psets.stepped(work.touched)
                self.batches += 1
                if work.batch.shutdown:
                    self._remote_shutdown(work.batch.shutdown)
        finally:
            self._running = False

    def _resume(self, handle: Any) -> bool:
        """Execute the backlog first in a step; True when the step should end here (buckets
        are left, or the driver's ``handle`` is done)."""
        self._run_backlog()
        return bool(self._backlog) or (handle is not None and handle._done)

    def _should_yield(self) -> bool:
        """Stop executing at this bucket boundary? The background thread stops as soon as a
        user thread drives (waits in ``synchronize()``), which then executes the next bucket
        itself instead of waiting for the rest of the batch. A driver goes on to the end of
        the backlog (handing the engine back and forth between threads costs more than the
        buckets it would leave: a thread that must not wait for the rest waits without
        driving, as cross-barrier mode's pre-forward hooks do)."""
        return self._driving_for is None and self._drivers > 0 and not self.status.stopping

    def _backlog_entries(self) -> list:
        """Take the entries of every bucket not yet executed (to fail their handles; those of
        batches not yet prepared are still in the in-flight table)."""
        entries = []
        for work in self._backlog:
            for bucket in (work.buckets or [])[work.next:]:
                entries.extend(work.entries[i] for i in bucket if work.entries[i] is not None)
        self._backlog.clear()
        return entries

    def _plan(self, batch: Batch, responses: list[Response]) -> list[list[int]]:
        """fusion.plan, remembered for batches made only of cache ids (training repeats the
        same batches step after step; ids name the same responses for the whole run)."""
        key = None
        if not batch.joined and all(isinstance(i, int) or (isinstance(i, OrderedItem) and
                                                            isinstance(i.payload, int))
                                    for i in batch.items):
            key = (tuple(batch.items), self.settings.fusion_threshold,
                   self.settings.min_compress_bytes)
            buckets = self._plans.get(key)
            if buckets is not None:
                return buckets
        buckets = fusion.plan(responses, self.settings.fusion_threshold,
                              self.settings.min_compress_bytes, *self._direct)
        if key is not None:
            if len(self._plans) >= PLAN_CACHE:
                self._plans.pop(next(iter(self._plans)))
            self._plans[key] = buckets
        return buckets

    def _notify(self, event: str, **info: Any) -> None:
        for listener in self.listeners:
            listener(event, **info)

    def _apply_settings(self, settings: dict) -> None:
        """Tuned settings from the coordinator, applied by every rank at the same batch."""
        self.psets.apply(settings)
        if self.coordinator is not None:
            if "cycle_time" in settings:
                self.coordinator.cycle_time = float(settings["cycle_time"]) / 1000.0
            if "fusion_threshold" in settings:
                self.coordinator.fusion_threshold = self.settings.fusion_threshold
