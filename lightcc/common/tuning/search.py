"""The autotuner's search loop: steps in, settings out (pure logic, no engine, no MPI).

:class:`SearchLoop` receives one call per completed training step (bytes reduced in it and the
time it ended) and answers with the setting to apply next, if any. Its life:

1. **baseline**: the setting the run started with is measured first (it is already active);
2. **search**: settings proposed by optuna's TPE sampler (fixed seed, so a run is repeatable)
   over :class:`SearchSpace`; each setting is applied, ``warmup_steps`` steps are skipped
   (the step in which the change landed is mixed, and buffers and caches re-warm), then
   ``steps_per_sample`` steps are measured as one sample;
3. **confirm**: the ``confirm_top`` best settings are measured once more and the best mean
   wins, so a single lucky sample cannot decide;
4. **done**: the winner is applied and the loop stops. It stops searching after
   ``max_trials`` settings, after ``patience`` settings without a 1 % improvement, or when the
   next sample would not fit into ``max_steps`` steps in total.

The score of a sample is gradient bytes reduced per second of wall time over whole steps
(from the end of the step before the window to the end of its last step), i.e. what training
sees, including cycle-time waits and the compute between steps.
"""
from __future__ import annotations

import csv
import logging
import math
import os
from dataclasses import asdict, dataclass
from typing import Any, Callable

log = logging.getLogger("lightcc")

CSV_FIELDS = ("sample", "phase", "step", "fusion_threshold", "cycle_time", "algorithm",
              "bytes", "seconds", "bytes_per_s", "best_bytes_per_s")


@dataclass(frozen=True)
class Setting:
    """One point of the search: fusion threshold (bytes), cycle time (ms), algorithm name."""

    fusion_threshold: int
    cycle_time: float
    algorithm: str

    def as_settings(self) -> dict[str, Any]:
        """The ``Batch.settings`` dict the engine applies on every rank."""
        return asdict(self)

    def describe(self) -> str:
        return (f"fusion_threshold={self.fusion_threshold} bytes, cycle_time="
                f"{self.cycle_time:g} ms, algorithm={self.algorithm}")


@dataclass(frozen=True)
class SearchSpace:
    """Ranges searched: fusion threshold 2**k bytes for k in ``fusion_log2``, cycle time in
    ``cycle_ms`` (log scale, ms), and ``algorithms``."""

    algorithms: tuple[str, ...]
    fusion_log2: tuple[int, int] = (12, 28)        # 4 KiB .. 256 MiB
    cycle_ms: tuple[float, float] = (0.1, 20.0)

    def suggest(self, trial: Any) -> Setting:
        k = trial.suggest_int("fusion_log2", *self.fusion_log2)
        cycle = trial.suggest_float("cycle_time", *self.cycle_ms, log=True)
        algo = trial.suggest_categorical("algorithm", list(self.algorithms))
        return Setting(1 << k, round(cycle, 3), algo)

    def params_of(self, s: Setting) -> dict[str, Any] | None:
        """optuna parameters for ``s`` when it lies inside the space, else None."""
        if s.fusion_threshold <= 0 or s.algorithm not in self.algorithms:
            return None
        k = round(math.log2(s.fusion_threshold))
        lo, hi = self.fusion_log2
        if not lo <= k <= hi or not self.cycle_ms[0] <= s.cycle_time <= self.cycle_ms[1]:
            return None
        return {"fusion_log2": k, "cycle_time": s.cycle_time, "algorithm": s.algorithm}


@dataclass(frozen=True)
class TunerOptions:
    """How long and how carefully to tune (steps are training iterations)."""

    warmup_steps: int = 1
    steps_per_sample: int = 3
    max_trials: int = 60
    patience: int = 24
    confirm_top: int = 3
    max_steps: int = 300
    seed: int = 1234
    startup_trials: int = 10


