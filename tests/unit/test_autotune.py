"""Autotuner: search loop on a fake objective, step detection, fingerprint cache, engine glue."""
from __future__ import annotations

import csv
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest

from lightcc.common.control.messages import Coll, Request, Response
from lightcc.common.tuning import autotune, cache
from lightcc.common.tuning.autotune import Autotuner, StepDetector
from lightcc.common.tuning.search import SearchLoop, SearchSpace, Setting, TunerOptions

ALGS = ("2d", "flat", "hierarchical", "ring", "tree")
STEP_BYTES = 10_000_000


def speed(s: Setting) -> float:
    """A deterministic fake objective (bytes/s): one optimum at 4 MiB, ~2 ms, ring."""
    fus = 1 / (1 + ((math.log2(s.fusion_threshold) - 22) / 4) ** 2)
    cyc = 1 / (1 + (math.log10(s.cycle_time) - 0.3) ** 2)
    alg = {"flat": 0.6, "native": 0.6, "ring": 1.0, "tree": 0.7, "2d": 0.9,
           "hierarchical": 0.8}[s.algorithm]
    return 1e9 * fus * cyc * alg


BEST = 1e9     # speed() at its optimum
BAD = Setting(4096, 1.0, "flat")


def drive(loop: SearchLoop, start: Setting, limit: int = 1000) -> list[Setting]:
    """Feed simulated steps whose duration follows ``speed``; returns the setting per step."""
    t, cur, seen = 0.0, start, []
    for _ in range(limit):
        if loop.done:
            break
        t += STEP_BYTES / speed(cur)
        seen.append(cur)
        nxt = loop.on_step(STEP_BYTES, t)
        if nxt is not None:
            cur = nxt
    return seen


def test_search_reaches_95_percent_within_300_steps(tmp_path: Path) -> None:
    log = tmp_path / "samples.csv"
    loop = SearchLoop(SearchSpace(ALGS), BAD, log_path=str(log))
    drive(loop, BAD)
    assert loop.done and loop.settled_at <= 300
    assert speed(loop.best) >= 0.95 * BEST, loop.best
    assert speed(BAD) < 0.2 * BEST
    rows = list(csv.DictReader(log.open()))
    assert rows[0]["phase"] == "baseline" and rows[0]["algorithm"] == "flat"
    assert {r["phase"] for r in rows} == {"baseline", "search", "confirm"}
    assert len(rows) == loop.samples
    # every sample: 3 measured steps of STEP_BYTES, score = bytes / seconds
    for r in rows:
        assert int(r["bytes"]) == 3 * STEP_BYTES
        assert float(r["bytes_per_s"]) == pytest.approx(int(r["bytes"]) / float(r["seconds"]),
                                                        rel=1e-4)
    # a sample measures exactly the setting it names (warm-up steps excluded)
    setting = Setting(int(rows[1]["fusion_threshold"]), float(rows[1]["cycle_time"]),
                      rows[1]["algorithm"])
    assert float(rows[1]["bytes_per_s"]) == pytest.approx(speed(setting), rel=1e-6)


def test_search_is_deterministic() -> None:
    a = SearchLoop(SearchSpace(ALGS), BAD)
    b = SearchLoop(SearchSpace(ALGS), BAD)
    assert drive(a, BAD) == drive(b, BAD)
    assert a.best == b.best


def test_budget_and_stop() -> None:
    opts = TunerOptions(max_steps=60, confirm_top=2)
    loop = SearchLoop(SearchSpace(ALGS), BAD, opts)
    seen = drive(loop, BAD)
    assert loop.done and loop.settled_at <= 60
    assert loop.on_step(STEP_BYTES, 1e9) is None       # stopped: no further changes
    assert len(seen) == loop.settled_at


def test_warmup_step_is_not_measured() -> None:
    """The step in which a new setting lands is skipped: a slow mixed step changes nothing."""
    opts = TunerOptions(warmup_steps=1, steps_per_sample=2, max_trials=3, confirm_top=0)
    loop = SearchLoop(SearchSpace(("ring",)), Setting(1 << 20, 1.0, "ring"), opts)
    assert loop.on_step(100, 1.0) is None       # opens the window
    assert loop.on_step(100, 2.0) is None
    nxt = loop.on_step(100, 3.0)                # baseline: 200 bytes in 2 s
    assert nxt is not None and loop.scores[Setting(1 << 20, 1.0, "ring")] == [100.0]
    assert loop.on_step(100, 100.0) is None     # warm-up (slow, mixed): ignored
    loop.on_step(100, 101.0)
    loop.on_step(100, 102.0)
    assert loop.scores[nxt] == [100.0]


