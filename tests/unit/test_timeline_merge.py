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
