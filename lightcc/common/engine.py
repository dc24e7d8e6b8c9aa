"""The background thread: queue, negotiation messages, execution, handles, lifecycle.

One :class:`Engine` per ``init()``. User threads call :meth:`Engine.submit`, which checks what
can be checked locally and queues the request; the engine thread is the only thread that
talks MPI. Its loop:

1. drain the queue and tell the coordinator (rank 0) what is new, as response-cache ids
   when the same request was agreed before (a few bytes), else as full requests;
2. on rank 0, feed every rank's messages to the :class:`~.controller.Coordinator` and send
   the batch it decides on to every rank;
3. execute each batch in order (the same order on every rank), then complete the handles.

The thread sleeps on an event that ``submit`` sets, so a lone request starts at once; while
waiting for other ranks it polls with a short back-off (at most 1 ms between polls).
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from . import executor, fusion
from .backends.mpi import MPICommunicator
from .cache import ResponseCache
from .config import Config
from .controller import Coordinator
from .exceptions import (CollectiveError, DuplicateNameError, InvalidArgumentError,
                         LightCCError, MismatchError, ShutdownError, StallError)
from .messages import Batch, Coll, RankMessage, Request, Response
from .topology import Topology, build

log = logging.getLogger("lightcc")

TAG_REQUEST = 7101
TAG_BATCH = 7102
IDLE_POLL_S = 0.02      # how often an idle engine looks for control messages
MAX_BACKOFF_S = 0.001   # longest sleep between polls while waiting for other ranks
DRIVER_SPIN_S = 0.002   # a thread blocked in synchronize() busy-polls this long first

_ERROR_TYPES = {"mismatch": MismatchError, "stall": StallError, "shutdown": ShutdownError,
                "join": MismatchError}


class _Signal:
    """A one-shot event, cheaper to create than ``threading.Event`` (one lock, no Condition);
    a handle is created for every collective."""

    __slots__ = ("_lock", "_set")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self._set = False

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        if not self._set:
            self._set = True
            self._lock.release()

    def wait(self, timeout: float | None = None) -> bool:
        if self._set:
            return True
        if self._lock.acquire(True, -1 if timeout is None else max(timeout, 0.0)):
            self._lock.release()   # let every other waiter through too
        return self._set


class Handle:
    """The future of one submitted collective; see ``lightcc.poll`` / ``synchronize``."""

    __slots__ = ("_event", "_result", "_error", "request", "_callbacks", "_engine")

    def __init__(self, request: Request | None, engine: "Engine | None" = None) -> None:
        self._event = _Signal()
        self._result: Any = None
        self._error: BaseException | None = None
        self.request = request
        self._callbacks: list = []
        self._engine = engine

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> Any:
        """Block until complete; return the result or raise the collective's error.

        The waiting thread drives the engine itself while nobody else does (no thread
        hand-off on the latency-critical path); otherwise it sleeps on the handle's event.
        """
        if not self._event.is_set() and self._engine is not None:
            self._engine.drive(self, timeout)
        if not self._event.wait(timeout):
            raise TimeoutError(f"{self.request.describe() if self.request else 'handle'} "
                               f"did not complete within {timeout} s")
        if self._error is not None:
            raise self._error
        return self._result

    def _set(self, result: Any = None, error: BaseException | None = None) -> None:
        self._result, self._error = result, error
        self._event.set()
        for cb in self._callbacks:
            try:
                cb(self)
            except Exception:  # a user callback must not kill the engine
                log.exception("handle callback failed")

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<Handle {self.request.describe() if self.request else ''} {state}>"


@dataclass
class ProcessSetInfo:
    """Members of a process set and, for members, its communicators."""

    ranks: tuple[int, ...]
    topo: Topology | None

    def index(self, world_rank: int) -> int | None:
        return self.ranks.index(world_rank) if world_rank in self.ranks else None


class Engine:
    """One process's lightcc runtime (see module docstring)."""

    def __init__(self, config: Config, mpi_comm: Any, hostnames: list[str]) -> None:
        self.config = config
        from mpi4py import MPI

        self._MPI = MPI
        self._status = MPI.Status()
        self._ctrl = mpi_comm.Dup()
        world = MPICommunicator(mpi_comm.Dup(), "world")
        self.hostnames = hostnames
        self.topo = build(world, hostnames, config.local_size)
        self.rank, self.size = world.rank, world.size
        self.psets: dict[int, ProcessSetInfo] = {0: ProcessSetInfo(tuple(range(self.size)),
                                                                   self.topo)}
        self.cache = ResponseCache(config.cache_capacity)
        self.coordinator = (Coordinator(self.size, config.cache_capacity,
                                        config.cycle_time / 1000.0, config.fusion_threshold,
                                        config.stall_check_time, config.stall_shutdown_time)
                            if self.rank == 0 else None)
        self.ctx = executor.ExecContext(topo=self.topo, fusion=fusion.FusionBuffer(),
                                        algorithm=config.algorithm,
                                        min_compress_bytes=config.min_compress_bytes)
        self.fusion_threshold = config.fusion_threshold
        self._lock = threading.Lock()
        self._progress = threading.Lock()   # serializes _step(): every MPI call is under it
        self._driver_waiting = 0            # user threads currently driving progress
        self._wake = threading.Event()
        self._queue: list[tuple[executor.LocalEntry, Request]] = []
        self._inflight: dict[tuple, executor.LocalEntry] = {}
        self._joined = False
        self._sends: list[tuple[Any, bytes]] = []
        self._stopping = False
        self._dead: BaseException | None = None
        self._coordinator_gone = ""
        self._counters: dict[tuple[int, int], itertools.count] = {}
        self.listeners: list = []      # callables(event: str, **info), e.g. the autotuner
        self._thread = threading.Thread(target=self._run, name="lightcc-engine", daemon=True)
        self._thread.start()

    # ---- user-thread API ---------------------------------------------------------------------
    def auto_name(self, coll: Coll, pset: int = 0) -> str:
        """Horovod-style generated name; counters are per collective type and process set."""
        with self._lock:
            counter = self._counters.setdefault((int(coll), pset), itertools.count())
            return f"{coll.name.lower()}.noname.{next(counter)}"

    def ordered_name(self, pset: int, label: str | None = None) -> str:
        """Name of the next collective on the process set's ordered stream (shared by every
        collective type; see ``ordered=`` in the API)."""
        with self._lock:
            counter = self._counters.setdefault((-1, pset), itertools.count())
            n = next(counter)
        return f"ordered.{n}" if label is None else f"ordered.{n}.{label}"

    def set_tracer(self, tracer: Any) -> None:
        """Route trace events of the executor and every communicator to ``tracer``."""
        self.ctx.tracer = tracer
        for info in self.psets.values():
            if info.topo is not None:
                for comm in (info.topo.world, info.topo.local, info.topo.cross):
                    comm.tracer = tracer

    def pset(self, pset_id: int) -> ProcessSetInfo:
        info = self.psets.get(pset_id)
        if info is None:
            raise InvalidArgumentError(f"process set {pset_id} does not exist (removed, or "
                                       f"never added on this rank)")
        return info

    def submit(self, request: Request, array: Any = None, out: Any = None,
               wake: bool = True) -> Handle:
        """Queue ``request``; raises at once for what is wrong locally.

        ``wake=False`` is for blocking calls whose thread drives progress right away.
        """
        handle = Handle(request, self)
        entry = executor.LocalEntry(request.key, array, out, handle, time.perf_counter())
        with self._lock:
            self._check_alive()
            if request.key in self._inflight:
                raise DuplicateNameError(f"{request.describe()} is already in flight on rank "
                                         f"{self.rank}; wait for it or use another name")
            self._inflight[request.key] = entry
            self._queue.append((entry, request))
        if wake:
            self._wake.set()
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
        self._wake.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("lightcc background thread did not stop within %.0f s "
                        "(blocked in a collective with a rank that is gone?)", timeout)
            return
        for info in list(self.psets.values()):
            if info.topo is not None and info.topo is not self.topo:
                info.topo.free()
            if info.topo is not None:
                executor.release_agreement(info.topo.world)
        self.topo.free()
        self.topo.world.free()
        # the control communicator is not freed: a shutdown message to a coordinator that has
        # already left may still be pending on it, and a freed context id can be reused by the
        # next init()'s communicator, which would then receive that stale message
        self.ctx.fusion.release()

    # ---- engine thread -----------------------------------------------------------------------
    def drive(self, handle: Handle, timeout: float | None) -> None:
        """Make progress on the calling thread until ``handle`` completes (see Handle.wait)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        spins = 0
        spin_until = time.perf_counter() + DRIVER_SPIN_S
        self._driver_waiting += 1
        try:
            while not handle._event.is_set():
                if self._dead is not None or self._stopping:
                    return
                if deadline is not None and time.monotonic() > deadline:
                    return
                if self._progress.acquire(blocking=False):
                    try:
                        progressed = self._step()
                    finally:
                        self._progress.release()
                    if progressed:
                        spins = 0
                        spin_until = time.perf_counter() + DRIVER_SPIN_S
                        continue
                    if time.perf_counter() < spin_until:
                        continue   # busy-poll: a yield here costs more than the wait itself
                    spins += 1
                    handle._event.wait(min(MAX_BACKOFF_S, 2e-5 * 2 ** min(spins, 10)))
                else:   # the engine thread is mid-step; it stands aside once it sees us
                    handle._event.wait(2e-5)
        finally:
            self._driver_waiting -= 1

    def _run(self) -> None:
        spins = 0
        try:
            while True:
                if self._stopping:
                    with self._progress:
                        self._step()
                        self._stop_thread()
                    return
                if self._driver_waiting and not self._stopping:
                    # a user thread is driving progress; stay out of its way
                    self._wake.wait(IDLE_POLL_S)
                    self._wake.clear()
                    continue
                self._wake.clear()
                with self._progress:
                    progressed = self._step()
                if progressed:
                    spins = 0
                    continue
                busy = bool(self._inflight) or (self.coordinator is not None
                                                 and bool(self.coordinator.pending))
                if not busy:
                    self._wake.wait(IDLE_POLL_S)
                elif spins < 64:
                    spins += 1
                    time.sleep(0)
                else:
                    spins += 1
                    self._wake.wait(min(MAX_BACKOFF_S, 2e-5 * 2 ** min(spins - 64, 10)))
        except BaseException as exc:  # never die silently: fail everything that waits
            log.exception("lightcc background thread failed")
            with self._lock:
                self._dead = exc
                entries = list(self._inflight.values())
                self._inflight.clear()
                self._queue.clear()
            for e in entries:
                e.handle._set(error=LightCCError(f"background thread failed: {exc!r}"))

    def _step(self) -> bool:
        new: list = []
        if self._queue:   # unlocked peek; a request queued right after is seen next step
            with self._lock:
                new, self._queue = self._queue, []
        msg = RankMessage()
        now = time.perf_counter() if new else 0.0
        for entry, req in new:
            entry.sent_at = now
            info = self.psets.get(req.pset)
            cid = self.cache.lookup(req) if info is not None else -1
            if cid >= 0:
                msg.cached.append(cid)
            else:
                msg.requests.append(req)
        progressed = bool(new)
        self._prune_sends()
        if self.coordinator is not None:
            if new:
                self.coordinator.receive(0, msg)
            progressed |= self._receive_requests()
            batch = self.coordinator.tick()
            for text in self.coordinator.warnings:
                log.warning("%s", text)
            if batch is not None:
                data = batch.encode() if self.size > 1 else b""
                for dest in range(1, self.size):
                    self._sends.append((self._ctrl.Isend([data, _byte()], dest, TAG_BATCH), data))
                self._execute(batch)
                progressed = True
        else:
            if new and not self._coordinator_gone:
                data = msg.encode()
                self._sends.append((self._ctrl.Isend([data, _byte()], 0, TAG_REQUEST), data))
            progressed |= self._receive_batches()
        return progressed

    def _prune_sends(self) -> None:
        if self._sends:
            self._sends = [(r, d) for r, d in self._sends if not r.Test()]

    def _recv_bytes(self, source: int, tag: int) -> tuple[int, bytes] | None:
        status = self._status
        if not self._ctrl.Iprobe(source, tag, status):
            return None
        buf = bytearray(status.Get_count(self._MPI.BYTE))
        src = status.Get_source()
        self._ctrl.Recv([buf, self._MPI.BYTE], src, tag)
        return src, bytes(buf)

    def _receive_requests(self) -> bool:
        got = False
        while (item := self._recv_bytes(self._MPI.ANY_SOURCE, TAG_REQUEST)) is not None:
            src, data = item
            self.coordinator.receive(src, RankMessage.decode(data))
            got = True
        return got

    def _receive_batches(self) -> bool:
        got = False
        while (item := self._recv_bytes(0, TAG_BATCH)) is not None:
            self._execute(Batch.decode(item[1]))
            got = True
            if self._coordinator_gone:
                break
        return got

    # ---- execution ---------------------------------------------------------------------------
    def _execute(self, batch: Batch) -> None:
        if batch.settings:
            self._apply_settings(batch.settings)
        responses: list[Response] = []
        for item in batch.items:
            if isinstance(item, int):
                responses.append(self.cache.get(item))
            else:
                if not batch.joined:
                    info = self.psets.get(item.request.pset)
                    self.cache.add(item, info.index(self.rank) if info else None)
                responses.append(item)
        if self.ctx.tracer.enabled:
            self.ctx.tracer.instant("engine", "CYCLE", time.perf_counter(), step=self.ctx.step,
                                    responses=len(responses))
        for bucket in fusion.plan(responses, self.fusion_threshold, self.ctx.min_compress_bytes):
            self._execute_bucket([responses[i] for i in bucket])
        self.ctx.step += 1
        if batch.shutdown:
            self._remote_shutdown(batch.shutdown)

    def _take(self, resp: Response) -> executor.LocalEntry | None:
        with self._lock:
            return self._inflight.pop(resp.request.key, None)

    def _execute_bucket(self, resps: list[Response]) -> None:
        entries = [self._take(r) for r in resps]
        first = resps[0]
        if first.error:
            exc_type = _ERROR_TYPES.get(first.error_kind, LightCCError)
            if entries[0] is not None:
                entries[0].handle._set(error=exc_type(first.error))
            elif first.error_kind == "stall":
                log.error("%s", first.error)
            return
        req = first.request
        if req.coll == Coll.ADD_PSET:
            self._add_pset(first)
        elif req.coll == Coll.REMOVE_PSET:
            self._remove_pset(req.root)
        info = self.psets.get(req.pset)
        if info is None or info.topo is None:
            for e in entries:   # not a member: nothing to do (members only submit)
                if e is not None:
                    e.handle._set(error=InvalidArgumentError(f"process set {req.pset} is gone"))
            return
        if all(e is None for e in entries) and not (self._joined and req.coll in
                                                    (Coll.ALLREDUCE, Coll.ALLGATHER)):
            return
        prev_topo = self.ctx.topo
        self.ctx.topo = info.topo
        tracer = self.ctx.tracer
        start = time.perf_counter()
        if tracer.enabled:
            for e, r in zip(entries, resps):
                if e is not None:
                    tracer.span(r.request.name, "QUEUE", e.submitted_at, e.sent_at)
                    tracer.span(r.request.name, "NEGOTIATE", e.sent_at, start)
        self._notify("bucket_start", responses=resps)
        agreed = executor.needs_agreement(self.ctx, resps)
        local_exc: Exception | None = None
        failed: list[int] = []
        try:
            if agreed:
                executor.prepare_agreement(self.ctx)
            try:
                if req.coll == Coll.ALLREDUCE:
                    results = executor.allreduce_bucket(self.ctx, resps, entries)
                else:
                    results = [executor.execute_single(self.ctx, first, entries[0])]
                    if tracer.enabled:
                        tracer.span(req.name, req.coll.name, start, time.perf_counter())
            except Exception as exc:
                local_exc = exc
            if agreed:
                failed = [info.ranks[i] for i in
                          executor.agree(self.ctx, local_exc is not None, req.describe())]
        finally:
            self.ctx.topo = prev_topo
        if local_exc is not None or failed:
            self._fail_bucket(resps, entries, local_exc, failed)
            return
        self._notify("bucket_done", responses=resps, seconds=time.perf_counter() - start)
        if req.coll == Coll.JOIN:
            self._joined = False
        for e, res in zip(entries, results):
            if e is not None:
                e.handle._set(result=res)

    def _fail_bucket(self, resps: list[Response], entries: list, exc: Exception | None,
                     failed: list[int]) -> None:
        """Fail every handle of a bucket that failed here or (agreed) on another rank."""
        what = resps[0].request.describe()
        if len(resps) > 1:
            what += f" (bucket of {len(resps)} tensors)"
        ranks = failed or [self.rank]
        where = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
        detail = f": {exc}" if exc is not None else " (see that rank's error for the cause)"
        for e in entries:
            if e is not None:
                err = CollectiveError(f"{what} failed on {where}{detail}")
                err.__cause__ = exc
                e.handle._set(error=err)

    def _notify(self, event: str, **info: Any) -> None:
        for listener in self.listeners:
            listener(event, **info)

    def _apply_settings(self, settings: dict) -> None:
        if "fusion_threshold" in settings:
            self.fusion_threshold = int(settings["fusion_threshold"])
        if "algorithm" in settings:
            self.ctx.algorithm = str(settings["algorithm"])
        if "auto_thresholds" in settings:
            from . import algorithms

            algorithms.set_thresholds(**settings["auto_thresholds"])
        if self.coordinator is not None:
            if "cycle_time" in settings:
                self.coordinator.cycle_time = float(settings["cycle_time"]) / 1000.0
            if "fusion_threshold" in settings:
                self.coordinator.fusion_threshold = self.fusion_threshold

    def _add_pset(self, resp: Response) -> None:
        ranks = tuple(resp.request.splits)
        member = self.rank in ranks
        sub = self.topo.world.split(0 if member else 1, self.rank, f"pset{resp.value}")
        if member:
            hosts = [self.hostnames[r] for r in ranks]
            topo = build(sub, hosts, self.config.local_size)
            self.psets[resp.value] = ProcessSetInfo(ranks, topo)
        else:
            sub.free()
            self.psets[resp.value] = ProcessSetInfo(ranks, None)

    def _remove_pset(self, pset_id: int) -> None:
        info = self.psets.pop(pset_id, None)
        if info is not None and info.topo is not None:
            executor.release_agreement(info.topo.world)
            info.topo.free()
            info.topo.world.free()

    # ---- shutdown ----------------------------------------------------------------------------
    def _fail_all(self, make_error) -> None:
        with self._lock:
            entries = list(self._inflight.values())
            self._inflight.clear()
            self._queue.clear()
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
            for dest in range(1, self.size):
                self._sends.append((self._ctrl.Isend([data, _byte()], dest, TAG_BATCH), data))
        elif not self._coordinator_gone:
            data = RankMessage(shutdown=True).encode()
            self._sends.append((self._ctrl.Isend([data, _byte()], 0, TAG_REQUEST), data))
        deadline = time.monotonic() + 2.0
        while self._sends and time.monotonic() < deadline:
            self._prune_sends()
            time.sleep(0.001)


def _byte() -> Any:
    from mpi4py import MPI

    return MPI.BYTE
