"""The engine's side of the control plane: reporting submissions up the control tree, relaying
children's reports and the parent's batches, rank 0's coordinator, lost connections, and the
control-plane part of shutdown.

:class:`ControlLink` is a mixin of :class:`~..engine.Engine`: its methods run under the engine's
progress lock and use the engine's queue, negotiator (``neg``), coordinator and
:class:`~.transport.ControlPlane` (``_plane``); batches it receives go to
``Engine._execute`` (execution/batches.py).
"""
from __future__ import annotations

import logging
import time

from ..exceptions import ShutdownError
from .messages import Batch

log = logging.getLogger("lightcc")
MAX_WAIT_S = 1.0            # longest single block in the kernel (stops are also woken)


def _ranks_text(ranks: list[int]) -> str:
    ranks = sorted(set(ranks))
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


class ControlLink:
    """Negotiation as the engine drives it (see module docstring)."""

    def _receive(self, frames: list[tuple[int, bytes]]) -> bool:
        """Act on control frames (children's reports; batches from the parent, handled in
        order) and on closed peers."""
        progressed = bool(frames)
        self._take_frames(frames)
        while self._inbox and not self.status.shut_down:   # _pump may add to it meanwhile
            self._handle_batch(self._inbox.popleft())
        if len(self._plane.closed) != len(self._closed_seen):
            self._peers_closed()
            progressed = True
        if frames and self.coordinator is not None:
            self._coordinate()
        return progressed

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
            self._send_up()

    def _send_up(self) -> None:
        """This rank's report to its parent (rank 0: into the coordinator), if any."""
        data = self.neg.outgoing()
        if data is not None and not self.status.shut_down:
            self._plane.send(self.neg.parent, data)

    def _handle_batch(self, data: bytes) -> None:
        """A batch from the parent: passed on to the children before this rank applies it
        (before any later report of theirs can depend on it), then executed."""
        for child in self.neg.children:
            self._plane.send(child, data)
        self._execute(Batch.decode(data))

    def _flush_queue(self) -> bool:
        """Report new submissions (cache ids into the tree's bit vectors where possible)."""
        if not self.submissions.queue:   # unlocked peek; one queued right after: next step
            return False
        new = self.submissions.take_new()
        now = time.perf_counter()
        self._flushed_at = now
        neg = self.neg
        for entry in new:
            entry.sent_at = now
            req = entry.request
            if entry.stream is None:
                neg.submit_named(req)
            else:
                neg.submit_ordered(req.pset, entry.stream, entry.response_key[3], req)
        self._send_up()
        return True

    def _pump(self) -> None:
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
            self._flush_queue()
        if self.neg.children:
            self._take_frames(self._plane.poll(0.0))

    def _coordinate(self) -> bool:
        """Rank 0: ask the coordinator for a batch; send it down the tree and execute it."""
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
                self._plane.send(child, data)
        self._execute(batch)
        return True

    def _peers_closed(self) -> None:
        """Connections that ended: a child (its subtree is cut off) or the parent (this rank
        can no longer reach the coordinator)."""
        new = self._plane.closed - self._closed_seen
        self._closed_seen |= new
        parent = self.neg.parent
        lost = sorted(new - {parent})
        for child in lost:
            self.neg.child_lost(child)
        if lost:
            self._send_up()
        if parent in new and not self.status.shut_down:
            reason = ("rank 0 (the coordinator) closed its connection (it exited or called "
                      "shutdown())" if parent == 0 else
                      f"rank {parent}, this rank's relay to rank 0 in the control tree, closed "
                      f"its connection (it exited)")
            for child in self.neg.children:   # they cannot reach rank 0 either
                self._plane.send(child, Batch(shutdown=reason).encode())
            self._remote_shutdown(reason)

    # ---- execution ---------------------------------------------------------------------------

    def _remote_shutdown(self, reason: str) -> None:
        self.status.shut_down = f"lightcc was shut down on all ranks: {reason}"
        self._fail_all(lambda e: ShutdownError(f"{e.handle.request.describe()}: "
                                               f"{self.status.shut_down}"))

    def _stop_thread(self) -> None:
        self._fail_all(lambda e: ShutdownError(f"{e.handle.request.describe()} was pending when "
                                               f"shutdown() ran on rank {self.rank}"))
        if self.coordinator is not None:
            data = Batch(shutdown="rank 0 (the coordinator) called shutdown()").encode()
            for child in self.neg.children:
                self._plane.send(child, data)
        elif not self.status.shut_down:
            self.neg.submit_shutdown()
            self._send_up()
            if self.neg.children:
                self._linger()
        self._plane.close()

    def _linger(self) -> None:
        """Shut down here, but keep relaying for the children until they have closed their
        connections (they may still use process sets without this rank), for at most 80 % of
        LCC_SHUTDOWN_TIMEOUT: a job's ranks shut down from the leaves up."""
        self._lingering = True
        deadline = time.monotonic() + 0.8 * self.config.shutdown_timeout
        children = set(self.neg.children)
        while not children <= self._plane.closed and not self.status.shut_down:
            left = deadline - time.monotonic()
            if left <= 0 or self.neg.parent in self._plane.closed:
                log.info("shut down with ranks %s still connected through this rank",
                         sorted(children - self._plane.closed))
                return
            self._receive(self._plane.poll(min(left, MAX_WAIT_S)))
