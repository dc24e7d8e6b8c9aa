"""Blocking unnamed allreduces, checked (and when small, reduced) on the calling thread.

Why: a metric averaged with ``lcc.allreduce(loss)`` went through the engine: a hand-off to the
background thread, a control round trip through rank 0 and a hand-off back, 0.3-0.5 ms on a
loaded host against 2-5 us for MPI's own call, and 1.7-2x gloo's latency (docs/benchmarks.md).

Which calls: the *blocking* ``allreduce`` (``lightcc.allreduce``, ``lightcc.torch.allreduce`` and
``allreduce_``) without a name and without ``ordered=True``. Horovod names such calls from a
per-process counter (``allreduce.noname.7``), so they must already come in the same order on
every rank; this path relies on that order and on nothing else. (Blocking and asynchronous
unnamed calls are two sequences now: a rank's blocking call meets the others' blocking calls,
so ranks must not differ in which form they use for the same call, which Horovod tolerated.)
Every such call is checked
here (step 1); a host array of at most ``LCC_DIRECT_BYTES`` bytes that no compressor would
touch is also reduced here (step 2, "the direct path"), the others then go to the engine. Each
rank decides from its own call alone, so ranks that make the same call take the same path, and
ranks whose calls differ fail in step 1. Asynchronous calls never come here: blocking inside
``allreduce_async`` could deadlock a program whose ranks order their named collectives
differently, which the engine allows.

Protocol, per process set, on a communicator of its own (duplicated when the set is made, so
it never meets the engine's traffic), one call at a time:

1. **Header**: one int64 SUM allreduce of ``[1, a, a², b, b², c, c², dtype, op, count, nan,
   here]``, where ``a, b, c`` are 21-bit pieces of a hash of the call's signature (dtype,
   shape, op, scale factors, compression, memory, path). A rank inside ``join()`` adds zeros.
   Every rank reads the same sums and reaches the same verdict: ``m`` ranks contributed, and
   their hashes are all equal exactly when ``m·Σa² = (Σa)²`` for every piece (the equality
   case of Cauchy-Schwarz). ``m = 0``: every rank has joined. Unequal: the ranks allgather
   their descriptions and each caller raises :class:`MismatchError` naming them.
2. **Payload** (``here`` = 1): one allreduce in the reduction dtype (float32 for 16-bit
   floats), plus a NaN mask for floating min/max, as the host strategy does; joined ranks add
   zeros. Scaling and averaging follow the host strategy (``Average`` divides by the set's size).

Both are MPI-4 persistent requests, created once (the header's with the path; a payload
shape's at the first call every member agreed on, so creations match in order; at most
``_MAX_PAYLOADS`` shapes, the cache emptied at the same call everywhere) and started at each
call. Both are waited for alike: the request is tested in a loop for ~100 us, then
with sleeps growing to 0.5 ms (a rank waiting for a late one takes no core from it). A wait
warns every ``LCC_STALL_CHECK_TIME`` seconds and raises :class:`StallError` after
``LCC_STALL_SHUTDOWN_TIME``; it raises :class:`ShutdownError` when the engine learns that
lightcc stopped on this rank or that a member shut down or exited (the coordinator announces
gone ranks in its batches) and the request does not complete within ``GONE_GRACE_S`` after
that (a member that finished this very call and then shut down is announced as gone, and the
announcement can overtake its data). A posted collective cannot be withdrawn, so after such an error
the set's direct path is closed on that rank and later calls raise the same error; the late
ranks' matching call then fails after its own stall limit. In lazy mode (``LCC_OVERLAP``) the
waiting thread also starts this rank's queued engine work, which the others may wait for.
"""
from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
from typing import Any

import numpy as np

from .. import dtypes
from ..exceptions import LightCCError, MismatchError, ShutdownError, StallError
from .fusion import compression_applies
from .reduction import finish_scaling, nan_mask, prescale, restore_nans

log = logging.getLogger("lightcc")

SPIN_S = 100e-6          # test in a loop this long before sleeping between tests
MAX_PAUSE_S = 0.5e-3     # longest sleep between two tests of a request
#: how long a request may still complete after a member was announced gone (see _completes)
GONE_GRACE_S = 2.0
_PIECE = 21              # bits per hash piece: m * sum(a^2) stays exact in int64 up to 2^20 ranks
_REDUCE_DTYPES = ("float32", "float64", "int8", "uint8", "int16", "uint16", "int32", "int64")
_BACKEND_OPS = ("sum", "min", "max", "prod", "band", "bor", "bxor")
_HEADER = 12



