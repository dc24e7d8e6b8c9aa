"""The background thread: queue, negotiation messages, execution, handles, lifecycle.

One :class:`Engine` per ``init()``. User threads call :meth:`Engine.submit`, which checks what
can be checked locally and queues the request. Whichever thread holds the progress lock (the
background thread, or a user thread waiting in ``synchronize()``, which then drives progress
itself) runs :meth:`Engine._step`:

1. report what is new (:class:`~.negotiator.Negotiator`): a request the rank's response or
   signature cache holds becomes a bit in the control tree's bit vectors (negotiation.py),
   anything else goes to rank 0 in full; a rank with children in the tree also merges their
   reports and sends one report to its parent (transport.py);
2. on rank 0, feed what the tree agreed and what ranks sent to the
   :class:`~.controller.Coordinator` and send the batch it decides on down the tree;
3. pass each batch on to the children, apply it to the caches and the node, execute it (the
   same order on every rank), then complete the handles.

Nothing polls: with nothing to do, the stepping thread blocks in the kernel on the control
plane's sockets until a message arrives, a submission wakes it, or the coordinator's next
deadline (cycle time, stall scan) passes. So lightcc's waiting costs no CPU that training needs.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from typing import Any

from .backends.mpi import MPICommunicator, thread_multiple
from .config import Config
from .controller import Coordinator
from .exceptions import DuplicateNameError, InvalidArgumentError, LightCCError, ShutdownError
from .execution import fusion
from .execution.direct import DirectPath
from .execution.group import ExecSettings, Group
from .execution.run import run as run_bucket
from .execution.shared import LocalEntry
from .messages import (COLL_NAMES, ORDERED, SHARED_STREAM, Batch, Coll, OrderedItem, Request,
                       Response)
from .negotiation import demote_after
from .negotiator import Negotiator
from .topology import Topology, build
from .tracing import NULL, Tracer
from .transport import ControlPlane

log = logging.getLogger("lightcc")

#: Settings of :class:`~.group.ExecSettings` that a batch may change (the autotuner's).
_EXEC_FIELDS = ("fusion_threshold", "algorithm", "auto_thresholds", "min_compress_bytes",
                "ring_chunk_bytes", "mpi_chunk_bytes", "ef_ttl_steps")
PLAN_CACHE = 64             # remembered bucket plans of repeated batches
MAX_WAIT_S = 1.0            # longest single block in the kernel (stops are also woken)
LAZY_FLUSH_S = 1.0          # lazy mode: the background thread sends what waited this long
GATHER_S = 0.005           # eager mode: during a burst, the background thread sends at most
                            # this often (one control message for many gradients, not one each)
DRIVER_LOCK_WAIT_S = 0.002  # a driver that finds another thread stepping re-checks this often


def overlap_in_background(setting: str, topo: Topology) -> bool:
    """Whether the background thread starts collectives as soon as they are submitted.

    ``LCC_OVERLAP=1``: yes. ``0`` (*lazy*): collectives start when a thread waits for them
    (``synchronize()``, ``DistributedOptimizer.step()``), so every rank runs them from a thread
    that has nothing else to do. ``auto``: lazy only when the whole job is on one host and that
    host has fewer than two usable cores per rank. There, overlapping buys nothing (the cores
    are busy computing) and costs a lot: a shared-memory collective progresses only while the
    threads of all ranks are on a core at the same time, which a fully loaded host grants in
    scheduler time slices, so a 1 MB allreduce took 7-18 ms instead of 0.3 ms (docs/torch.md).
    """
    if setting in ("1", "on", "true"):
        return True
    if setting in ("0", "off", "false"):
        return False
    try:
        import os

        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        import os

        cores = os.cpu_count() or 1
    return topo.num_nodes > 1 or cores >= 2 * topo.local_size


def _stream_name(coll: Coll, stream: int, seq: int, label: str | None) -> str:
    """The name of an ordered request: its label, else Horovod's generated name for per-type
    streams (``allreduce.noname.7``) or ``ordered.7`` on the shared stream."""
    if label is not None:
        return label
    if stream == SHARED_STREAM:
        return f"ordered.{seq}"
    return f"{COLL_NAMES[Coll(stream)]}.noname.{seq}"


def _ranks_text(ranks: list[int]) -> str:
    ranks = sorted(set(ranks))
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


class Handle:
    """The future of one submitted collective; see ``lightcc.poll`` / ``synchronize``.

    A handle is made for every collective, so it owns no lock: completion sets a flag, and a
    thread that waits without driving the engine gets an event made on demand.
    """

    __slots__ = ("_done", "_waiter", "_result", "_error", "request", "_callbacks", "_engine",
                 "device_done")

    def __init__(self, request: Request | None, engine: "Engine | None" = None) -> None:
        self._done = False
        self._waiter: threading.Event | None = None
        self._result: Any = None
        self._error: BaseException | None = None
        self.request = request
        self._callbacks: list = []
        self._engine = engine
        self.device_done: Any = None     # GPU results: device.Completion, set by device_exec

    def done(self) -> bool:
        """True once complete; never blocks (in lazy mode it also has the background thread
        start queued work, see Engine.expedite)."""
        if not self._done and self._engine is not None and self._engine.lazy:
            self._engine.expedite()
        return self._done

    def wait(self, timeout: float | None = None) -> Any:
        """Block until complete; return the result or raise the collective's error.

        GPU results are complete once the calling thread's current CuPy stream reaches them:
        this makes that stream wait on the engine's done event (no host sync).

        The waiting thread drives the engine itself while nobody else does (no thread
        hand-off on the latency-critical path); otherwise it sleeps on an event.
        """
        if not self._done and self._engine is not None:
            self._engine.drive(self, timeout)
        if not self._done:
            waiter = self._waiter
            if waiter is None:
                waiter = self._waiter = threading.Event()
            if not self._done:     # _set() runs flag-then-event: checked after publishing
                waiter.wait(timeout)
        if not self._done:
            raise TimeoutError(f"{self.request.describe() if self.request else 'handle'} "
                               f"did not complete within {timeout} s")
        if self._error is not None:
            raise self._error
        if self.device_done is not None:   # the caller's stream waits for the GPU work
            self.device_done.consume()
        return self._result

    def add_done_callback(self, fn: Any) -> None:
        """Call ``fn(handle)`` once the handle completes, on the completing thread (at once,
        on this thread, if it already has). ``fn`` must not block or wait for collectives."""
        self._callbacks.append(fn)
        if self._done and fn in self._callbacks:
            self._callbacks.remove(fn)
            fn(self)

    def _set(self, result: Any = None, error: BaseException | None = None) -> None:
        self._result, self._error = result, error
        self._done = True
        waiter = self._waiter
        if waiter is not None:
            waiter.set()
        for cb in self._callbacks:
            try:
                cb(self)
            except Exception:  # a user callback must not kill the engine
                log.exception("handle callback failed")

    def __repr__(self) -> str:
        state = "done" if self._done else "pending"
        return f"<Handle {self.request.describe() if self.request else ''} {state}>"


class Engine:
    """One process's lightcc runtime (see module docstring)."""

    def __init__(self, config: Config, base: MPICommunicator, hostnames: list[str]) -> None:
        self.config = config
        world = base.dup("world")
        self.hostnames = hostnames
        self.topo = build(world, hostnames, config.local_size)
        self.rank, self.size = world.rank, world.size
        self._plane = ControlPlane(base.comm, hostnames, config.control_addr,
                                   config.control_fanout)
        self.settings = ExecSettings.from_config(config)
        self.groups: dict[int, Group] = {0: Group(0, tuple(range(self.size)), self.topo,
                                                  self.settings, progress=self._pump,
                                                  direct=self._direct_path(
                                                      base, tuple(range(self.size))))}
        self.tracer: Tracer = NULL
        self.batches = 0                     # batches executed
        self.coordinator = (Coordinator(self.size, config.cache_capacity,
                                        config.cycle_time / 1000.0, config.fusion_threshold,
                                        config.stall_check_time, config.stall_shutdown_time)
                            if self.rank == 0 else None)
        self.neg = Negotiator(self.rank, self.size, config.cache_capacity,
                              config.control_fanout,
                              demote_after(config.stall_check_time, config.stall_shutdown_time),
                              self.coordinator)
        self.cache, self.sigcache = self.neg.cache, self.neg.sigcache
        self._inbox: deque = deque()         # batches from the parent, not yet handled
        self._lingering = False              # shut down here, still relaying for children
        self._lock = threading.Lock()        # queue, in-flight table, sequence numbers
        self._progress = threading.Lock()    # serializes _step(): every MPI call is under it
        self._cv = threading.Condition()     # guards _drivers
        self._drivers = 0                    # user threads currently driving progress
        self._bg_sleeping = False            # the background thread is (about to be) asleep
        self._drv_sleeping = False           # a driving thread is (about to be) blocked
        self._queue: list[LocalEntry] = []
        self._inflight: dict[tuple, LocalEntry] = {}
        self._streams: dict[tuple[int, int], deque] = {}   # (pset, stream) -> entries
        self._seq: dict[tuple[int, int], int] = {}          # (pset, stream) -> next seq
        self._joined = False
        self._stopping = False
        self._dead: BaseException | None = None
        self._coordinator_gone = ""
        self.gone_ranks: frozenset[int] = frozenset()   # ranks that shut down or exited
        self._closed_seen: set[int] = set()
        self._counters: dict[tuple[int, int], itertools.count] = {}
        self.lazy = not overlap_in_background(config.overlap, self.topo)
        self._queued_at = 0.0                # when the oldest queued entry was queued
        self._urgent = False                 # the queue holds work nobody may hold back
        self._flushed_at = 0.0               # when the queue was last sent (burst gathering)
        self._plans: dict[tuple, list[list[int]]] = {}   # see _plan()
        self._direct = fusion.direct_bytes(self.topo.num_nodes)   # the same on every rank
        self.missed_wakeups = 0              # background sleeps that ignored queued work
        self.listeners: list = []      # callables(event: str, **info), e.g. the autotuner
        self._thread = threading.Thread(target=self._run, name="lightcc-engine", daemon=True)
        self._thread.start()

    # ---- user-thread API ---------------------------------------------------------------------
    def auto_name(self, coll: Coll, pset: int = 0) -> str:
        """Horovod-style generated name; counters are per collective type and process set."""
        with self._lock:
            counter = self._counters.setdefault((int(coll), pset), itertools.count())
            return f"{coll.name.lower()}.noname.{next(counter)}"

    @property
    def fusion_threshold(self) -> int:
        return self.settings.fusion_threshold

    @property
    def algorithm(self) -> str:
        return self.settings.algorithm

    def set_tracer(self, tracer: Any) -> None:
        """Route trace events of the executor and every communicator to ``tracer``."""
        self.tracer = tracer
        for group in self.groups.values():
            group.set_tracer(tracer)

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
        with self._lock:
            self._check_alive()
            if stream is None:
                key = request.key
                if key in self._inflight:
                    raise DuplicateNameError(f"{request.describe()} is already in flight on "
                                             f"rank {self.rank}; wait for it or use another "
                                             f"name")
            else:
                sk = (request.pset, stream)
                seq = self._seq.get(sk, 0)
                self._seq[sk] = seq + 1
                request = request._replace(name=_stream_name(request.coll, stream, seq, label))
                handle.request = request
                key = (ORDERED, request.pset, stream, seq)
            entry = LocalEntry(key, array, out, handle, now, request, stream)
            if stream is not None:
                self._streams.setdefault(sk, deque()).append(entry)
            self._inflight[key] = entry
            first = not self._queue
            if first:
                self._queued_at = now
            self._queue.append(entry)
            # lazy mode holds what a thread will wait for through synchronize(); the shared
            # ordered stream (torch.distributed) is awaited through torch futures lightcc
            # cannot see, so it is sent at once in every mode. Other eager work is gathered
            # during a burst (see _step), so the background thread is woken by the first
            # entry of a queue only.
            eager = not self.lazy or stream == SHARED_STREAM
            newly_urgent = stream == SHARED_STREAM and not self._urgent
            if newly_urgent:
                self._urgent = True
        if wake and eager and (self._drv_sleeping or
                               (self._bg_sleeping and (first or newly_urgent))):
            self._plane.wake()
        return handle

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise LightCCError(f"lightcc's background thread stopped: {self._dead}") \
                from self._dead
        if self._coordinator_gone:
            raise ShutdownError(self._coordinator_gone)
        if self._stopping:
            raise ShutdownError("lightcc is shutting down on this rank")

    def shutdown(self, timeout: float) -> None:
        """Stop the thread; pending handles fail with ShutdownError. Never blocks past timeout."""
        with self._lock:
            self._stopping = True
        with self._cv:
            self._cv.notify_all()
        self._plane.wake()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("lightcc background thread did not stop within %.0f s "
                        "(blocked in a collective with a rank that is gone?)", timeout)
            return
        for group in list(self.groups.values()):
            if group.topo is not None:
                group.free()

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
            while not handle._done:
                if self._dead is not None or self._stopping:
                    return
                wait = MAX_WAIT_S
                if deadline is not None:
                    wait = min(wait, deadline - time.monotonic())
                    if wait <= 0:
                        return
                if not self._progress.acquire(timeout=DRIVER_LOCK_WAIT_S):
                    continue          # another thread is stepping; look at the handle again
                try:
                    if not handle._done:
                        self._step(wait, handle)
                finally:
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
                if self._dead is None and not self._stopping:
                    self._step(0.0, None)
            finally:
                self._progress.release()

    def expedite(self) -> None:
        """Lazy mode: a thread polled a handle, so what is queued must start without anyone
        waiting for it. The background thread sends it at once (the queue is marked urgent).
        The polling thread does no step itself: a step executes whatever collectives are
        agreed, which waits for the other ranks, and poll() must not wait."""
        if not self._queue or self._urgent:      # unlocked peek, rechecked under the lock
            return
        with self._lock:
            if not self._queue:
                return
            self._urgent = True
        if self._bg_sleeping:
            self._plane.wake()

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while self._drivers and not self._stopping:
                        self._cv.wait()
                if self._stopping:
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
                    if time.monotonic() >= until and (self._urgent or (
                            self._queue and not self.lazy and sleep > GATHER_S)):
                        self.missed_wakeups += 1    # slept it out with work queued (a bug)
        except BaseException as exc:  # never die silently: fail everything that waits
            log.exception("lightcc background thread failed")
            with self._lock:
                self._dead = exc
                entries = list(self._inflight.values())
                self._inflight.clear()
                self._queue.clear()
                self._streams.clear()
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
        hold = 0.0
        if background and self._queue and not self._urgent and not self._drivers:
            if self.lazy:
                hold = self._queued_at + LAZY_FLUSH_S - time.perf_counter()
            else:        # a burst (backward's gradients): gather for GATHER_S after a send
                hold = self._flushed_at + GATHER_S - time.perf_counter()
        progressed = self._flush_queue() if hold <= 0.0 else False
        if self.neg.scan(time.monotonic()):
            self._send_up()                    # what waited too long goes up rank by rank
        if self.coordinator is not None:
            progressed |= self._coordinate()
        if background:
            # read what arrived first, and only then declare sleep: a wake byte sent after
            # _bg_sleeping is set stays in the socket for the wait() that follows (reading
            # after declaring lost it, and the thread slept MAX_WAIT_S with work queued)
            progressed |= self._receive(self._plane.poll(0.0))
            if progressed:
                return 0.0
            timeout = self._sleep_time(wait, hold)
            self._bg_sleeping = True
            if (self._queue and (hold <= 0.0 or self._urgent)) or self._stopping \
                    or self._drivers:             # (_urgent: set by expedite before it
                self._bg_sleeping = False         # could see _bg_sleeping)
                return 0.0
            return timeout
        timeout = 0.0 if progressed else self._sleep_time(wait, hold)
        if timeout > 0.0:
            self._drv_sleeping = True          # submit() wakes this poll from here on
            if self._queue or self._stopping or (handle is not None and handle._done):
                timeout = 0.0
        try:
            frames = self._plane.poll(timeout)
        finally:
            self._drv_sleeping = False
        self._receive(frames)
        return 0.0

    def _sleep_time(self, wait: float, hold: float) -> float:
        """How long a step with nothing to do may block: ``wait``, or less for the
        coordinator's next deadline (rank 0), the node's stall scan or the end of a lazy
        hold."""
        wait = min(wait, self.neg.next_deadline(time.monotonic()))
        if self.coordinator is not None:
            wait = min(wait, self.coordinator.next_deadline())
        return min(wait, hold) if hold > 0.0 else wait

    def _receive(self, frames: list[tuple[int, bytes]]) -> bool:
        """Act on control frames (children's reports; batches from the parent, handled in
        order) and on closed peers."""
        progressed = bool(frames)
        self._take_frames(frames)
        while self._inbox and not self._coordinator_gone:   # _pump may add to it meanwhile
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
        if data is not None and not self._coordinator_gone:
            self._plane.send(self.neg.parent, data)

    def _handle_batch(self, data: bytes) -> None:
        """A batch from the parent: passed on to the children before this rank applies it
        (before any later report of theirs can depend on it), then executed."""
        for child in self.neg.children:
            self._plane.send(child, data)
        self._execute(Batch.decode(data))

    def _flush_queue(self) -> bool:
        """Report new submissions (cache ids into the tree's bit vectors where possible)."""
        if not self._queue:      # unlocked peek; a request queued right after is seen next step
            return False
        with self._lock:
            new, self._queue = self._queue, []
            self._urgent = False
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
        if self._queue:
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
        if parent in new and not self._coordinator_gone:
            reason = ("rank 0 (the coordinator) closed its connection (it exited or called "
                      "shutdown())" if parent == 0 else
                      f"rank {parent}, this rank's relay to rank 0 in the control tree, closed "
                      f"its connection (it exited)")
            for child in self.neg.children:   # they cannot reach rank 0 either
                self._plane.send(child, Batch(shutdown=reason).encode())
            self._remote_shutdown(reason)

    # ---- execution ---------------------------------------------------------------------------
    def _execute(self, batch: Batch) -> None:
        if batch.settings:
            self._apply_settings(batch.settings)
        if batch.gone:
            self.gone_ranks = frozenset(batch.gone)
        responses = self.neg.absorb(batch)
        self._send_up()           # what the batch demoted goes up rank by rank
        entries: list = []
        with self._lock:          # one acquisition for the whole batch
            for item, resp in zip(batch.items, responses):
                if isinstance(item, OrderedItem):
                    entries.append(self._take_ordered(item.pset, item.stream))
                else:
                    entries.append(self._inflight.pop(resp.request.key, None))
        if self._lingering:       # shut down here: only relaying for the children
            if batch.shutdown:
                self._remote_shutdown(batch.shutdown)
            return
        if self.tracer.enabled:
            self.tracer.instant("engine", "CYCLE", time.perf_counter(), step=self.batches,
                                responses=len(responses))
        touched: set[int] = set()
        for bucket in self._plan(batch, responses):
            touched.add(responses[bucket[0]].request.pset)
            self._execute_bucket([responses[i] for i in bucket], [entries[i] for i in bucket])
        for pset in touched:
            group = self.groups.get(pset)
            if group is not None:
                group.step += 1
        self.batches += 1
        if batch.shutdown:
            self._remote_shutdown(batch.shutdown)

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

    def _take_ordered(self, pset: int, stream: int) -> LocalEntry | None:
        """This rank's next request on an ordered stream (None when it did not submit one:
        it has joined, or is not a member; a joined member skips the position). Called with
        ``_lock`` held."""
        queue = self._streams.get((pset, stream))
        if queue:
            entry = queue.popleft()
            self._inflight.pop(entry.response_key, None)
            return entry
        if self.neg.index(pset) is not None:
            self._seq[(pset, stream)] = self._seq.get((pset, stream), 0) + 1
        return None

    def _execute_bucket(self, resps: list[Response], entries: list) -> None:
        """Process-set changes here (they change the engine's groups), then the bucket through
        execution's door, which completes its handles."""
        req = resps[0].request
        if not resps[0].error:
            if req.coll == Coll.ADD_PSET:
                self._add_pset(resps[0])
            elif req.coll == Coll.REMOVE_PSET:
                self._remove_pset(req.root)
        ok = run_bucket(self.groups.get(req.pset), resps, entries, self._joined, self.tracer,
                        self._notify)
        if ok and req.coll == Coll.JOIN:
            self._joined = False

    def _notify(self, event: str, **info: Any) -> None:
        for listener in self.listeners:
            listener(event, **info)

    def _apply_settings(self, settings: dict) -> None:
        """Tuned settings from the coordinator, applied by every rank at the same batch."""
        exec_changes = {k: v for k, v in settings.items() if k in _EXEC_FIELDS}
        if exec_changes:
            if "fusion_threshold" in exec_changes:
                exec_changes["fusion_threshold"] = int(exec_changes["fusion_threshold"])
            if "algorithm" in exec_changes:
                exec_changes["algorithm"] = str(exec_changes["algorithm"])
            self.settings = self.settings.changed(**exec_changes)
            for group in self.groups.values():
                group.apply(self.settings)
        if self.coordinator is not None:
            if "cycle_time" in settings:
                self.coordinator.cycle_time = float(settings["cycle_time"]) / 1000.0
            if "fusion_threshold" in settings:
                self.coordinator.fusion_threshold = self.settings.fusion_threshold

    def _direct_path(self, comm: MPICommunicator, ranks: tuple[int, ...]) -> Any:
        """A process set's direct path (collective over ``comm``: it duplicates it), or None
        when LCC_DIRECT_BYTES is 0 or MPI lacks MPI_THREAD_MULTIPLE (the calling thread would
        use MPI beside the engine's)."""
        if self.config.direct_bytes <= 0 or not thread_multiple():
            return None
        return DirectPath(comm.dup("direct"), ranks, self.config.stall_check_time,
                          self.config.stall_shutdown_time)

    def _add_pset(self, resp: Response) -> None:
        ranks = tuple(resp.request.splits)
        member = self.rank in ranks
        sub = self.topo.world.split(0 if member else 1, self.rank, f"pset{resp.value}")
        if member:
            hosts = [self.hostnames[r] for r in ranks]
            topo = build(sub, hosts, self.config.local_size)
            group = Group(resp.value, ranks, topo, self.settings, progress=self._pump,
                          direct=self._direct_path(sub, ranks))
            group.set_tracer(self.tracer)
        else:
            sub.free()
            group = Group(resp.value, ranks, None, self.settings)
        self.groups[resp.value] = group

    def _remove_pset(self, pset_id: int) -> None:
        group = self.groups.pop(pset_id, None)
        if group is not None and group.topo is not None:
            group.free()

    # ---- shutdown ----------------------------------------------------------------------------
    def _fail_all(self, make_error) -> None:
        with self._lock:
            entries = list(self._inflight.values())
            self._inflight.clear()
            self._queue.clear()
            self._streams.clear()
        for e in entries:
            e.handle._set(error=make_error(e))

    def _remote_shutdown(self, reason: str) -> None:
        self._coordinator_gone = f"lightcc was shut down on all ranks: {reason}"
        self._fail_all(lambda e: ShutdownError(f"{e.handle.request.describe()}: "
                                               f"{self._coordinator_gone}"))

    def _stop_thread(self) -> None:
        self._fail_all(lambda e: ShutdownError(f"{e.handle.request.describe()} was pending when "
                                               f"shutdown() ran on rank {self.rank}"))
        if self.coordinator is not None:
            data = Batch(shutdown="rank 0 (the coordinator) called shutdown()").encode()
            for child in self.neg.children:
                self._plane.send(child, data)
        elif not self._coordinator_gone:
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
        while not children <= self._plane.closed and not self._coordinator_gone:
            left = deadline - time.monotonic()
            if left <= 0 or self.neg.parent in self._plane.closed:
                log.info("shut down with ranks %s still connected through this rank",
                         sorted(children - self._plane.closed))
                return
            self._receive(self._plane.poll(min(left, MAX_WAIT_S)))


