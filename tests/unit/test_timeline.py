"""Timeline: file format, truncation tolerance, bounded queue, nesting order, rank files."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from lightcc.common.observability import timeline
from lightcc.common.observability.timeline import Timeline
from lightcc.common.tracing import NULL


def _events(path: Path) -> list[dict]:
    return json.loads(path.read_text())


def test_spans_instants_and_metadata(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    tl = Timeline(str(path), rank=3)
    t0 = time.perf_counter()
    tl.span("w", "QUEUE", t0, t0 + 0.001)
    tl.span("w", "NEGOTIATE", t0 + 0.001, t0 + 0.003, bytes=40)
    tl.span("link:world", "ALLREDUCE", t0 + 0.004, t0 + 0.005, bytes_sent=12)
    tl.instant("engine", "CYCLE", t0 + 0.002, step=1)
    tl.close()
    tl.close()  # idempotent
    ev = _events(path)
    names = {e["tid"]: e["args"]["name"] for e in ev if e["name"] == "thread_name"}
    assert set(names.values()) == {"w", "link:world", "engine"}
    assert all(e["pid"] == 3 for e in ev)
    spans = [e for e in ev if e["ph"] == "X"]
    assert [(names[e["tid"]], e["name"]) for e in spans] == [
        ("w", "QUEUE"), ("w", "NEGOTIATE"), ("link:world", "ALLREDUCE")]
    assert spans[1]["dur"] == pytest.approx(2000, abs=1)        # microseconds
    assert spans[1]["ts"] - spans[0]["ts"] == pytest.approx(1000, abs=1)
    assert spans[1]["args"] == {"bytes": 40}
    cyc = [e for e in ev if e["name"] == "CYCLE"]
    assert len(cyc) == 1 and cyc[0]["ph"] == "i" and cyc[0]["args"] == {"step": 1}
    summary = [e for e in ev if e["name"] == "lightcc_summary"]
    assert summary[0]["args"] == {"written": 4, "dropped": 0}


def test_file_without_closing_bracket_is_recoverable(tmp_path: Path) -> None:
    """A process killed mid-run leaves '[' + events with trailing commas (viewers accept it)."""
    path = tmp_path / "t.json"
    tl = Timeline(str(path))
    t0 = time.perf_counter()
    tl.span("a", "QUEUE", t0, t0 + 1e-4)
    while "QUEUE" not in path.read_text():   # no deadline: pytest's timeout catches a hang
        time.sleep(0.01)
    text = path.read_text()
    assert text.startswith("[\n") and text.endswith(",\n")
    ev = json.loads(text.rstrip().rstrip(",") + "]")
    assert any(e["name"] == "QUEUE" for e in ev)
    tl.close()


def test_bounded_queue_drops_and_counts(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(timeline, "FLUSH_INTERVAL_S", 3600.0)   # writer never drains early
    path = tmp_path / "t.json"
    tl = Timeline(str(path), max_pending=5)
    t0 = time.perf_counter()
    for i in range(20):
        tl.span(f"x{i}", "QUEUE", t0, t0 + 1e-6)
    assert tl.dropped == 15
    tl.close()
    ev = _events(path)
    assert sum(e["ph"] == "X" for e in ev) == 5
    assert [e for e in ev if e["name"] == "lightcc_summary"][0]["args"]["dropped"] == 15


def test_parent_written_before_child_with_the_same_start(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    tl = Timeline(str(path))
    t0 = time.perf_counter()
    tl.span("a", "PACK", t0, t0 + 1e-3)           # emitted first, shorter
    tl.span("a", "EXECUTE", t0, t0 + 5e-3)        # same start, encloses PACK
    tl.close()
    order = [e["name"] for e in _events(path) if e["ph"] == "X"]
    assert order == ["EXECUTE", "PACK"]


def test_mark_cycles_false_drops_cycle_markers(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    tl = Timeline(str(path), mark_cycles=False)
    tl.instant("engine", "CYCLE", time.perf_counter())
    tl.instant("engine", "STALL", time.perf_counter())
    tl.close()
    names = [e["name"] for e in _events(path) if e["ph"] == "i"]
    assert names == ["STALL"]


class _FakeEngine:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.tracer = NULL

    def set_tracer(self, tracer) -> None:
        self.tracer = tracer


def test_start_stop_rank_files(tmp_path: Path) -> None:
    path = str(tmp_path / "t.json")
    e0, e1 = _FakeEngine(0), _FakeEngine(1)
    assert timeline.start(e0, path) is True
    assert e0.tracer is timeline.active() and e0.tracer.path == path
    timeline.stop(e0)
    assert e0.tracer is NULL and timeline.active() is None
    assert timeline.start(e1, path) is False and e1.tracer is NULL
    assert timeline.start(e1, path, all_ranks=True) is True
    assert e1.tracer.path == path + ".rank1"
    timeline.stop(e1)
    assert json.loads(Path(path + ".rank1").read_text())[0]["args"] == {"name": "rank 1"}
    with pytest.raises(ValueError):
        timeline.start(e0, "")


def test_training_steps_are_marked_only_while_a_timeline_is_written(tmp_path: Path) -> None:
    timeline.mark_step(1, 0.01)                      # nothing active: nothing happens
    path = str(tmp_path / "t.json")
    eng = _FakeEngine(0)
    timeline.start(eng, path)
    t0 = time.perf_counter()
    timeline.mark_step(1, 0.002)
    time.sleep(0.01)                                 # step 2 is longer than its wait
    timeline.mark_step(2, 0.001)
    t1 = time.perf_counter()
    timeline.stop(eng)
    ev = _events(Path(path))
    track = next(e["tid"] for e in ev if e["name"] == "thread_name" and
                 e["args"]["name"] == "step")
    marks = [(e["name"], e["args"]["step"], e) for e in ev if e.get("tid") == track
             and e["ph"] == "X"]
    assert [(n, s) for n, s, _ in marks] == [("SYNCHRONIZE", 1), ("STEP", 2), ("SYNCHRONIZE", 2)]
    sync1, step2, sync2 = (e for _, _, e in marks)
    assert sync1["dur"] == pytest.approx(2000, abs=1) and sync2["dur"] == pytest.approx(1000, abs=1)
    # step 2 runs from step 1's end to its own end, which is also its SYNCHRONIZE's end
    assert step2["ts"] == pytest.approx(sync1["ts"] + sync1["dur"], abs=0.01)
    assert step2["ts"] + step2["dur"] == pytest.approx(sync2["ts"] + sync2["dur"], abs=0.01)
    assert step2["dur"] <= (t1 - t0) * 1e6 + 1