def eligible(nbytes: int, compression: str, min_compress_bytes: int, limit: int,
             dtype: str = "float32", op: str = "average") -> bool:
    """Whether a blocking unnamed host allreduce of ``nbytes`` takes the direct path: small
    enough, and no compressor applies (the engine's rule, fusion.compression_applies)."""
    return nbytes <= limit and compression_applies(compression, op, dtype, nbytes,
                                                   min_compress_bytes) == "none"


class _Plan:
    """What one call signature needs, computed once: the header this rank sends, the sums
    that mean "every rank sent it", and the payload's reduction dtype and op."""

    __slots__ = ("header", "agreed", "rdt", "op", "nan", "desc", "size")

    header: np.ndarray
    agreed: bytes

    def __init__(self, sig: tuple, size: int) -> None:
        dtype, shape, op, direct = sig[0], sig[1], sig[2], sig[7]
        digest = hashlib.blake2b(repr(sig).encode(), digest_size=8).digest()
        h = int.from_bytes(digest, "little")
        mask = (1 << _PIECE) - 1
        a, b, c = h & mask, (h >> _PIECE) & mask, (h >> 2 * _PIECE) & mask
        self.rdt = dtypes.reduce_dtype(dtype)
        self.op = bop = dtypes.backend_op(op, dtype)
        self.nan = dtype in dtypes.FLOATING and op in ("min", "max")
        self.size = math.prod(shape)
        self.header = np.array([1, a, a * a, b, b * b, c, c * c,
                                _REDUCE_DTYPES.index(self.rdt.name), _BACKEND_OPS.index(bop),
                                self.size, int(self.nan), int(direct)], np.int64)
        self.agreed = (self.header * size).tobytes()     # the sums when every member sent it
        self.desc = _describe(sig)


_MAX_PAYLOADS = 64       # payload shapes kept with a persistent request, per process set


class _Payload:
    """A payload shape's buffer (reduced in place) and persistent requests."""

    __slots__ = ("buf", "req", "mask", "mask_req")

    def __init__(self, comm: Any, rdt: np.dtype, n: int, op: str, nan: bool) -> None:
        self.buf = np.zeros(n, rdt)
        self.req = comm.allreduce_init(self.buf, None, op)
        self.mask = np.zeros(n, np.uint8) if nan else None
        self.mask_req = comm.allreduce_init(self.mask, None, "max") if nan else None


