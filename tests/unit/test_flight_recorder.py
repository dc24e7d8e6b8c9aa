"""Flight recorder units: the ring buffer and its file (observability/flight.py) and lccrun's
summary (runner/flight_summary.py) on hand-written records. The end-to-end jobs are in
tests/parallel/test_flight_recorder.py."""
from __future__ import annotations

import json
import threading

from lightcc.common.control.messages import Coll, Request
from lightcc.common.exceptions import StallError
from lightcc.common.handle import Handle
from lightcc.common.observability.flight import FlightRecorder
from lightcc.runner.flight_summary import read_records, summarize


def _handle(name: str, shape=(4,), dtype="float32") -> Handle:
    return Handle(Request(Coll.ALLREDUCE, name, dtype, shape))


def test_ring_keeps_the_last_n_with_their_state(tmp_path):
    rec = FlightRecorder(rank=1, size=2, capacity=3, directory=str(tmp_path))
    handles = [_handle(f"t{i}") for i in range(5)]
    for h in handles:
        rec.record(h, 0.0)
    handles[2]._set(result=1)
    handles[3]._set(error=RuntimeError("boom"))
    rows = rec.snapshot()
    assert [r["name"] for r in rows] == ["t2", "t3", "t4"]
    assert [r["state"] for r in rows] == ["done", "error", "pending"]
    assert rows[0]["finished"] is not None and rows[2]["finished"] is None
    assert rows[2]["shape"] == [4] and rows[2]["dtype"] == "float32"
    assert rows[2]["thread"] == threading.get_ident()
    path = rec.dump("test")
    with open(path) as f:
        doc = json.load(f)
    assert doc["rank"] == 1 and doc["reason"] == "test" and len(doc["records"]) == 3
    assert str(threading.get_ident()) in doc["threads"]
    assert any("test_ring_keeps" in line for line in doc["threads"][str(threading.get_ident())]
               ["stack"])


def test_a_stall_error_writes_the_record_once_and_keeps_it(tmp_path):
    rec = FlightRecorder(rank=0, size=2, capacity=8, directory=str(tmp_path))
    h = _handle("stuck")
    rec.record(h, 0.0)
    h._set(error=StallError("stalled"))
    doc = json.loads((tmp_path / "rank0.json").read_text())
    assert doc["reason"].startswith("StallError") and doc["records"][0]["state"] == "stalled"
    rec.dump("SIGUSR1")                          # a later request does not replace it
    assert json.loads((tmp_path / "rank0.json").read_text())["reason"].startswith("StallError")


def test_records_do_not_keep_results_alive(tmp_path):
    """A finished collective's result (a gradient) is freed as soon as the caller drops it: the
    ring keeping handles kept ~40 steps of a model's gradients alive, and every step's new
    gradients were faulted into fresh memory (docs/benchmarks.md, issue 42)."""
    import gc
    import weakref

    import numpy as np

    for directory in ("", str(tmp_path)):
        rec = FlightRecorder(rank=0, size=2, capacity=8, directory=directory)
        h = _handle("g")
        rec.record(h, 0.0)
        result = np.ones(16, np.float32)
        h._set(result=result)
        alive = weakref.ref(result)
        del result, h
        gc.collect()
        assert alive() is None
        assert rec.snapshot()[0]["state"] == "done"


def test_no_directory_records_but_never_writes(tmp_path):
    rec = FlightRecorder(rank=0, size=1, capacity=2, directory="")
    rec.record(_handle("a"), 0.0)
    assert rec.dump("x") is None and len(rec.snapshot()) == 1


def _doc(rank, size, records, reason="SIGUSR1", submitted=0.0):
    rows = [{"seq": i, "coll": "allreduce", "name": n, "dtype": "float32", "shape": [2],
             "pset": 0, "state": s, "error": None, "thread": 1, "submitted": submitted,
             "finished": None, "age_s": 1.0} for i, (n, s) in enumerate(records)]
    return {"rank": rank, "size": size, "reason": reason, "records": rows, "threads": {}}


