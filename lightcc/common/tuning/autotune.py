"""Online tuning of fusion threshold, cycle time and algorithm, remembered across runs.

``LCC_AUTOTUNE=1`` (``lccrun --autotune``) starts an :class:`Autotuner` on rank 0; other ranks
only apply what rank 0 decides, because a new setting travels in the next negotiated batch
(``Coordinator.pending_settings`` -> ``Batch.settings``) and every rank applies it before
executing that batch. The autotuner listens to the engine's ``bucket_done`` events, cuts them
into training steps (:class:`StepDetector`), and

* after the first step, computes the fingerprint of cluster, model and lightcc version
  (:mod:`.cache`); when the cache holds a setting for it (and the mode is not
  ``refresh``), it applies that setting at once, logs one line and never tunes;
* otherwise it runs the search (:class:`~.search.SearchLoop`, optuna TPE), applies
  the best setting when the search settles (within ``max_steps``, 300 by default), logs one
  line and stores the setting in the cache. ``LCC_AUTOTUNE_LOG`` gets every sample as CSV.

See docs/autotune.md for the objective, the schedule and the measured results.
"""
from __future__ import annotations

import logging
import re
import threading
import time
from dataclasses import dataclass
from typing import Any

from . import cache
from .search import SearchLoop, SearchSpace, Setting, TunerOptions

log = logging.getLogger("lightcc")

_NONAME = re.compile(r"\.noname\.\d+$")


@dataclass(frozen=True)
class Step:
    """One training step: its tensors ``(name, shape, dtype)``, bytes, and end time (s)."""

    tensors: tuple[tuple[str, tuple[int, ...], str], ...]
    nbytes: int
    end: float


class StepDetector:
    """Cuts a stream of reduced tensors into steps: a step ends when a name comes back.

    Training reduces every gradient once per step under a stable name, so the first name
    seen twice opens the next step. Generated names (``allreduce.noname.17``) count as one
    name, so a stream of only unnamed tensors gives one step per tensor.
    """

    def __init__(self) -> None:
        self._seen: set[str] = set()
        self._tensors: list[tuple[str, tuple[int, ...], str]] = []
        self._bytes = 0
        self._last_end = 0.0

    def feed(self, tensors: list[tuple[str, tuple[int, ...], str, int]],
             end: float) -> Step | None:
        """Tensors ``(name, shape, dtype, nbytes)`` of one bucket that finished at ``end``."""
        done: Step | None = None
        for i, (name, shape, dtype, nbytes) in enumerate(tensors):
            key = _NONAME.sub(".noname", name)
            if key in self._seen:
                done = Step(tuple(self._tensors), self._bytes, end if i else self._last_end)
                self._seen.clear()
                self._tensors = []
                self._bytes = 0
            self._seen.add(key)
            self._tensors.append((key, tuple(shape), dtype))
            self._bytes += nbytes
        self._last_end = end
        return done


