"""Merging the ranks' timeline files into one and the per-rank table, on hand-written files
(the real job is tests/parallel/test_launcher_watch.py)."""
from __future__ import annotations

import json

import pytest

from lightcc.common.observability import timeline_merge as tm


def _write(path, events, closed=True):
    lines = ["["] + [json.dumps(e) + "," for e in events]
    if closed:
        lines.append("]")
    path.write_text("\n".join(lines) + "\n")


def _meta(pid, tid, name):
    return {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}


def _x(pid, tid, name, ts, dur):
    return {"name": name, "ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur}


def test_merge_puts_every_rank_in_one_file_and_reads_a_cut_file(tmp_path):
    f = tmp_path / "t.json"
    _write(f, [_meta(0, 1, "g0"), _x(0, 1, "NEGOTIATE", 0, 1000)])
    _write(tmp_path / "t.json.rank1", [_meta(1, 1, "g0"), _x(1, 1, "NEGOTIATE", 0, 500)],
           closed=False)
    (tmp_path / "t.json.rank1").write_text((tmp_path / "t.json.rank1").read_text() + '{"cut')
    done = tm.merge(str(f))
    assert done == {"ranks": 2, "events": 4, "dropped": 0}
    events = json.loads(f.read_text())             # one valid JSON array
    assert sorted({e["pid"] for e in events}) == [0, 1]
    assert not (tmp_path / "t.json.rank1").exists()


def test_merge_caps_the_events_and_says_how_many_were_left_out(tmp_path):
    f = tmp_path / "t.json"
    _write(f, [_meta(0, 1, "g")] + [_x(0, 1, "PACK", i, 1) for i in range(10)])
    _write(tmp_path / "t.json.rank1", [_meta(1, 1, "g")] + [_x(1, 1, "PACK", i, 1)
                                                             for i in range(10)])
    done = tm.merge(str(f), max_events=8)           # 4 per rank: metadata + 3 earliest
    assert done["dropped"] == 14
    events = json.loads(f.read_text())
    assert [e["ts"] for e in events if e["ph"] == "X" and e["pid"] == 1] == [0, 1, 2]
    assert events[-1]["name"] == "lightcc_merge"
    assert events[-1]["args"]["dropped_events"] == 14


def test_summary_counts_the_union_of_spans_per_rank():
    events = [_meta(0, 1, "a"), _meta(0, 2, "b"), _meta(0, 3, "link:world"),
              _x(0, 1, "NEGOTIATE", 0, 1000), _x(0, 2, "NEGOTIATE", 500, 1000),   # union 1.5 ms
              _x(0, 1, "ALLREDUCE", 2000, 3000), _x(0, 3, "ALLREDUCE", 2000, 9000),  # link: no
              _x(0, 1, "PACK", 1500, 500), _x(0, 1, "UNPACK", 5000, 250),
              _x(1, 1, "NEGOTIATE", 100, 200)]
    rows = tm.summary(events)
    assert rows[0] == {"rank": 0, "collectives": 2, "negotiate_ms": pytest.approx(1.5),
                       "wire_ms": pytest.approx(3.0), "pack_ms": pytest.approx(0.75),
                       "span_ms": pytest.approx(11.0)}
    assert rows[1]["rank"] == 1 and rows[1]["negotiate_ms"] == pytest.approx(0.2)
    lines = tm.table(rows)
    assert lines[0].split()[0] == "rank" and lines[1].split()[:3] == ["0", "2", "1.5"]


def _mark(pid, name, step, ts, dur):
    return {"name": name, "ph": "X", "pid": pid, "tid": 9, "ts": ts, "dur": dur,
            "args": {"step": step}}


def _two_steps():
    """Two ranks, steps 1-3 marked (step 1 has no STEP span: no start); values worked out by
    hand in test_steps_per_training_step."""
    ev = [_meta(r, t, n) for r in (0, 1) for t, n in ((1, "g0"), (2, "g1"), (3, "link:world"),
                                                      (9, "step"))]
    ev += [_mark(0, "SYNCHRONIZE", 1, 0, 1000),
           _mark(0, "STEP", 2, 1000, 9000), _mark(0, "SYNCHRONIZE", 2, 7000, 3000),
           _mark(0, "STEP", 3, 10000, 10000), _mark(0, "SYNCHRONIZE", 3, 16000, 4000),
           _x(0, 1, "QUEUE", 3000, 100), _x(0, 2, "QUEUE", 3500, 100),
           _x(0, 1, "QUEUE", 12000, 100),
           _x(0, 1, "NEGOTIATE", 3100, 1000), _x(0, 2, "NEGOTIATE", 3500, 1500),
           _x(0, 1, "NEGOTIATE", 9500, 1500),               # crosses into step 3
           _x(0, 1, "ALLREDUCE", 5000, 3000), _x(0, 3, "ALLREDUCE", 5000, 3000),   # link: no
           _x(0, 1, "ALLREDUCE", 16500, 1000)]
    ev += [_mark(1, "SYNCHRONIZE", 1, 0, 1200),
           _mark(1, "STEP", 2, 1200, 9300), _mark(1, "SYNCHRONIZE", 2, 9000, 1500),
           _mark(1, "STEP", 3, 10500, 8500), _mark(1, "SYNCHRONIZE", 3, 18000, 1000),
           _x(1, 1, "QUEUE", 2000, 100), _x(1, 1, "QUEUE", 11000, 100),
           _x(1, 1, "QUEUE", 18500, 100),                   # inside step(): not backward
           _x(1, 1, "NEGOTIATE", 8000, 500), _x(1, 1, "NEGOTIATE", 12000, 200),
           _x(1, 1, "ALLREDUCE", 8500, 1000), _x(1, 2, "ALLREDUCE", 13000, 2000)]
    return ev


def test_steps_per_training_step():
    rows = tm.steps(_two_steps())
    approx = pytest.approx
    assert rows == [
        # step 2: rank 0 window 1-10 ms, first gradient 3, step() 7; rank 1 1.2-10.5, 2, 9
        {"step": 2, "ranks": 2, "step_ms": approx(9.3), "to_grad_ms": approx(2.0),
         "backward_ms": approx(7.0), "negotiate_min_ms": approx(0.5), "negotiate_min_rank": 1,
         "negotiate_max_ms": approx(2.4), "negotiate_max_rank": 0,    # 3.1-5.0 + 9.5-10.0
         "wire_ms": approx(3.0), "exposed_ms": approx(3.0),
         "overlap_pct": approx(100 * (2.0 + 0.5) / (3.0 + 1.0))},
        # step 3: rank 0 10-20 ms, 12, 16; rank 1 10.5-19, 11, 18
        {"step": 3, "ranks": 2, "step_ms": approx(10.0), "to_grad_ms": approx(2.0),
         "backward_ms": approx(7.0), "negotiate_min_ms": approx(0.2), "negotiate_min_rank": 1,
         "negotiate_max_ms": approx(1.0), "negotiate_max_rank": 0,    # 10.0-11.0 of 9.5-11.0
         "wire_ms": approx(2.0), "exposed_ms": approx(4.0),
         "overlap_pct": approx(100 * (0.0 + 2.0) / (1.0 + 2.0))}]


def test_steps_cut_by_the_cap_are_left_out_and_unmarked_runs_have_none():
    ev = _two_steps() + [{"name": "lightcc_merge", "ph": "i", "pid": 0, "tid": 0, "ts": 0,
                          "args": {"dropped_events": 5, "complete_until_ts": 15000}}]
    assert [r["step"] for r in tm.steps(ev)] == [2]
    assert tm.steps([e for e in _two_steps() if e.get("tid") != 9]) == []


def test_merge_records_until_when_every_rank_is_complete(tmp_path):
    f = tmp_path / "t.json"
    _write(f, [_meta(0, 1, "g")] + [_x(0, 1, "PACK", 10 * i, 1) for i in range(10)])
    _write(tmp_path / "t.json.rank1", [_meta(1, 1, "g")] + [_x(1, 1, "PACK", 5 * i, 1)
                                                             for i in range(10)])
    tm.merge(str(f), max_events=10)                 # 4 spans per rank kept
    last = json.loads(f.read_text())[-1]
    assert last["args"]["complete_until_ts"] == 20  # rank 1's first left out: ts 5 x 4


def test_step_table_shows_the_first_and_last_steps_of_a_long_run():
    row = {"step": 0, "ranks": 2, "step_ms": 10.0, "to_grad_ms": None, "backward_ms": None,
           "negotiate_min_ms": 0.5, "negotiate_min_rank": 1, "negotiate_max_ms": 2.0,
           "negotiate_max_rank": 0, "wire_ms": 3.0, "exposed_ms": 1.25, "overlap_pct": None}
    lines = tm.step_table([dict(row, step=s) for s in range(2, 30)], shown=3)
    assert [ln.split()[0] for ln in lines] == ["step", "2", "3", "4", "...", "27", "28", "29"]
    assert lines[4].startswith("... 22 steps left out")
    assert lines[1].split() == ["2", "10.0", "-", "-", "0.5", "(rank", "1)", "/", "2.0",
                                "(rank", "0)", "3.0", "1.2", "-"]
    assert len(tm.step_table([dict(row, step=s) for s in range(2, 8)], shown=3)) == 7