def test_summary_names_the_rank_missing_from_the_collective_others_wait_in():
    docs = {0: _doc(0, 3, [("a", "done"), ("b", "pending")]),
            1: _doc(1, 3, [("a", "done")]),
            2: _doc(2, 3, [("a", "done"), ("b", "pending")])}
    text = "\n".join(summarize(docs))
    assert "rank 1 is behind: never reached allreduce 'b' (float32 2), which rank(s) 0, 2" \
        in text, text


def test_summary_blames_a_silent_rank_and_says_when_nobody_is_missing():
    docs = {0: _doc(0, 2, [("b", "stalled")])}
    text = "\n".join(summarize(docs))
    assert "rank(s) 1: no record" in text and "rank 1 is behind" in text, text
    docs = {0: _doc(0, 2, [("b", "pending")]), 1: _doc(1, 2, [("b", "pending")])}
    text = "\n".join(summarize(docs))
    assert "is behind" not in text and "data plane" in text, text
    assert summarize({}) == []


def test_summary_names_a_rank_that_reached_the_collective_long_after_the_others():
    """A rank stopped (SIGSTOP) and resumed by the launcher's teardown submits the collective
    after the others gave up on it: every rank has it, but the summary names the late one."""
    docs = {0: _doc(0, 3, [("b", "stalled")], submitted=100.0),
            1: _doc(1, 3, [("b", "stalled")], submitted=100.2),
            2: _doc(2, 3, [("b", "pending")], submitted=104.9)}
    text = "\n".join(summarize(docs))
    assert "rank 2 was late: reached allreduce 'b' (float32 2) 4.9 s after rank 0" in text, text
    assert "data plane" not in text, text
    docs[2] = _doc(2, 3, [("b", "pending")], submitted=100.4)      # within LATE_S: nobody
    text = "\n".join(summarize(docs))
    assert "late" not in text and "data plane" in text, text


def test_read_records_skips_broken_files(tmp_path):
    (tmp_path / "rank0.json").write_text(json.dumps(_doc(0, 2, [])))
    (tmp_path / "rank1.json").write_text("{half")
    (tmp_path / "rank1.json.tmp5").write_text("{}")
    assert list(read_records(str(tmp_path))) == [0]


def test_sigusr1_writes_the_record_and_still_calls_the_programs_own_handler(tmp_path):
    """The recorder chains onto a handler the program installed before init(), and a second
    recorder (init after shutdown) does not chain onto the first one's handler."""
    import faulthandler
    import os
    import signal
    import time

    calls = []
    saved = signal.signal(signal.SIGUSR1, lambda s, f: calls.append(s))
    try:
        for n, sub in enumerate(("one", "two"), 1):
            rec = FlightRecorder(rank=0, size=1, capacity=4, directory=str(tmp_path / sub))
            rec.install_signal()
            rec.record(_handle(f"h{n}"), 0.0)
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.05)                     # the handler runs between bytecodes
            doc = json.loads((tmp_path / sub / "rank0.json").read_text())
            assert doc["reason"] == "SIGUSR1" and doc["records"][0]["name"] == f"h{n}"
            assert calls == [signal.SIGUSR1] * n, calls
            if n == 1:
                first = (tmp_path / "one" / "rank0.json").read_text()
        assert (tmp_path / "one" / "rank0.json").read_text() == first   # not dumped again
    finally:
        faulthandler.unregister(signal.SIGUSR1)
        signal.signal(signal.SIGUSR1, saved)


def test_user_code_in_a_folder_named_lightcc_is_not_taken_for_the_library():
    """The waiting stack stops at the user's innermost frame; a checkout or project folder
    called ``lightcc`` holds user code (the summary showed no user frame from such a clone)."""
    import os

    import lightcc
    from lightcc.runner import flight_summary

    own = os.path.join(os.path.dirname(lightcc.__file__), "common", "engine.py")
    assert flight_summary._library(f'  File "{own}", line 3, in wait\n')
    assert flight_summary._library('  File "/v/lib/python3.11/site-packages/lightcc/x.py", '
                                   'line 1, in f\n')
    assert not flight_summary._library('  File "/home/u/lightcc/tests/train.py", line 9, in '
                                       'wait_for_peers\n')
