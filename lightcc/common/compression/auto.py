"""``compression=auto``: the format of each tensor chosen from measurements of this link.

``auto:lossless`` (``auto``'s default) chooses among none, fp16 and bf16; ``auto:lossy`` also
among scaled fp8 (E4M3). One :class:`AutoCompressor` per process set; it keeps a state per
communicator it is handed (the world for ``flat``, the cross-host one for ``hierarchical``), and
every rank of a communicator sees the same buckets in the same order, so every step below
happens at the same bucket on all of them:

1. **Measure** (the first :data:`WARM_STEPS` training steps; a step ends when a tensor name
   comes back): buckets are reduced uncompressed; the communicator's rank 0 samples each
   tensor's values for the range check (:func:`.autochoice.range_errors`).
2. **Decide** (at the first bucket of the next step, collective): the ranks check that they
   agree on the accuracy, then time real allreduces of a probe buffer at two sizes with every
   candidate format (barrier before each, minimum of :data:`.autoprobe.REPS`, formats interleaved, maximum over the ranks);
   rank 0 times each codec alone, fits :class:`.autochoice.LinkModel`, chooses per tensor
   (:func:`.autochoice.choose`) and broadcasts the choices; every rank applies what rank 0
   sent. A cached decision (the autotune cache, same communicator, ranks, accuracy, tensors and
   lightcc version) is reused when a quick probe of the uncompressed link agrees with the
   cached one within :data:`.autoprobe.CACHE_TOLERANCE` (``LCC_AUTOTUNE=refresh`` ignores the cache).
3. **Run**: each bucket is cut into runs of consecutive tensors with the same format, each run
   reduced by that format's compressor (``none``: the communicator's allreduce).
4. **Re-check** every :data:`CHECK_EVERY` steps: each rank compares the median step time of
   the last window with the first window after the decision; when, in :data:`DRIFT_WINDOWS`
   consecutive windows, some rank saw it move by more than :data:`DRIFT` (and
   :data:`DRIFT_MIN_S`), all measure and decide again (a loaded machine moves a window's
   median by 25-60 %: one window is not enough).

The decision is logged once by world rank 0 and put in the timeline (``AUTO_COMPRESSION``).
"""
from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from ..exceptions import ConfigError
from . import autochoice as ac
from .autoprobe import as_array, decide, host, world_rank
from .base import BucketContext
from .registry import make, register

log = logging.getLogger("lightcc")

WARM_STEPS = 2               # steps measured uncompressed before deciding
MAX_UNDECIDED_CALLS = 256    # decide after this many buckets even if no name ever repeats
SAMPLE = 4096                # values per tensor for the range check
CHECK_EVERY = 50             # steps between drift checks
DRIFT = 0.5                  # relative change of the median step time that counts as drift
DRIFT_MIN_S = 0.002          # ... when it is also at least this many seconds
DRIFT_WINDOWS = 2            # consecutive drifting windows that trigger a re-check


class _State:
    """What an AutoCompressor knows about one communicator."""

    def __init__(self) -> None:
        self.order: list[str] = []          # tensor names in first-seen order (same on all)
        self.index: dict[str, int] = {}
        self.sizes: dict[str, int] = {}     # elements
        self.seen: set[str] = set()         # names of the current step
        self.steps = 0                      # step boundaries seen
        self.calls = 0                      # buckets since measuring started
        self.measure_from = 0               # step at which measuring started
        self.errors: dict[str, tuple[float, float]] = {}
        self.codes: np.ndarray | None = None    # per name index; None while measuring
        self.default = 0                    # code for names unseen at the decision
        self.decided_at = 0
        self.mark: float | None = None      # time of the last step boundary
        self.times: list[float] = []        # step times since the last check
        self.baseline: float | None = None  # median step time of the first window
        self.strikes = 0                    # consecutive windows that drifted


