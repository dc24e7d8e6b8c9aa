"""The metrics listener as pure logic: bucket events in, counters out, each expectation worked
out by hand (the real engine's events are tests/parallel/test_metrics.py)."""
from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from lightcc.common.control.messages import Coll
from lightcc.common.observability import metrics as M


def _resp(nbytes: int, coll: Coll = Coll.ALLREDUCE):
    return NS(request=NS(nbytes=nbytes, coll=coll))


class _HalfCompressor:
    """Sends half the bytes of a float32 ring allreduce (an fp16-like wire model)."""

    def wire_bytes(self, numel: int, nranks: int) -> int:
        return (nranks - 1) * numel * 4 // nranks


def test_buckets_collectives_fusion_payload_and_waits():
    m = M.Metrics()
    entries = [NS(submitted_at=1.0, sent_at=1.5), None, NS(submitted_at=2.0, sent_at=2.25)]
    m.on_event("bucket_start", responses=[], entries=entries, start=3.0)
    m.on_event("bucket_done", responses=[_resp(400), _resp(800), _resp(4000)], seconds=0.25,
               plan=NS(compressor=None), nranks=2)
    m.on_event("bucket_done", responses=[_resp(64, Coll.BROADCAST)], seconds=0.5, plan=None,
               nranks=2)
    m.on_event("bucket_error", responses=[_resp(4)], kind="stall")
    m.on_event("bucket_error", responses=[_resp(4)], kind="mismatch")
    assert m.counts == {"collectives": 4, "buckets": 2, "fused_buckets": 1,
                        "payload_bytes": 5264, "stalls": 1, "errors": 1}
    assert m.by_type == {"allreduce": 3, "broadcast": 1}
    assert m.queue_s == pytest.approx(0.5 + 0.25)
    assert m.negotiate_s == pytest.approx(1.5 + 0.75)
    assert m.execute_s == pytest.approx(0.75)


def test_compression_ratio_from_the_compressors_wire_model():
    m = M.Metrics()
    # 4 ranks: a float32 ring sends 2*3/4 of 4000 bytes = 6000; the half model 3000
    m.on_event("bucket_done", responses=[_resp(4000)], seconds=0.0,
               plan=NS(compressor=_HalfCompressor()), nranks=4)
    assert (m.wire_plain, m.wire_model) == (6000, 3000)
    m.on_event("bucket_done", responses=[_resp(6000)], seconds=0.0, plan=NS(compressor=None),
               nranks=4)                                   # uncompressed: same on both sides
    assert (m.wire_plain, m.wire_model) == (12000, 9000)


class _Engine:
    def __init__(self):
        self.listeners = []


def test_collect_builds_the_dict_and_flatten_names_scalars():
    eng = _Engine()
    m = M.attach(eng)
    assert M.attach(eng) is m and eng.listeners == [m.on_event]     # once per engine
    m.on_event("bucket_done", responses=[_resp(4000)], seconds=0.0,
               plan=NS(compressor=_HalfCompressor()), nranks=2)
    wire = {"world": {"bytes_sent": 10, "bytes_received": 12, "calls": {"x": 1}},
            "bytes_sent": 10, "bytes_received": 12}
    out = M.collect(eng, wire)
    assert out["compression_ratio"] == pytest.approx(2.0)
    assert out["wire"] == {"world": {"bytes_sent": 10, "bytes_received": 12}}
    assert out["bytes_sent"] == 10 and out["collectives"] == 1
    flat = M.flatten(out)
    assert flat["lightcc/wire/world/bytes_sent"] == 10.0
    assert flat["lightcc/collectives_by_type/allreduce"] == 1.0
    assert all(isinstance(v, float) for v in flat.values())


def test_metrics_writer_writes_every_scalar_and_refuses_a_non_writer(monkeypatch):
    pytest.importorskip("torch")
    import importlib

    mw = importlib.import_module("lightcc.torch.metrics_writer")

    monkeypatch.setattr(mw, "metrics", lambda: {"a": 1, "b": {"c": 2.5}, "s": "text"})
    seen = []
    writer = NS(add_scalar=lambda tag, value, step: seen.append((tag, value, step)))
    log = mw.metrics_writer(writer, every=2)
    assert log() == {"lightcc/a": 1.0, "lightcc/b/c": 2.5}
    assert log() == {}                                     # every=2: the second call skips
    log(7)
    assert seen == [("lightcc/a", 1.0, 0), ("lightcc/b/c", 2.5, 0), ("lightcc/a", 1.0, 7),
                    ("lightcc/b/c", 2.5, 7)]
    with pytest.raises(TypeError, match="add_scalar"):
        mw.metrics_writer(object())