def test_search_space_params_round_trip() -> None:
    space = SearchSpace(ALGS)
    assert space.params_of(Setting(1 << 20, 2.0, "ring")) == {
        "fusion_log2": 20, "cycle_time": 2.0, "algorithm": "ring"}
    assert space.params_of(Setting(1 << 20, 2.0, "auto")) is None
    assert space.params_of(Setting(0, 2.0, "ring")) is None
    assert space.params_of(Setting(1 << 20, 500.0, "ring")) is None


# ---- step detection ----------------------------------------------------------------------------
def _t(name: str, n: int = 4) -> tuple:
    return (name, (n,), "float32", 4 * n)


def test_step_detector_cuts_at_repeated_name() -> None:
    d = StepDetector()
    assert d.feed([_t("a"), _t("b")], 1.0) is None
    assert d.feed([_t("c", 8)], 2.0) is None
    step = d.feed([_t("a"), _t("b")], 3.0)
    assert step is not None and step.end == 2.0 and step.nbytes == 16 + 16 + 32
    assert [t[0] for t in step.tensors] == ["a", "b", "c"]
    assert d.feed([_t("c", 8)], 4.0) is None
    # the repeat in the middle of a bucket: the old step ended with this bucket
    step = d.feed([_t("x"), _t("a")], 5.0)
    assert step is not None and step.end == 5.0 and [t[0] for t in step.tensors] == \
        ["a", "b", "c", "x"]


def test_step_detector_generated_names() -> None:
    d = StepDetector()
    assert d.feed([_t("allreduce.noname.0")], 1.0) is None
    step = d.feed([_t("allreduce.noname.1")], 2.0)
    assert step is not None and step.tensors == (("allreduce.noname", (4,), "float32"),)


# ---- cache -------------------------------------------------------------------------------------
def test_fingerprint_key_changes_with_each_part() -> None:
    cl = cache.cluster_fingerprint([0, 0, 1, 1], "tcp:1000")
    assert cl == {"ranks": 4, "hosts": 2, "ranks_per_host": [2, 2], "interconnect": "tcp:1000"}
    model = cache.model_fingerprint([("b", (3,), "float32"), ("a", (2, 2), "float16")])
    assert model["tensors"] == [["a", [2, 2], "float16"], ["b", [3], "float32"]]
    key = cache.fingerprint_key(cache.fingerprint(cl, model, "0.1.0"))
    same = cache.fingerprint_key(cache.fingerprint(
        cache.cluster_fingerprint([0, 0, 1, 1], "tcp:1000"),
        cache.model_fingerprint([("a", (2, 2), "float16"), ("b", (3,), "float32")]), "0.1.0"))
    assert key == same and len(key) == 64
    others = [
        cache.fingerprint(cache.cluster_fingerprint([0, 0, 0, 1], "tcp:1000"), model, "0.1.0"),
        cache.fingerprint(cache.cluster_fingerprint([0, 0, 1, 1], "infiniband"), model, "0.1.0"),
        cache.fingerprint(cl, cache.model_fingerprint([("b", (4,), "float32"),
                                                       ("a", (2, 2), "float16")]), "0.1.0"),
        cache.fingerprint(cl, model, "0.2.0"),
    ]
    assert len({key, *(cache.fingerprint_key(o) for o in others)}) == 5


def test_cache_store_lookup_keeps_other_entries(tmp_path: Path, caplog) -> None:
    path = str(tmp_path / "sub" / "autotune.json")
    assert cache.lookup(path, "k1") is None
    cache.store(path, "k1", {"x": 1}, {"fusion_threshold": 1, "cycle_time": 2.0,
                                       "algorithm": "ring"}, 5.0, 100)
    cache.store(path, "k2", {"x": 2}, {"fusion_threshold": 3, "cycle_time": 4.0,
                                       "algorithm": "tree"}, 6.0, 200)
    assert cache.lookup(path, "k1")["setting"]["algorithm"] == "ring"
    assert cache.lookup(path, "k2")["steps"] == 200
    Path(path).write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="lightcc"):
        assert cache.lookup(path, "k1") is None
    assert "unreadable" in caplog.text