class AutoCompressor:
    """``auto:<accuracy>`` (see module docstring)."""

    takes_parts = False

    def __init__(self, accuracy: str = "lossless") -> None:
        self.formats = ac.candidates(accuracy)      # ValueError for an unknown accuracy
        self.accuracy = accuracy
        self.name = f"auto:{accuracy}"
        self.lossy = accuracy == "lossy"
        self._inner: dict[str, Any] = {}
        self._states: dict[int, tuple[Any, _State]] = {}
        self.decisions: list[dict[str, Any]] = []   # every decision made here, in order
        # the decision cache (the engine sets both from LCC_AUTOTUNE_CACHE / LCC_AUTOTUNE and
        # init()'s arguments; None: read the environment): "" is the default path
        self.cache_path: str | None = None
        self.cache_refresh: bool | None = None

    # -- what the engine asks --------------------------------------------------------------
    def needs_agreement(self, comm: Any) -> bool:
        """Whether a bucket over ``comm`` may run a codec (then the ranks agree on success
        afterwards, as for any compressor); False while every tensor goes uncompressed. The
        same on every rank of ``comm``: it changes only at buckets they all execute."""
        item = self._states.get(id(comm))
        if item is None or item[1].codes is None:
            return False
        st = item[1]
        return bool(st.default) or bool(np.any(st.codes))

    def choice(self, comm: Any) -> dict[str, str] | None:
        """The format of each tensor name on ``comm`` (None before the first decision)."""
        item = self._states.get(id(comm))
        if item is None or item[1].codes is None:
            return None
        st = item[1]
        return {name: ac.FORMATS[int(st.codes[i])] for i, name in enumerate(st.order)}

    def wire_bytes(self, numel: int, nranks: int, ctx: BucketContext | None = None) -> int:
        """Uncompressed ring volume (what ``auto`` sends before it decides)."""
        return 2 * (nranks - 1) * 4 * numel // max(nranks, 1)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None

    def _compressor(self, fmt: str) -> Any:
        comp = self._inner.get(fmt)
        if comp is None:
            comp = self._inner[fmt] = make(fmt)
        return comp

    # -- the bucket ------------------------------------------------------------------------
    def allreduce(self, comm: Any, buf: Any, ctx: BucketContext) -> None:
        """Sum ``buf`` over ``comm`` in place, each tensor in its chosen format."""
        if comm.size == 1 or buf.size == 0:
            return
        item = self._states.get(id(comm))
        if item is None:
            item = self._states[id(comm)] = (comm, _State())
        st = item[1]
        pieces = _pieces(buf.size, ctx)
        names = [name for _, _, name in pieces if name]
        st.calls += 1
        if any(name in st.seen for name in names):
            self._step_boundary(comm, st)
        st.seen.update(names)
        for lo, hi, name in pieces:
            if name and name not in st.index:
                st.index[name] = len(st.order)
                st.order.append(name)
            if name:
                st.sizes[name] = max(st.sizes.get(name, 0), hi - lo)
        if st.codes is None:
            if st.steps - st.measure_from >= WARM_STEPS or st.calls > MAX_UNDECIDED_CALLS:
                self._decide(comm, st, buf)
            else:
                if comm.rank == 0:
                    self._sample(st, buf, pieces, comm.size)
                comm.allreduce(buf, "sum")
                return
        self._run(comm, buf, ctx, pieces, st)

    def _run(self, comm: Any, buf: Any, ctx: BucketContext, pieces: list, st: _State) -> None:
        runs: list[list[int]] = []      # [lo, hi, code]
        for lo, hi, name in pieces:
            i = st.index.get(name) if name else None
            code = st.default if i is None or i >= st.codes.size else int(st.codes[i])
            if runs and runs[-1][2] == code and runs[-1][1] == lo:
                runs[-1][1] = hi
            else:
                runs.append([lo, hi, code])
        for lo, hi, code in runs:
            if code == 0:
                comm.allreduce(buf[lo:hi], "sum")
            else:
                self._compressor(ac.FORMATS[code]).allreduce(comm, buf[lo:hi], ctx.sub(lo))

    def _sample(self, st: _State, buf: Any, pieces: list, nranks: int) -> None:
        for lo, hi, name in pieces:
            if not name:
                continue
            stride = max(1, (hi - lo) // SAMPLE)
            err = ac.range_errors(host(buf[lo:hi:stride]), nranks)
            old = st.errors.get(name, (0.0, 0.0))
            st.errors[name] = (old[0] + err[0], old[1] + err[1])

    # -- steps and drift -------------------------------------------------------------------
    def _step_boundary(self, comm: Any, st: _State) -> None:
        now = time.perf_counter()
        st.steps += 1
        st.seen.clear()
        if st.mark is not None and st.codes is not None:
            st.times.append(now - st.mark)
        st.mark = now
        if st.codes is None or (st.steps - st.decided_at) % CHECK_EVERY:
            return
        times = sorted(st.times[1:] if st.baseline is None else st.times)
        st.times = []
        median = times[len(times) // 2] if times else 0.0
        drift = 0.0
        if st.baseline is None:
            st.baseline = median
        elif st.baseline > 0 and abs(median - st.baseline) >= DRIFT_MIN_S:
            drift = abs(median / st.baseline - 1.0)
        flag = as_array(comm, [drift])
        comm.allreduce(flag, "max")
        worst = float(host(flag)[0])
        st.strikes = st.strikes + 1 if worst > DRIFT else 0
        if st.strikes >= DRIFT_WINDOWS:
            if comm.rank == 0 and world_rank() == 0:
                log.warning("compression %s: the step time moved by %.0f %% since the decision "
                            "(%.1f -> %.1f ms on this rank); measuring again", self.name,
                            100 * worst, 1e3 * st.baseline, 1e3 * median)
            st.codes, st.baseline, st.calls, st.strikes = None, None, 0, 0
            st.measure_from, st.errors = st.steps, {}
            st.order, st.index, st.sizes = [], {}, {}   # forget tensors no longer reduced

    # -- the decision ----------------------------------------------------------------------
    def _decide(self, comm: Any, st: _State, buf: Any) -> None:
        decision = decide(self, comm, st, buf)
        st.codes = decision["codes"]
        st.default = decision["default"]
        st.decided_at, st.times, st.baseline, st.mark = st.steps, [], None, time.perf_counter()
        self.decisions.append(decision["record"])


def _pieces(n: int, ctx: BucketContext) -> list[tuple[int, int, str]]:
    """``buf``'s elements cut at tensor boundaries: ``(lo, hi, name)``; ``name`` is '' for
    elements the context does not describe."""
    out: list[tuple[int, int, str]] = []
    pos, base = 0, ctx.base
    for name, off, size in zip(ctx.names, ctx.offsets, ctx.sizes):
        a, b = max(base, off), min(base + n, off + size)
        if a < b:
            if a - base > pos:
                out.append((pos, a - base, ""))
            out.append((a - base, b - base, name))
            pos = b - base
    if pos < n:
        out.append((pos, n, ""))
    return out


def make_auto(options: list[str]) -> AutoCompressor:
    if len(options) > 1:
        raise ConfigError(f"compressor 'auto' takes one option (lossless|lossy), got "
                          f"{':'.join(options)!r}")
    accuracy = options[0] if options else "lossless"
    try:
        return AutoCompressor(accuracy)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


register("auto", make_auto)