class Autotuner:
    """Rank 0's tuner for one engine (see module docstring).

    ``mode`` is ``"1"`` (use the cache when it matches, else tune) or ``"refresh"`` (tune and
    overwrite the cache entry).
    """

    def __init__(self, engine: Any, mode: str = "1", log_path: str = "", cache_path: str = "",
                 options: TunerOptions | None = None, space: SearchSpace | None = None) -> None:
        import optuna  # noqa: F401  (import now, not on the engine thread at the first step)

        from .. import algorithms

        self.engine = engine
        self.mode = mode
        self.log_path = log_path
        self.cache_path = cache_path or cache.default_cache_path()
        self.options = options or TunerOptions()
        self.space = space or SearchSpace(tuple(a for a in algorithms.available_algorithms()
                                                if a != "auto"))
        self.detector = StepDetector()
        self.loop: SearchLoop | None = None
        self.state = "waiting"          # waiting -> tuning -> done | cached | stopped
        self.key = ""
        self.fingerprint: dict[str, Any] = {}
        self.applied: Setting | None = None
        self.steps = 0
        self.started = time.perf_counter()
        self.finished = threading.Event()
        engine.listeners.append(self.on_event)

    # ---- engine thread ------------------------------------------------------------------------
    def on_event(self, event: str, **info: Any) -> None:
        if event != "bucket_done" or self.state not in ("waiting", "tuning"):
            return
        from ..control.messages import Coll
        from ..dtypes import itemsize

        tensors = []
        for resp in info["responses"]:
            req = resp.request
            if resp.error or req.coll != Coll.ALLREDUCE:
                continue
            count = 1
            for d in req.shape:
                count *= d
            tensors.append((req.name, req.shape, req.dtype, count * itemsize(req.dtype)))
        if not tensors:
            return
        step = self.detector.feed(tensors, time.perf_counter())
        if step is None:
            return
        self.steps += 1
        if self.state == "waiting":
            self._first_step(step)
        if self.state == "tuning":
            nxt = self.loop.on_step(step.nbytes, step.end)
            if nxt is not None:
                self._apply(nxt)
            if self.loop.done:
                self._settled()

    def current_setting(self) -> Setting:
        eng = self.engine
        return Setting(int(eng.fusion_threshold), round(eng.coordinator.cycle_time * 1000.0, 3),
                       str(eng.algorithm))

    def _apply(self, setting: Setting) -> None:
        self.applied = setting
        self.engine.coordinator.pending_settings.update(setting.as_settings())

    def _first_step(self, step: Step) -> None:
        from ..._version import __version__

        topo = self.engine.topo
        cluster = cache.cluster_fingerprint(topo.node_of_rank,
                                            cache.interconnect_guess(topo.num_nodes))
        self.fingerprint = cache.fingerprint(cluster, cache.model_fingerprint(step.tensors),
                                             __version__)
        self.key = cache.fingerprint_key(self.fingerprint)
        hit = cache.lookup(self.cache_path, self.key) if self.mode != "refresh" else None
        if hit is not None:
            s = hit["setting"]
            setting = Setting(int(s["fusion_threshold"]), float(s["cycle_time"]),
                              str(s["algorithm"]))
            self._apply(setting)
            self.state = "cached"
            self.finished.set()
            log.warning("autotune: using the cached setting %s for this cluster and model "
                        "(fingerprint %s in %s); not tuning (LCC_AUTOTUNE=refresh re-tunes)",
                        setting.describe(), self.key[:12], self.cache_path)
            return
        self.loop = SearchLoop(self.space, self.current_setting(), self.options,
                               log_path=self.log_path)
        self.state = "tuning"
        log.info("autotune: tuning %s over %d tensors (%d bytes per step), fingerprint %s",
                 ", ".join(self.space.algorithms), len(step.tensors), step.nbytes,
                 self.key[:12])

    def _settled(self) -> None:
        loop = self.loop
        base = loop.scores.get(next(iter(loop.scores)), [0.0])[0] if loop.scores else 0.0
        self.state = "done"
        log.warning("autotune: settled after %d steps on %s: %.1f MB/s of gradients "
                    "(start: %.1f MB/s); cached in %s", loop.settled_at, loop.best.describe(),
                    loop.best_score / 1e6, base / 1e6, self.cache_path)
        try:
            cache.store(self.cache_path, self.key, self.fingerprint, loop.best.as_settings(),
                        loop.best_score, loop.settled_at)
        except OSError as exc:
            log.warning("autotune: could not write the cache %s: %s", self.cache_path, exc)
        self.finished.set()

    # ---- user thread --------------------------------------------------------------------------
    def stop(self) -> None:
        """Detach from the engine; a search cut short is logged and not cached."""
        if self.on_event in self.engine.listeners:
            self.engine.listeners.remove(self.on_event)
        if self.state in ("waiting", "tuning"):
            if self.loop is not None:
                self.loop.close()
                log.warning("autotune: stopped after %d steps, before the search settled; "
                            "nothing was cached", self.loop.steps)
            self.state = "stopped"
        self.finished.set()


_active: Autotuner | None = None


def start(engine: Any, cfg: Any, options: TunerOptions | None = None) -> Autotuner | None:
    """Start tuning ``engine`` per ``cfg.autotune`` (rank 0 only; other ranks return None)."""
    global _active
    stop(engine)
    if engine.rank != 0 or cfg.autotune == "0":
        return None
    _active = Autotuner(engine, cfg.autotune, cfg.autotune_log, cfg.autotune_cache, options)
    return _active


def stop(engine: Any = None) -> None:
    global _active
    tuner, _active = _active, None
    if tuner is not None:
        tuner.stop()


def active() -> Autotuner | None:
    """The running (or finished) autotuner of this process, rank 0 only."""
    return _active
