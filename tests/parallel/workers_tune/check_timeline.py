"""Worker: LCC_TIMELINE on every collective type; rank 0 checks its trace file.

argv: timeline path. Also checks start_timeline/stop_timeline to a second file mid-run.
"""
import collections
import json
import sys

import numpy as np

import lightcc as lcc

path = sys.argv[1]
lcc.init()
r, n = lcc.rank(), lcc.size()
names = []
for step in range(3):
    hs = [lcc.allreduce_async(np.full(k, r, np.float32), name=f"grad.{k}")
          for k in (1, 7, 300, 5000, 200_000)]
    names = [f"grad.{k}" for k in (1, 7, 300, 5000, 200_000)]
    for h in hs:
        out = lcc.synchronize(h)
        assert np.allclose(out, (n - 1) / 2), out[:3]
lcc.allgather(np.ones((2, 3)), name="gathered")
lcc.broadcast(np.arange(4.0), 0, name="bcast")
lcc.allreduce(np.ones(3), name=None)            # the direct path: its own track
lcc.allreduce(np.ones(20_000), name=None)       # over LCC_DIRECT_BYTES: the engine, generated name
lcc.barrier()
second = path + ".second"
lcc.start_timeline(second)
lcc.allreduce(np.ones(10), name="only_in_second")
lcc.stop_timeline()
lcc.allreduce(np.ones(10), name="after_stop")
lcc.shutdown()

if r == 0:
    def load(p):
        ev = json.load(open(p))
        tracks = {e["tid"]: e["args"]["name"] for e in ev if e["name"] == "thread_name"}
        return ev, tracks

    ev, tracks = load(path)
    by_track = collections.defaultdict(list)
    for e in ev:
        if e["ph"] in "Xi":
            assert e["pid"] == 0 and e["tid"] in tracks, e
            by_track[tracks[e["tid"]]].append(e)
    for nm in names + ["gathered", "bcast", "allreduce.noname.0"]:
        phases = {e["name"] for e in by_track[nm]}
        assert {"QUEUE", "NEGOTIATE"} <= phases, (nm, phases)
        assert phases & {"EXECUTE", "ALLGATHER", "BROADCAST"}, (nm, phases)
    assert sum(e["name"] == "EXECUTE" for e in by_track["grad.5000"]) == 3
    direct = [e for e in by_track["allreduce.direct"] if e["name"] == "DIRECT_ALLREDUCE"]
    assert len(direct) == 1 and direct[0]["args"]["bytes"] == 24, by_track["allreduce.direct"]
    assert "only_in_second" not in by_track and "after_stop" not in by_track
    # the fused bucket shows PACK / ALLREDUCE / UNPACK with bytes
    buckets = [t for t in by_track if t.startswith("bucket[")]
    assert buckets, list(by_track)
    ar = [e for t in buckets for e in by_track[t] if e["name"].endswith("ALLREDUCE")]
    assert ar and all(e["args"]["bytes"] > 0 and e["args"]["algorithm"] for e in ar)
    assert any(t.startswith("link:") for t in by_track), list(by_track)
    assert any(e["name"] == "CYCLE" for e in by_track["engine"])
    # per track: slices nest (each starts after the enclosing one ends, or lies inside it)
    for track, events in by_track.items():
        spans = sorted((e for e in events if e["ph"] == "X"), key=lambda e: (e["ts"], -e["dur"]))
        stack = []
        for e in spans:
            assert e["dur"] >= 0, e
            end = e["ts"] + e["dur"]
            while stack and e["ts"] >= stack[-1] - 2e-3:      # microseconds
                stack.pop()
            if stack:
                assert end <= stack[-1] + 2e-3, (track, e, stack)
            stack.append(end)
        # QUEUE -> NEGOTIATE -> EXECUTE in time for every tensor round
        order = [e["name"] for e in spans if e["name"] in ("QUEUE", "NEGOTIATE", "EXECUTE")]
        if track.startswith("grad."):
            assert order == ["QUEUE", "NEGOTIATE", "EXECUTE"] * 3, (track, order)
    ev2, tracks2 = load(second)
    assert "only_in_second" in tracks2.values() and "grad.1" not in tracks2.values()
    assert ev2[-1]["name"] == "lightcc_summary" and ev2[-1]["args"]["dropped"] == 0
print(f"OK rank {r} of {n}", flush=True)
