"""The background thread: driving, waking and shutdown of objects that each own their state.

One :class:`Engine` per ``init()``, composed of:

- :class:`~.status.EngineStatus`: its lifecycle as others read it;
- :class:`~.submissions.Submissions`: the queue, in-flight table and ordered streams;
- :class:`~.control.negotiation.Negotiation`: the control plane, this rank's negotiator and
  (rank 0) the coordinator;
- :class:`~.execution.process_sets.ProcessSets`: the groups and their settings;
- :class:`~.execution.batches.BatchExecutor`: the backlog of agreed batches, run bucket by
  bucket through execution/run.py.

Requests flow one way: ``submit()`` -> Submissions -> (reported by) Negotiation -> agreed
batches delivered to the BatchExecutor -> handles completed. User threads call
:meth:`Engine.submit`, which checks what can be checked locally and queues the request.
Whichever thread holds the progress lock (the background thread, or a user thread waiting in
``synchronize()``, which then drives progress itself) runs :meth:`Engine._step`:

1. report what is new: a request the rank's response or signature cache holds becomes a bit in
   the control tree's bit vectors, anything else goes to rank 0 in full; a rank with children
   in the tree also merges their reports and sends one report to its parent;
2. on rank 0, feed what the tree agreed and what ranks sent to the
   :class:`~.control.controller.Coordinator` and send the batch it decides on down the tree;
3. pass each batch on to the children and execute it (the same order on every rank),
   completing the handles.

Nothing polls: with nothing to do, the stepping thread blocks in the kernel on the control
plane's sockets until a message arrives, a submission wakes it, or the coordinator's next
deadline (cycle time, stall scan) passes. So lightcc's waiting costs no CPU that training needs.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any

from .backends.mpi import MPICommunicator
from .config import Config
from .control.controller import Coordinator
from .control.negotiation import MAX_WAIT_S, Negotiation
from .control.messages import SHARED_STREAM, Coll, Request
from .control.tree import demote_after
from .control.negotiator import Negotiator
from .control.transport import ControlPlane
from .exceptions import InvalidArgumentError, LightCCError, ShutdownError
from .execution import fusion
from .execution.batches import BatchExecutor
from .execution.group import ExecSettings, Group
from .execution.process_sets import ProcessSets
from .handle import Handle
from .observability import flight, ranges
from .status import EngineStatus
from .submissions import Submissions
from .topology import build, overlap_in_background
from .tracing import Tracer

log = logging.getLogger("lightcc")

LAZY_FLUSH_S = 1.0          # lazy mode: the background thread sends what waited this long
GATHER_S = 0.005           # eager mode: during a burst, the background thread sends at most
                            # this often (one control message for many gradients, not one each)
DRIVER_LOCK_WAIT_S = 0.002  # a driver that finds another thread stepping re-checks this often


class Engine:
    """One process's lightcc runtime (see module docstring): the thread, driving, waking and
    shutdown here; the state in the objects it is composed of."""

    def __init__(self, config: Config, base: MPICommunicator, hostnames: list[str]) -> None:
        self.config = config
        world = base.dup("world")
        self.hostnames = hostnames
        self.topo = build(world, hostnames, config.local_size, config.cross_transport,
                          config.control_addr)
        self.rank, self.size = world.rank, world.size
        self._plane = ControlPlane(base.comm, hostnames, config.control_addr,
                                   config.control_fanout)
        self.status = EngineStatus()         # what others may read (written here only)
        self.submissions = Submissions(self.rank)   # queue, in-flight table, streams
        self.coordinator = (Coordinator(self.size, config.cache_capacity,
                                        config.cycle_time / 1000.0, config.fusion_threshold,
                                        config.stall_check_time, config.stall_shutdown_time)
                            if self.rank == 0 else None)
        self.neg = Negotiator(self.rank, self.size, config.cache_capacity,
                              config.control_fanout,
                              demote_after(config.stall_check_time, config.stall_shutdown_time),
                              self.coordinator)
        self.cache, self.sigcache = self.neg.cache, self.neg.sigcache
        self.negotiation = Negotiation(self._plane, self.neg, self.coordinator,
                                       self.submissions, self.status, config.shutdown_timeout,
                                       self._deliver, self._remote_shutdown)
        self.psets = ProcessSets(config, self.topo, hostnames, self.rank, base,
                                 self.negotiation.pump)
        self.groups: dict[int, Group] = self.psets.groups   # read here; written by psets
        self.listeners: list = []      # callables(event: str, **info), e.g. the autotuner
        neg = self.neg
        self.executor = BatchExecutor(
            self.submissions, self.psets, self.status, lambda p: neg.index(p) is not None,
            fusion.direct_bytes(self.topo.num_nodes), self.listeners, self.coordinator,
            pump=self.negotiation.pump,
            coordinate=self.negotiation.coordinate if self.coordinator is not None else None,
            should_yield=self._should_yield, on_shutdown=self._remote_shutdown)
        self._driving_for: Handle | None = None   # the handle the stepping thread waits for
        self._progress = threading.Lock()    # serializes _step(): every MPI call is under it
        self._cv = threading.Condition()     # guards _drivers
        self._drivers = 0                    # user threads currently driving progress
        self._bg_sleeping = False            # the background thread is (about to be) asleep
        self._drv_sleeping = False           # a driving thread is (about to be) blocked
        self.lazy = not overlap_in_background(config.overlap, self.topo)
        self.missed_wakeups = 0              # background sleeps that ignored queued work
        self.flight = flight.attach(self.rank, self.size, config.flight_records, config.flight_dir)
        self._thread = threading.Thread(target=self._run, name="lightcc-engine", daemon=True)
        self._thread.start()

    # ---- user-thread API ---------------------------------------------------------------------
    def auto_name(self, coll: Coll, pset: int = 0) -> str:
        """Horovod-style generated name; counters are per collective type and process set."""
        return self.submissions.auto_name(coll, pset)

    @property
    def batches(self) -> int:
        """Batches executed on this rank."""
        return self.executor.batches

    @property
    def settings(self) -> ExecSettings:
        return self.psets.settings

    @property
    def fusion_threshold(self) -> int:
        return self.psets.settings.fusion_threshold

    @property
    def algorithm(self) -> str:
        return self.psets.settings.algorithm

    @property
    def tracer(self) -> Tracer:
        return self.psets.tracer

    def set_tracer(self, tracer: Any) -> None:
        """Route trace events of the executor and every communicator to ``tracer``."""
        self.psets.set_tracer(tracer)

    def group(self, pset_id: int) -> Group:
        """The process set ``pset_id`` (InvalidArgumentError when it does not exist here)."""
        group = self.groups.get(pset_id)
        if group is None:
            raise InvalidArgumentError(f"process set {pset_id} does not exist (removed, or "
                                       f"never added on this rank)")
        return group

    pset = group      # the name the API layers use

    def submit(self, request: Request, array: Any = None, out: Any = None,
               wake: bool = True, stream: int | None = None,
               label: str | None = None) -> Handle:
        """Queue ``request``; raises at once for what is wrong locally.

        ``stream`` puts it on an ordered stream of its process set (matched by position, see
        controller.py); its name becomes ``label`` or a generated one. ``wake=False`` is for
        blocking calls whose thread drives progress right away.
        """
        handle = Handle(request, self)
        now = time.perf_counter()
        first, newly_urgent = self.submissions.add(handle, request, array, out, now, stream,
                                                   label, self.status.check)
        # lazy mode holds what a thread will wait for through synchronize(); the shared
        # ordered stream (torch.distributed) is awaited through torch futures lightcc cannot
        # see, so it is sent at once in every mode. Other eager work is gathered during a
        # burst (see _step), so the background thread is woken by the first entry of a queue
        # only.
        eager = not self.lazy or stream == SHARED_STREAM
        if wake and eager and (self._drv_sleeping or
                               (self._bg_sleeping and (first or newly_urgent))):
            self._plane.wake()
        if self.flight is not None:
            self.flight.record(handle, now)
        return handle

    def mark_joined(self) -> None:
        """``join()`` ran on this rank: its share of allreduces is zeros until the JOIN runs."""
        self.status.joined = True

    def has_queued(self) -> bool:
        """Submissions not yet reported to the control tree (an unlocked peek)."""
        return bool(self.submissions.queue)

    def shutdown(self, timeout: float) -> None:
        """Stop the thread; pending handles fail with ShutdownError. Never blocks past timeout."""
        with self.submissions.lock:        # a submit() after this raises, one before is failed
            self.status.stopping = True
        with self._cv:
            self._cv.notify_all()
        self._plane.wake()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("lightcc background thread did not stop within %.0f s "
                        "(blocked in a collective with a rank that is gone?)", timeout)
            return
        self.psets.free()

    # ---- progress ----------------------------------------------------------------------------
    def drive(self, handle: Handle, timeout: float | None) -> None:
        """Make progress on the calling thread until ``handle`` completes (see Handle.wait).

        The background thread stands aside while a user thread drives (no hand-off on the
        latency-critical path); waiting for other ranks blocks in the kernel, not in a spin.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            self._drivers += 1
        try:
            while not handle.is_done:
                if self.status.stopped():
                    return
                wait = MAX_WAIT_S
                if deadline is not None:
                    wait = min(wait, deadline - time.monotonic())
                    if wait <= 0:
                        return
                if not self._progress.acquire(timeout=DRIVER_LOCK_WAIT_S):
                    continue          # another thread is stepping; look at the handle again
                try:
                    if not handle.is_done:
                        self._driving_for = handle      # see _should_yield
                        self._step(wait, handle)
                finally:
                    self._driving_for = None
                    self._progress.release()
        finally:
            with self._cv:
                self._drivers -= 1
                if not self._drivers:
                    self._cv.notify_all()

    def nudge(self) -> None:
        """One non-blocking step on the calling thread, if nobody else is stepping (a thread
        that waits outside the engine, on the direct path, starts the work it queued)."""
        if self._progress.acquire(blocking=False):
            try:
                if not self.status.stopped():
                    self._step(0.0, None)
            finally:
                self._progress.release()

    def expedite(self) -> None:
        """Lazy mode: a thread polled a handle, so what is queued must start without anyone
        waiting for it. The background thread sends it at once (the queue is marked urgent).
        The polling thread does no step itself: a step executes whatever collectives are
        agreed, which waits for the other ranks, and poll() must not wait."""
        if self.submissions.mark_urgent() and self._bg_sleeping:
            self._plane.wake()

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while self._drivers and not self.status.stopping:
                        self._cv.wait()
                if self.status.stopping:
                    with self._progress:
                        self._step(0.0, None)
                        self._stop_thread()
                    return
                with self._progress:
                    sleep = 0.0 if self._drivers else \
                        self._step(MAX_WAIT_S, None, background=True)
                if sleep > 0.0:          # blocks outside the progress lock, so a thread that
                    until = time.monotonic() + sleep   # starts waiting can drive at once
                    try:
                        self._plane.wait(sleep)
                    finally:
                        self._bg_sleeping = False
                    # urgent work is never held; eager work only for a hold (<= GATHER_S)
                    subs = self.submissions
                    if time.monotonic() >= until and (subs.urgent or (
                            subs.queue and not self.lazy and sleep > GATHER_S)):
                        self.missed_wakeups += 1    # slept it out with work queued (a bug)
        except BaseException as exc:  # never die silently: fail everything that waits
            log.exception("lightcc background thread failed")
            with self.submissions.lock:
                self.status.dead = exc
            entries = self.submissions.drain() + self.executor.take_unexecuted()
            for e in entries:
                e.handle._set(error=LightCCError(f"background thread failed: {exc!r}"))

    def _step(self, wait: float, handle: Handle | None, background: bool = False) -> float:
        """One round: send what is new, take what arrived, execute what is agreed. With
        nothing to do, a driver (``handle`` given) blocks up to ``wait`` seconds in the kernel;
        the background thread instead returns how long it may sleep (0: call again at once)
        and sleeps outside the progress lock.

        In lazy mode (see :func:`overlap_in_background`) the background thread leaves new
        submissions to the thread that will wait for them, unless they have waited
        :data:`LAZY_FLUSH_S` already (nobody waits for them or polls them). In eager mode it
        sends new submissions at most every :data:`GATHER_S` while they keep coming (a
        submission after a quiet spell goes at once), so backward's 100-300 gradients cost a
        few control rounds, not one each; the shared ordered stream and a waiting thread are
        never held.
        """
        executor = self.executor
        if executor:                 # agreed buckets first, in order
            executor.run()
            if executor or (handle is not None and handle.is_done):
                return 0.0
        negotiation = self.negotiation
        hold = 0.0
        subs = self.submissions
        if background and subs.queue and not subs.urgent and not self._drivers:
            if self.lazy:
                hold = subs.queued_at + LAZY_FLUSH_S - time.perf_counter()
            else:        # a burst (backward's gradients): gather for GATHER_S after a send
                hold = negotiation.flushed_at + GATHER_S - time.perf_counter()
        progressed = negotiation.report() if hold <= 0.0 else False
        negotiation.scan(time.monotonic())     # what waited too long goes up rank by rank
        if self.coordinator is not None and negotiation.coordinate():
            progressed = True
            executor.run()
        if background:
            # read what arrived first, and only then declare sleep: a wake byte sent after
            # _bg_sleeping is set stays in the socket for the wait() that follows (reading
            # after declaring lost it, and the thread slept MAX_WAIT_S with work queued)
            progressed |= self._receive(self._plane.poll(0.0))
            if progressed:
                return 0.0
            timeout = self._sleep_time(wait, hold)
            self._bg_sleeping = True
            if (subs.queue and (hold <= 0.0 or subs.urgent)) or self.status.stopping \
                    or self._drivers:             # (urgent: set by expedite before it
                self._bg_sleeping = False         # could see _bg_sleeping)
                return 0.0
            return timeout
        timeout = 0.0 if progressed else self._sleep_time(wait, hold)
        if timeout > 0.0:
            self._drv_sleeping = True          # submit() wakes this poll from here on
            if subs.queue or self.status.stopping or (handle is not None and handle.is_done):
                timeout = 0.0
        # torch.profiler's lightcc::negotiate: the waiting thread blocks for the agreement
        tok = ranges.enter("lightcc::negotiate") if timeout > 0.0 else None
        try:
            frames = self._plane.poll(timeout)
        finally:
            self._drv_sleeping = False
            ranges.leave(tok)
        self._receive(frames)
        return 0.0

    def _receive(self, frames: list) -> bool:
        """Control frames in (batches delivered in order), then execute what they agreed,
        then act on closed connections; rank 0 then agrees what the frames completed."""
        negotiation, executor = self.negotiation, self.executor
        progressed = negotiation.receive(frames)
        if executor:
            executor.run()
        progressed |= negotiation.check_closed()
        if frames and self.coordinator is not None and negotiation.coordinate():
            executor.run()
        return progressed

    def _sleep_time(self, wait: float, hold: float) -> float:
        """How long a step with nothing to do may block: ``wait``, or less for the
        coordinator's next deadline (rank 0), the node's stall scan or the end of a lazy
        hold."""
        wait = min(wait, self.negotiation.next_deadline(time.monotonic()))
        return min(wait, hold) if hold > 0.0 else wait

    def _should_yield(self) -> bool:
        """Stop executing at this bucket boundary? The background thread stops as soon as a
        user thread drives (waits in ``synchronize()``), which then executes the next bucket
        itself instead of waiting for the rest of the batch. A driver goes on to the end of
        the backlog (handing the engine back and forth between threads costs more than the
        buckets it would leave: a thread that must not wait for the rest waits without
        driving, as cross-barrier mode's pre-forward hooks do)."""
        return self._driving_for is None and self._drivers > 0 and not self.status.stopping

    def _deliver(self, batch: Any, responses: list) -> None:
        """An agreed batch, from the negotiation into the executor's backlog (in agreement
        order; the step runs it)."""
        self.executor.accept(batch, responses)

    # ---- shutdown ----------------------------------------------------------------------------
    def _fail_all(self, make_error) -> None:
        entries = self.submissions.drain() + self.executor.take_unexecuted()
        for e in entries:
            e.handle._set(error=make_error(e))

    def _remote_shutdown(self, reason: str) -> None:
        """lightcc stopped on every rank (a batch said so, or the coordinator is unreachable)."""
        self.status.shut_down = f"lightcc was shut down on all ranks: {reason}"
        self._fail_all(lambda e: ShutdownError(f"{e.handle.request.describe()}: "
                                               f"{self.status.shut_down}"))

    def _stop_thread(self) -> None:
        self._fail_all(lambda e: ShutdownError(f"{e.handle.request.describe()} was pending when "
                                               f"shutdown() ran on rank {self.rank}"))
        self.negotiation.stop()