def test_default_cache_path(monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", "/x/cache")
    assert cache.default_cache_path() == "/x/cache/lightcc/autotune.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache.default_cache_path().endswith(".cache/lightcc/autotune.json")


def test_interconnect_guess(tmp_path: Path) -> None:
    assert cache.interconnect_guess(1, str(tmp_path)) == "shm"
    assert cache.interconnect_guess(2, str(tmp_path)) == "tcp:?"
    for dev, speed_ in (("lo", "99999"), ("eth0", "1000"), ("eth1", "25000"), ("bad", "x")):
        (tmp_path / "class" / "net" / dev).mkdir(parents=True)
        (tmp_path / "class" / "net" / dev / "speed").write_text(speed_)
    assert cache.interconnect_guess(2, str(tmp_path)) == "tcp:25000"
    (tmp_path / "class" / "infiniband" / "mlx5_0").mkdir(parents=True)
    assert cache.interconnect_guess(2, str(tmp_path)) == "infiniband"


# ---- engine glue (fake engine and clock) -------------------------------------------------------
@dataclass
class FakeEngine:
    """What the autotuner touches: listeners, settings, coordinator, topology, rank."""

    rank: int = 0
    fusion_threshold: int = 4096
    listeners: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.coordinator = SimpleNamespace(pending_settings={}, cycle_time=0.001)
        self.algorithm = "flat"
        self.topo = SimpleNamespace(node_of_rank=(0, 0, 1, 1), num_nodes=2)

    def apply_pending(self) -> None:
        s, self.coordinator.pending_settings = self.coordinator.pending_settings, {}
        if s:
            self.fusion_threshold = s["fusion_threshold"]
            self.algorithm = s["algorithm"]
            self.coordinator.cycle_time = s["cycle_time"] / 1000


def run_fake_training(eng: FakeEngine, steps: int, monkeypatch) -> None:
    """``steps`` steps of 10 tensors; each step lasts as long as ``speed`` says."""
    clock = [0.0]
    monkeypatch.setattr(autotune.time, "perf_counter", lambda: clock[0])
    resps = [Response(Request(Coll.ALLREDUCE, f"w{i}", "float32", (250_000,)))
             for i in range(10)]
    for _ in range(steps):
        eng.apply_pending()        # the next batch carries the settings
        cur = Setting(eng.fusion_threshold, eng.coordinator.cycle_time * 1000, eng.algorithm)
        for r in resps:
            clock[0] += STEP_BYTES / speed(cur) / len(resps)
            for listener in eng.listeners:
                listener("bucket_done", responses=[r], seconds=0.0)


def test_autotuner_tunes_caches_and_reuses(tmp_path: Path, monkeypatch, caplog) -> None:
    cache_path = str(tmp_path / "autotune.json")
    log_path = str(tmp_path / "samples.csv")
    eng = FakeEngine()
    with caplog.at_level(logging.INFO, logger="lightcc"):
        tuner = Autotuner(eng, "1", log_path, cache_path)
        assert "native" in tuner.space.algorithms      # MPI's own allreduce is a candidate
        run_fake_training(eng, 320, monkeypatch)
    assert tuner.state == "done" and tuner.finished.is_set()
    assert speed(tuner.loop.best) >= 0.95 * BEST
    assert tuner.applied == tuner.loop.best
    assert eng.fusion_threshold == tuner.loop.best.fusion_threshold
    assert "settled after" in caplog.text
    data = json.loads(Path(cache_path).read_text())
    entry = data["entries"][tuner.key]
    assert entry["setting"] == tuner.loop.best.as_settings()
    assert entry["fingerprint"]["cluster"]["ranks_per_host"] == [2, 2]
    assert len(entry["fingerprint"]["model"]["tensors"]) == 10
    assert Path(log_path).read_text().count("\n") == tuner.loop.samples + 1

    # second run, same fingerprint: the cached setting is applied after the first step
    caplog.clear()
    eng2 = FakeEngine()
    with caplog.at_level(logging.INFO, logger="lightcc"):
        t2 = Autotuner(eng2, "1", "", cache_path)
        run_fake_training(eng2, 3, monkeypatch)
    assert t2.state == "cached" and t2.loop is None
    assert eng2.fusion_threshold == tuner.loop.best.fusion_threshold
    assert eng2.algorithm == tuner.loop.best.algorithm
    assert sum("using the cached setting" in r.message for r in caplog.records) == 1

    # refresh: tunes again although the cache matches
    eng3 = FakeEngine()
    t3 = Autotuner(eng3, "refresh", "", cache_path)
    run_fake_training(eng3, 10, monkeypatch)
    assert t3.state == "tuning"
    t3.stop()
    assert t3.state == "stopped" and t3.on_event not in eng3.listeners


def test_start_only_on_rank_0(tmp_path: Path) -> None:
    cfg = SimpleNamespace(autotune="1", autotune_log="", autotune_cache=str(tmp_path / "c"))
    assert autotune.start(FakeEngine(rank=1), cfg) is None
    eng = FakeEngine()
    tuner = autotune.start(eng, cfg)
    assert tuner is autotune.active() and eng.listeners == [tuner.on_event]
    autotune.stop(eng)
    assert autotune.active() is None and eng.listeners == []
    assert autotune.start(eng, SimpleNamespace(autotune="0")) is None
