"""The engine's side of the control plane (:class:`Negotiation`): reporting this rank's
submissions up the control tree, relaying children's reports and the parent's batches, rank 0's
coordinator, lost connections, and the control-plane part of shutdown.

It owns the :class:`~.transport.ControlPlane`, the :class:`~.negotiator.Negotiator`, rank 0's
:class:`~.controller.Coordinator` and the inbox of batches from the parent. Data flows one way:
it takes new entries from :class:`~..submissions.Submissions` and hands every agreed batch, in
agreement order, to ``deliver(batch, responses)`` (the engine's executor, which only queues
it); it never executes, and no call here waits for execution. A shutdown it learns of goes to
``on_shutdown(reason)``. Every method runs on the thread that steps the engine (under its
progress lock).
"""
from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any, Callable

from .controller import Coordinator
from .messages import Batch
from .negotiator import Negotiator
from .transport import ControlPlane

log = logging.getLogger("lightcc")
MAX_WAIT_S = 1.0            # longest single block in the kernel (stops are also woken)


def _ranks_text(ranks: list[int]) -> str:
    ranks = sorted(set(ranks))
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


class Negotiation:
    """See module docstring. ``status`` is the engine's :class:`~..status.EngineStatus`
    (read here: a rank shut down everywhere sends nothing more)."""

    def __init__(self, plane: ControlPlane, neg: Negotiator, coordinator: Coordinator | None,
                 submissions: Any, status: Any, shutdown_timeout: float,
                 deliver: Callable[[Batch, list], None],
                 on_shutdown: Callable[[str], None]) -> None:
        self.plane, self.neg, self.coordinator = plane, neg, coordinator
        self.submissions, self.status = submissions, status
        self.shutdown_timeout = shutdown_timeout
        self._deliver, self._on_shutdown = deliver, on_shutdown
        self._inbox: deque = deque()         # batches from the parent, not yet handled
        self._closed_seen: set[int] = set()
        self.lingering = False               # shut down here, still relaying for children
        self.flushed_at = 0.0                # when the queue was last reported

    def next_deadline(self, now: float) -> float:
        """Seconds until the node's stall scan or (rank 0) the coordinator's next tick."""
        wait = self.neg.next_deadline(now)
        if self.coordinator is not None:
            wait = min(wait, self.coordinator.next_deadline())
        return wait

    def scan(self, now: float) -> None:
        """What waited too long in the tree goes up rank by rank (the node's stall scan)."""
        if self.neg.scan(now):
            self.send_up()

    def receive(self, frames: list[tuple[int, bytes]]) -> bool:
        """Act on control frames: children's reports, and the parent's batches (those the
        inbox holds too), delivered in order. True when there were frames."""
        self._take_frames(frames)
        while self._inbox and not self.status.shut_down:   # pump() may add to it meanwhile
            self._handle_batch(self._inbox.popleft())
        return bool(frames)

    def check_closed(self) -> bool:
        """Act on connections that ended since the last call; True when some did."""
        if len(self.plane.closed) == len(self._closed_seen):
            return False
        self._peers_closed()
        return True

    def _take_frames(self, frames: list[tuple[int, bytes]]) -> None:
        """Children's reports into the node (and the merged report up); the parent's batches
        into the inbox."""
        children = False
        parent = self.neg.parent
        for src, data in frames:
            if src == parent:
                self._inbox.append(data)
            else:
                self.neg.from_child(src, data)
                children = True
        if children:
            self.send_up()

    def send_up(self) -> None:
        """This rank's report to its parent (rank 0: into the coordinator), if any."""
        data = self.neg.outgoing()
        if data is not None and not self.status.shut_down:
            self.plane.send(self.neg.parent, data)

    def _handle_batch(self, data: bytes) -> None:
        """A batch from the parent: passed on to the children before this rank applies it
        (before any later report of theirs can depend on it), then delivered."""
        for child in self.neg.children:
            self.plane.send(child, data)
        self._accept(Batch.decode(data))

    def _accept(self, batch: Batch) -> None:
        """Apply an agreed batch to the caches and the tree node (in arrival order, as it
        arrives) and deliver it for execution (while lingering: nothing is executed here any
        more, a shutdown batch ends the lingering)."""
        responses = self.neg.absorb(batch)
        self.send_up()           # what the batch demoted goes up rank by rank
        if self.lingering:
            if batch.shutdown:
                self._on_shutdown(batch.shutdown)
            return
        self._deliver(batch, responses)

    def report(self) -> bool:
        """Report new submissions (cache ids into the tree's bit vectors where possible)."""
        if not self.submissions.queue:   # unlocked peek; one queued right after: next step
            return False
        new = self.submissions.take_new()
        now = time.perf_counter()
        self.flushed_at = now
        neg = self.neg
        for entry in new:
            entry.sent_at = now
            req = entry.request
            if entry.stream is None:
                neg.submit_named(req)
            else:
                neg.submit_ordered(req.pset, entry.stream, entry.response_key[3], req)
        self.send_up()
        return True

    def pump(self) -> None:
        """Between the pieces of a long exchange (``Communicator.progress``), on the thread
        that executes it: report new submissions, and on a rank with children in the control
        tree take in their reports and pass them on, so the next batch is agreed while this
        one is on the wire.

        Without it the thread that executes a bucket is also the only one that negotiates:
        at 1 Gbit a gradient produced while a 100 ms bucket was on the wire was announced
        only after it, and its bucket started a round trip and a gather period late (30 ms
        idle wire per step in the MLP benchmark). Nothing executes here: batches from the
        parent wait in the inbox for the step after the bucket (rank 0 ticks the coordinator
        only there)."""
        if self.submissions.queue:
            self.report()
        if self.neg.children:
            self._take_frames(self.plane.poll(0.0))

    def coordinate(self) -> bool:
        """Rank 0: ask the coordinator for a batch; send it down the tree and deliver it."""
        batch = self.coordinator.tick()
        for text in self.coordinator.warnings:
            log.warning("%s", text)
        if self.coordinator.newly_lost:
            lost, self.coordinator.newly_lost = self.coordinator.newly_lost, []
            log.warning("%s closed its lightcc connection without shutdown() (it exited, or "
                        "its relay in the control tree did); collectives that need it will "
                        "fail", _ranks_text(lost))
        if batch is None:
            return False
        if self.neg.children:
            data = batch.encode()
            for child in self.neg.children:
                self.plane.send(child, data)
        self._accept(batch)
        return True

    def _peers_closed(self) -> None:
        """Connections that ended: a child (its subtree is cut off) or the parent (this rank
        can no longer reach the coordinator)."""
        new = self.plane.closed - self._closed_seen
        self._closed_seen |= new
        parent = self.neg.parent
        lost = sorted(new - {parent})
        for child in lost:
            self.neg.child_lost(child)
        if lost:
            self.send_up()
        if parent in new and not self.status.shut_down:
            reason = ("rank 0 (the coordinator) closed its connection (it exited or called "
                      "shutdown())" if parent == 0 else
                      f"rank {parent}, this rank's relay to rank 0 in the control tree, closed "
                      f"its connection (it exited)")
            for child in self.neg.children:   # they cannot reach rank 0 either
                self.plane.send(child, Batch(shutdown=reason).encode())
            self._on_shutdown(reason)

    # ---- shutdown ------------------------------------------------------------------------------
    def stop(self) -> None:
        """This rank shuts down (its handles already failed): tell the tree, relay for the
        children while they still need it, close the plane."""
        if self.coordinator is not None:
            data = Batch(shutdown="rank 0 (the coordinator) called shutdown()").encode()
            for child in self.neg.children:
                self.plane.send(child, data)
        elif not self.status.shut_down:
            self.neg.submit_shutdown()
            self.send_up()
            if self.neg.children:
                self._linger()
        self.plane.close()

    def _linger(self) -> None:
        """Shut down here, but keep relaying for the children until they have closed their
        connections (they may still use process sets without this rank), for at most 80 % of
        LCC_SHUTDOWN_TIMEOUT: a job's ranks shut down from the leaves up."""
        self.lingering = True
        deadline = time.monotonic() + 0.8 * self.shutdown_timeout
        children = set(self.neg.children)
        while not children <= self.plane.closed and not self.status.shut_down:
            left = deadline - time.monotonic()
            if left <= 0 or self.neg.parent in self.plane.closed:
                log.info("shut down with ranks %s still connected through this rank",
                         sorted(children - self.plane.closed))
                return
            self.receive(self.plane.poll(min(left, MAX_WAIT_S)))
            self.check_closed()