class SearchLoop:
    """See module docstring. ``on_step`` returns a setting to apply now, or None."""

    def __init__(self, space: SearchSpace, start: Setting, options: TunerOptions | None = None,
                 log_path: str = "", on_sample: Callable[[dict], None] | None = None) -> None:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.space = space
        self.opts = options or TunerOptions()
        self.study = optuna.create_study(
            direction="maximize",
            sampler=optuna.samplers.TPESampler(seed=self.opts.seed,
                                               n_startup_trials=self.opts.startup_trials,
                                               multivariate=True))
        start_params = space.params_of(start)
        if start_params is not None:    # optuna learns from the baseline too
            self.study.enqueue_trial(start_params)
        self.scores: dict[Setting, list[float]] = {}
        self.phase = "baseline"
        self.setting = start
        self._trial: Any = None
        self._confirm: list[Setting] = []
        self._confirmed: list[Setting] = []
        self.steps = 0                  # steps seen since the loop started
        self.samples = 0
        self._skip = 0
        self._window_start: float | None = None
        self._window_bytes = 0
        self._window_steps = 0
        self._best_score = 0.0
        self._since_best = 0
        self.best = start
        self.best_score = 0.0
        self.settled_at = 0             # step at which the loop finished (0 while tuning)
        self._on_sample = on_sample
        self._csv_file = None
        if log_path:
            os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
            self._csv_file = open(log_path, "w", newline="", encoding="utf-8")
            self._csv = csv.DictWriter(self._csv_file, fieldnames=CSV_FIELDS)
            self._csv.writeheader()

    @property
    def done(self) -> bool:
        return self.phase == "done"

    # ---- driving ----------------------------------------------------------------------------
    def on_step(self, nbytes: int, end_time: float) -> Setting | None:
        """One training step ended at ``end_time`` (s) after reducing ``nbytes`` bytes."""
        if self.done:
            return None
        self.steps += 1
        if self._skip > 0 or self._window_start is None:
            self._skip = max(0, self._skip - 1)
            self._window_start = end_time       # the window opens at the end of this step
            return None
        self._window_bytes += nbytes
        self._window_steps += 1
        if self._window_steps < self.opts.steps_per_sample:
            return None
        seconds = max(end_time - self._window_start, 1e-9)
        self._record(self._window_bytes / seconds, self._window_bytes, seconds)
        self._window_bytes = self._window_steps = 0
        self._window_start = end_time
        nxt = self._next()
        if nxt is not None:
            self._skip = self.opts.warmup_steps
        return nxt

    def _record(self, score: float, nbytes: int, seconds: float) -> None:
        self.scores.setdefault(self.setting, []).append(score)
        if self.phase == "search":
            self.study.tell(self._trial, score)
        elif self.phase == "baseline" and self.space.params_of(self.setting) is not None:
            trial = self.study.ask()                    # the enqueued copy of the baseline
            self.space.suggest(trial)
            self.study.tell(trial, score)
        if self.phase != "confirm":
            self._since_best = 0 if score > self._best_score * 1.01 else self._since_best + 1
        self._best_score = max(self._best_score, score)
        row = {"sample": self.samples, "phase": self.phase, "step": self.steps,
               "fusion_threshold": self.setting.fusion_threshold,
               "cycle_time": self.setting.cycle_time, "algorithm": self.setting.algorithm,
               "bytes": nbytes, "seconds": round(seconds, 6), "bytes_per_s": round(score, 1),
               "best_bytes_per_s": round(self._best_score, 1)}
        self.samples += 1
        if self._csv_file is not None:
            self._csv.writerow(row)
            self._csv_file.flush()
        if self._on_sample is not None:
            self._on_sample(row)

    def _mean(self, s: Setting) -> float:
        v = self.scores.get(s, [])
        return sum(v) / len(v) if v else 0.0

    def _next(self) -> Setting | None:
        """The next sample's setting; the loop finishes (and returns the winner) when done."""
        left = self.opts.max_steps - self.steps
        cost = self.opts.warmup_steps + self.opts.steps_per_sample
        if self.phase in ("baseline", "search"):
            if (len(self.study.trials) < self.opts.max_trials
                    and self._since_best < self.opts.patience
                    and left >= cost * (1 + self.opts.confirm_top)):
                self._trial = self.study.ask()
                self.phase, self.setting = "search", self.space.suggest(self._trial)
                return self.setting
            ranked = sorted(self.scores, key=self._mean, reverse=True)
            self._confirm = ranked[:self.opts.confirm_top]
        elif self.phase == "confirm":
            self._confirmed.append(self._confirm.pop(0))
        if self._confirm and left >= cost:
            self.phase, self.setting = "confirm", self._confirm[0]
            return self.setting
        return self._finish()

    def _finish(self) -> Setting:
        pool = self._confirmed or list(self.scores)
        self.best = max(pool, key=self._mean)
        self.best_score = self._mean(self.best)
        self.phase, self.setting = "done", self.best
        self.settled_at = self.steps
        self.close()
        return self.best

    def close(self) -> None:
        """Close the CSV log (the loop may be cut short by shutdown)."""
        if self._csv_file is not None:
            self._csv_file.close()
            self._csv_file = None