class DirectPath:
    """The direct path of one process set on this rank (see the module docstring)."""

    def __init__(self, comm: Any, ranks: tuple[int, ...], stall_check: float,
                 stall_shutdown: float) -> None:
        self.comm = comm                 # an MPICommunicator (allreduce_init), this path's alone
        self.ranks = ranks               # the set's members (global ranks), in set order
        self.size = len(ranks)
        self.stall_check = stall_check
        self.stall_shutdown = stall_shutdown
        self.calls = 0                   # calls checked here on this rank (for messages)
        self.reduced = 0                 # of which reduced here too (the others: the engine)
        self.closed: BaseException | None = None
        self._lock = threading.Lock()
        self._plans: dict[tuple, _Plan] = {}
        self._zeros = np.zeros(_HEADER, np.int64)
        self._total = np.zeros(_HEADER, np.int64)
        # persistent requests (MPI-4): one for every header, one per payload shape; every
        # member creates them at the same calls (the header's at construction, a payload's
        # at the first call that agreed on it), so they match in order
        self._sent = np.zeros(_HEADER, np.int64)
        self._header_req = comm.allreduce_init(self._sent, self._total, "sum")
        self._payloads: dict[tuple, _Payload] = {}

    # -- the call ------------------------------------------------------------------------------
    def allreduce(self, arr: Any, op: str, dtype: str, pre: float, post: float,
                  compression: str, out: np.ndarray | None, engine: Any, direct: bool,
                  memory: str = "host") -> np.ndarray | None:
        """Check that every rank makes this call (``arr`` validated by the caller); then, when
        ``direct``, reduce it here and return the result (``out`` if given), else return None
        and the caller submits it to the engine."""
        sig = (dtype, tuple(arr.shape), op, pre, post, compression, memory, direct)
        plan = self._plans.get(sig)
        if plan is None:
            if len(self._plans) > 4096:
                self._plans.clear()
            plan = self._plans[sig] = _Plan(sig, self.size)
        with self._lock:
            self._check_open()
            self.calls += 1
            total = self._exchange_header(plan.header, engine, plan, joined=False)
            if total.tobytes() != plan.agreed and not self._agree(total):
                self._mismatch(self._what(plan), plan.desc)
            if not direct:
                return None
            self.reduced += 1
            pay = self._payload_for(plan.rdt, plan.size, plan.op, plan.nan)
            buf = pay.buf
            np.copyto(buf.reshape(arr.shape), arr, casting="unsafe")
            prescale(buf, dtype, pre)
            self._payload(pay, engine, plan)
            finish_scaling(buf, op, dtype, self.size, post)
            result = buf.reshape(arr.shape)
            if out is None:       # buf is the persistent request's: hand out a copy
                return result.astype(dtypes.SUPPORTED[dtype], copy=True)
            np.copyto(out, result, casting="unsafe")
        return out

    def serve_join(self, engine: Any, join_handle: Any) -> None:
        """On a rank inside ``join()``: add zeros to the other ranks' direct calls until every
        rank has joined (a header with no contributions)."""
        with self._lock:
            self._check_open()
            while True:
                total = self._exchange_header(self._zeros, engine, None, joined=True,
                                              join_handle=join_handle)
                m = int(total[0])
                if m == 0:
                    return
                if not self._agree(total):
                    self._mismatch("join()", None)   # the callers raise; this rank goes on
                    continue
                if not total[11]:
                    continue          # the call goes through the engine, which adds our zeros
                pay = self._payload_for(np.dtype(_REDUCE_DTYPES[int(total[7]) // m]),
                                        int(total[9]) // m, _BACKEND_OPS[int(total[8]) // m],
                                        bool(total[10]))
                pay.buf.fill(0)
                self._payload(pay, engine, None)

    def free(self) -> None:
        """Free the requests and the communicator (collective); not after an error left a
        request posted."""
        if self.closed is None and self.comm is not None:
            self._free_payloads()
            self._header_req.free()
            self.comm.free()
        self.comm = None

    def _free_payloads(self) -> None:
        for pay in self._payloads.values():
            pay.req.free()
            if pay.mask_req is not None:
                pay.mask_req.free()
        self._payloads.clear()

    def _payload_for(self, rdt: np.dtype, n: int, op: str, nan: bool) -> "_Payload":
        """The persistent payload request of this shape, created on first use: every member
        gets here at the same call (the header agreed), so creations match in order; the
        cache is emptied at the same call everywhere when it is full."""
        key = (rdt, n, op, nan)
        pay = self._payloads.get(key)
        if pay is None:
            if len(self._payloads) >= _MAX_PAYLOADS:
                self._free_payloads()
            pay = self._payloads[key] = _Payload(self.comm, rdt, n, op, nan)
        return pay

    # -- pieces --------------------------------------------------------------------------------
    def _what(self, plan: _Plan | None) -> str:
        return "join()" if plan is None else f"unnamed allreduce #{self.calls} ({plan.desc})"

    def _check_open(self) -> None:
        if self.closed is not None:
            raise type(self.closed)(f"the direct path of this process set was closed by an "
                                    f"earlier error: {self.closed}")
        if self.comm is None:
            raise ShutdownError("lightcc is shut down on this rank")

    @staticmethod
    def _agree(total: np.ndarray) -> bool:
        """The contributing ranks (some may have joined) sent the same header: exact integer
        arithmetic on the sums (see the module docstring)."""
        m = int(total[0])
        if m == 0:
            return True
        for i in (1, 3, 5):
            s, sq = int(total[i]), int(total[i + 1])
            if m * sq != s * s:
                return False
        return all(int(total[i]) % m == 0 for i in (7, 8, 9, 10, 11))

    def _exchange_header(self, header: np.ndarray, engine: Any, plan: _Plan | None,
                         joined: bool, join_handle: Any = None) -> np.ndarray:
        self._sent[:] = header
        req = self._header_req
        req.start()
        self._wait(req, engine, plan, not joined, join_handle, "a rank of the process set never "
                   "made its matching call, or gave up on it after a StallError")
        return self._total

    def _wait(self, req: Any, engine: Any, plan: _Plan | None, stall: bool, join_handle: Any,
              missing: str) -> None:
        """Test ``req`` until done: a short spin, then growing sleeps; stall warning and error
        (when ``stall``), and errors as soon as lightcc stopped on this or another rank."""
        if req.test():
            return
        start = time.monotonic()
        spin_until = start + SPIN_S
        warned_at = start
        pause = 10e-6
        while not req.test():
            now = time.monotonic()
            if now < spin_until:        # MPI_Test releases the GIL; sleep(0) cost ~100 us
                continue
            failed = self._engine_error(engine, plan, join_handle)
            if failed is not None:
                if self._completes(req):
                    return
                self._close(failed)
            if stall:
                waited = now - start
                if self.stall_shutdown > 0 and waited >= self.stall_shutdown:
                    self._close(StallError(f"{self._what(plan)} waited {waited:.1f} s on rank "
                                           f"{engine.rank}: {missing}. {_ORDER_HINT}"))
                if self.stall_check > 0 and now - warned_at >= self.stall_check:
                    warned_at = now
                    log.warning("stall: %s has waited %.1f s on rank %d (direct path for small "
                                "unnamed allreduces): %s. %s", self._what(plan), waited,
                                engine.rank, missing, _ORDER_HINT)
            if engine.lazy and engine.has_queued():
                engine.nudge()          # work this rank queued earlier may be what they wait for
            time.sleep(pause)
            pause = min(pause * 2, MAX_PAUSE_S)

    def _engine_error(self, engine: Any, plan: _Plan | None,
                      join_handle: Any) -> BaseException | None:
        """The error to raise because lightcc stopped on this rank or a member left, or None."""
        what = self._what(plan)
        status = engine.status
        stopped = status.error(what)
        if stopped is not None:
            return stopped
        gone = status.gone_ranks.intersection(self.ranks)
        if gone:
            return ShutdownError(f"{what}: rank{'s' if len(gone) > 1 else ''} "
                                 f"{', '.join(map(str, sorted(gone)))} shut down or exited "
                                 f"without making the matching call")
        if join_handle is not None and join_handle.failure is not None:
            return join_handle.failure
        return None

    @staticmethod
    def _completes(req: Any) -> bool:
        """Whether ``req`` completes within ``GONE_GRACE_S``: a rank that finished this call
        and then shut down (or exited) may be announced before its data reached us."""
        deadline = time.monotonic() + GONE_GRACE_S
        while time.monotonic() < deadline:
            if req.test():
                return True
            time.sleep(1e-3)
        return req.test()

    def _close(self, exc: BaseException) -> None:
        self.closed = exc
        raise exc

    def _payload(self, pay: "_Payload", engine: Any, plan: _Plan | None) -> None:
        """Every member passed the header, so all start this at once; it still waits with
        a stall limit, for the member whose header was one it gave up on (a StallError)."""
        gave_up = "a rank gave up on this call (StallError) just after the others matched it"
        if pay.mask_req is not None:     # as the engine's strategies (shared.needs_nan_mask)
            np.copyto(pay.mask, nan_mask(pay.buf))
            pay.mask_req.start()
            self._wait(pay.mask_req, engine, plan, True, None, gave_up)
        if pay.buf.size:
            pay.req.start()
            self._wait(pay.req, engine, plan, True, None, gave_up)
        if pay.mask_req is not None:
            restore_nans(pay.buf, pay.mask)

    def _mismatch(self, what: str, mine: str | None) -> None:
        """Every rank saw the disagreement in the same sums: all gather the descriptions."""
        seen = self.comm.allgather_object(mine)
        if mine is None:
            return
        parts = [f"rank {r}: {d if d is not None else 'in join()'}"
                 for r, d in zip(self.ranks, seen)]
        raise MismatchError(f"{what}: the ranks' unnamed allreduces differ ({'; '.join(parts)}). "
                            f"{_ORDER_HINT}")


_ORDER_HINT = ("Blocking unnamed allreduces are matched by call order, among themselves (not "
               "with allreduce_async ones): every rank must make the same ones in the same "
               "order. Pass name= to match a call by name instead; LCC_DIRECT_BYTES=0 sends "
               "them through the engine, in one order with the asynchronous ones.")


def _describe(sig: tuple) -> str:
    dtype, shape, op, pre, post, compression, memory, _direct = sig
    text = f"{dtype} {shape} {op}" + (" on the GPU" if memory != "host" else "")
    if pre != 1.0 or post != 1.0:
        text += f" prescale {pre:g} postscale {post:g}"
    if compression != "none":
        text += f" compression {compression}"
    return text
