"""Executing agreed batches on this rank (:class:`BatchExecutor`): the backlog of batches not
yet executed; for each, when it reaches the head, its tuned settings, gone ranks, this rank's
entries (claimed from :class:`~..submissions.Submissions`) and the bucket plan (fusion,
remembered for repeated batches); then each bucket through execution's door
(:func:`.run.run`), process-set changes included (:class:`~.process_sets.ProcessSets`).

Batches come in one way, through :meth:`BatchExecutor.accept` (the negotiation's delivery, in
agreement order); the engine's step calls :meth:`BatchExecutor.run`. The hooks it is given are
how execution lets the rest of the engine work between buckets: ``pump`` (report what was
submitted meanwhile), ``coordinate`` (rank 0: agree the next batch before the last bucket),
``should_yield`` (a user thread wants to drive), ``on_shutdown`` (a batch said lightcc stopped
everywhere).
"""
from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable

from ..control.messages import Batch, Coll, OrderedItem, Response
from . import fusion
from .process_sets import ProcessSets
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


class BatchExecutor:
    """See module docstring. ``member(pset)``: this rank belongs to process set ``pset``;
    ``coordinator`` (rank 0 only) takes the tuned cycle time and fusion threshold."""

    def __init__(self, submissions: Any, psets: ProcessSets, status: Any,
                 member: Callable[[int], bool], direct: tuple, listeners: list,
                 coordinator: Any, *, pump: Callable[[], None],
                 coordinate: Callable[[], bool] | None, should_yield: Callable[[], bool],
                 on_shutdown: Callable[[str], None]) -> None:
        self.submissions, self.psets, self.status = submissions, psets, status
        self.member, self.direct, self.listeners = member, direct, listeners
        self.coordinator = coordinator
        self.pump, self.coordinate, self.should_yield = pump, coordinate, should_yield
        self.on_shutdown = on_shutdown
        self.batches = 0                     # batches executed
        self._backlog: deque = deque()       # agreed batches not yet (fully) executed
        self._plans: dict[tuple, list[list[int]]] = {}   # see _plan()

    def __bool__(self) -> bool:
        """Agreed buckets are waiting."""
        return bool(self._backlog)

    def accept(self, batch: Batch, responses: list) -> None:
        """Queue an agreed batch behind those not yet executed (:meth:`run` executes it)."""
        self._backlog.append(_Work(batch, responses))

    def _prepare(self, work: _Work) -> bool:
        """Apply a batch that reached the head of the backlog: settings, gone ranks, this
        rank's entries, the bucket plan. Done in backlog order on every rank, whenever the
        batch arrived."""
        batch, responses = work.batch, work.responses
        if batch.settings:
            self.apply_settings(batch.settings)
        if batch.gone:
            self.status.gone_ranks = frozenset(batch.gone)
        entries = self.submissions.claim(batch.items, responses, self.member)
        tracer = self.psets.tracer
        if tracer.enabled:
            tracer.instant("engine", "CYCLE", time.perf_counter(), step=self.batches,
                           responses=len(responses))
        work.entries = entries
        work.buckets = self._plan(batch, responses)

    def run(self) -> None:
        """Execute agreed buckets in order, batch after batch, until none is left or the
        background thread should stop at a bucket boundary because a user thread waits
        (``should_yield``). What is left stays in the backlog, which every step executes
        first, so the order is the same on every rank. Handles complete bucket by bucket, so
        a thread waiting without driving wakes when its own bucket is done.

        Before each bucket this rank reports what was submitted meanwhile (``pump``: the
        backlog may never be empty while the wire is busy), and rank 0 asks the coordinator
        for the next batch before the last bucket of the last batch, so that the other ranks
        have it when they finish this one, and what completed meanwhile with a higher
        priority goes next."""
        backlog, groups = self._backlog, self.psets.groups
        while backlog:
            work = backlog[0]
            if work.buckets is None:
                self._prepare(work)
            buckets, responses, entries = work.buckets, work.responses, work.entries
            while work.next < len(buckets):
                if self.should_yield():
                    return
                self.pump()         # report new submissions (children's reports, too)
                if self.coordinate is not None and work.next == len(buckets) - 1 and \
                        len(backlog) == 1:
                    self.coordinate()             # queued behind this batch
                bucket = buckets[work.next]
                work.next += 1
                first = responses[bucket[0]]
                req = first.request
                work.touched.add(req.pset)
                if not first.error and req.coll in (Coll.ADD_PSET, Coll.REMOVE_PSET):
                    self.psets.change(first)      # the engine's groups change here
                if run_bucket(groups.get(req.pset), [responses[i] for i in bucket],
                              [entries[i] for i in bucket], self.status.joined,
                              self.psets.tracer, self._notify) and req.coll == Coll.JOIN:
                    self.status.joined = False
            backlog.popleft()
            self.psets.stepped(work.touched)
            self.batches += 1
            if work.batch.shutdown:
                self.on_shutdown(work.batch.shutdown)

    def take_unexecuted(self) -> list:
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
        settings = self.psets.settings
        key = None
        if not batch.joined and all(isinstance(i, int) or (isinstance(i, OrderedItem) and
                                                            isinstance(i.payload, int))
                                    for i in batch.items):
            key = (tuple(batch.items), settings.fusion_threshold, settings.min_compress_bytes)
            buckets = self._plans.get(key)
            if buckets is not None:
                return buckets
        buckets = fusion.plan(responses, settings.fusion_threshold,
                              settings.min_compress_bytes, *self.direct)
        if key is not None:
            if len(self._plans) >= PLAN_CACHE:
                self._plans.pop(next(iter(self._plans)))
            self._plans[key] = buckets
        return buckets

    def _notify(self, event: str, **info: Any) -> None:
        for listener in self.listeners:
            listener(event, **info)

    def apply_settings(self, settings: dict) -> None:
        """Tuned settings from the coordinator, applied by every rank at the same batch."""
        self.psets.apply(settings)
        if self.coordinator is not None:
            self.coordinator.apply_settings(settings, self.psets.settings.fusion_threshold)
