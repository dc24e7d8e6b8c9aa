"""Property-based tests (hypothesis) of the pure parts: negotiation with the response cache,
fusion planning, alltoall/allgather per-rank data, splits validation, config and fault-spec
parsing, message encoding."""
from __future__ import annotations

import math
import types

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from lightcc.common import api, config, dtypes
from lightcc.common.control.cache import ResponseCache
from lightcc.common.control.controller import Coordinator, validate
from lightcc.common.control.messages import Batch, Coll, RankMessage, Request, Response
from lightcc.common.exceptions import ConfigError, InvalidArgumentError
from lightcc.common.execution import fusion
from lightcc.common.observability import faults

FAST = settings(max_examples=60, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])
names = st.text(min_size=1, max_size=12)
DT = sorted(set(dtypes.SUPPORTED) - {"bool"})


# ---- negotiation: N simulated ranks, each with its own response cache --------------------
@st.composite
def rounds(draw):
    size = draw(st.integers(1, 4))
    pool = draw(st.lists(st.tuples(names, st.sampled_from(["float32", "int32"]),
                                   st.integers(0, 5)), min_size=1, max_size=6,
                         unique_by=lambda t: t[0]))
    steps = draw(st.lists(st.lists(st.sampled_from(range(len(pool))), min_size=1, max_size=4,
                                   unique=True), min_size=1, max_size=5))
    orders = [[draw(st.permutations(range(size))) for _ in steps]]
    return size, pool, steps, orders[0], draw(st.integers(0, 8))


@FAST
@given(rounds())
def test_every_submitted_tensor_gets_exactly_one_matching_response(case):
    """Ranks submit in any order, as cache ids when they can; rank 0 decodes them back to the
    exact requests, emits each key once, only when every rank submitted it."""
    size, pool, steps, orders, capacity = case
    coord = Coordinator(size, capacity, 0.0, 1 << 20, clock=lambda: 0.0)
    caches = [ResponseCache(capacity) for _ in range(size)]
    for step, order in zip(steps, orders):
        reqs = [Request(Coll.ALLREDUCE, pool[i][0], pool[i][1], (pool[i][2],), "sum")
                for i in step]
        emitted: list[Response] = []
        for j, rank in enumerate(order):
            msg = RankMessage()
            for req in reqs:
                cid = caches[rank].lookup(req)
                (msg.cached.append(cid) if cid >= 0 else msg.requests.append(req))
            coord.receive(rank, RankMessage.decode(msg.encode()))
            batch = coord.tick()
            if j < size - 1:       # (a batch may ask the control tree for detail: demote)
                assert batch is None or not batch.items, "a response before every rank submitted"
            if batch is not None:
                batch = Batch.decode(batch.encode())
                for item in batch.items:
                    resps = []
                    for cache in caches:      # every rank applies the batch alike
                        if isinstance(item, int):
                            resps.append(cache.get(item))
                        else:
                            cache.add(item, 0)
                            resps.append(item)
                    assert all(r == resps[0] for r in resps)
                    emitted.append(resps[0])
        assert sorted(r.request.name for r in emitted) == sorted(r.name for r in reqs)
        for r in emitted:
            assert not r.error and r.request in reqs
        assert not coord.pending


@FAST
@given(st.integers(2, 4), st.data())
def test_a_differing_rank_always_gives_one_error_naming_it(size, data):
    shapes = [(4,)] * size
    bad = data.draw(st.integers(0, size - 1))
    shapes[bad] = (data.draw(st.integers(5, 9)),)
    coord = Coordinator(size, 4, 0.0, 1 << 20, clock=lambda: 0.0)
    for rank in data.draw(st.permutations(range(size))):
        coord.receive(rank, RankMessage(requests=[Request(Coll.ALLREDUCE, "x", "float32",
                                                          shapes[rank], "sum")]))
    batch = coord.tick()
    assert len(batch.items) == 1 and batch.items[0].error_kind == "mismatch"
    other = 1 if bad == 0 else bad
    assert f"rank {other}" in batch.items[0].error


@FAST
@given(st.integers(1, 5), st.data())
def test_per_rank_data_reproduces_every_rank_request(size, data):
    """validate() collects allgather first dims / alltoall splits, and request_of(i) gives
    back rank i's exact request (what its cache lookup must match)."""
    rows = data.draw(st.lists(st.lists(st.integers(0, 6), min_size=size, max_size=size),
                              min_size=size, max_size=size))
    a2a = {r: Request(Coll.ALLTOALL, "t", "float32", (sum(rows[r]), 3), splits=tuple(rows[r]))
           for r in range(size)}
    ag = {r: Request(Coll.ALLGATHER, "g", "int64", (rows[r][0], 2)) for r in range(size)}
    for reqs in (a2a, ag):
        resp = validate(tuple(range(size)), reqs)
        assert not resp.error
        for r in range(size):
            assert resp.request_of(r) == reqs[r]


# ---- fusion planning ---------------------------------------------------------------------
responses = st.lists(st.builds(
    lambda coll, dt, n, op, comp, err: Response(
        Request(coll, "t", dt, (n,), op, compression=comp), error="e" if err else ""),
    st.sampled_from([Coll.ALLREDUCE] * 4 + [Coll.ALLGATHER, Coll.BROADCAST]),
    st.sampled_from(["float32", "float16", "int64"]), st.integers(0, 5000),
    st.sampled_from(["sum", "max"]), st.sampled_from(["none", "fp16"]),
    st.sampled_from([False] * 9 + [True])),
    max_size=40)


@settings(max_examples=200, deadline=None)
@given(responses, st.integers(0, 20000))
def test_fusion_plan_covers_everything_in_order_and_never_overfills(resps, threshold):
    buckets = fusion.plan(resps, threshold)
    flat = [i for b in buckets for i in b]
    assert sorted(flat) == list(range(len(resps)))                 # each exactly once
    assert buckets == fusion.plan(resps, threshold)                # deterministic
    for b in buckets:
        assert b == sorted(b)                                      # batch order kept
        keys = {fusion.fusion_key(resps[i]) for i in b}
        assert len(keys) == 1                                      # homogeneous
        if len(b) > 1:
            assert None not in keys
            assert sum(fusion.nbytes(resps[i]) for i in b) <= threshold   # split, never over
    for i, r in enumerate(resps):                                  # a big one is alone
        if fusion.fusion_key(r) is not None and fusion.nbytes(r) > threshold:
            assert [i] in buckets
    assert sum(math.prod(resps[i].request.shape) for b in buckets for i in b) == \
        sum(math.prod(r.request.shape) for r in resps)             # nothing truncated


# ---- alltoall splits validation (api, with a stub engine) ----------------------------------
class _StubEngine:
    def __init__(self, n: int) -> None:
        self.n = n
        self.size = n          # world size (broadcast checks root_rank against it)

    def pset(self, pid):
        return types.SimpleNamespace(ranks=tuple(range(self.n)))

    def auto_name(self, coll, pset=0):
        return "auto"

    def submit(self, req, arr=None, out=None, wake=True, stream=None, label=None):
        return req


@FAST
@given(st.integers(1, 5), st.integers(0, 12), st.lists(st.integers(-3, 12), max_size=7))
def test_alltoall_splits_accepted_iff_valid(n, rows, splits):
    import numpy as np

    saved, api.state._engine = api.state._engine, _StubEngine(n)
    try:
        valid = len(splits) == n and all(s >= 0 for s in splits) and sum(splits) == rows
        try:
            req = api.alltoall_async(np.zeros((rows, 2)), splits=splits, name="s")
        except InvalidArgumentError as exc:
            assert not valid, f"valid splits {splits} rejected: {exc}"
        else:
            assert valid, f"invalid splits {splits} for {rows} rows on {n} ranks accepted"
            assert req.splits == tuple(splits)
    finally:
        api.state._engine = saved


@FAST
@given(st.integers(1, 5), st.one_of(st.integers(-10, 10), st.floats(allow_nan=True),
                                    st.text(max_size=3), st.none()))
def test_broadcast_root_validation(n, root):
    import numpy as np

    saved, api.state._engine = api.state._engine, _StubEngine(n)
    try:
        ok = isinstance(root, int) and 0 <= root < n
        try:
            req = api.broadcast_async(np.zeros(3), root, name="b")
        except InvalidArgumentError:
            assert not ok
        else:
            assert ok and req.root == root
    finally:
        api.state._engine = saved


@FAST
@given(st.integers(2, 6), st.data())
def test_broadcast_root_is_a_global_rank_of_the_process_set(n, data):
    """Horovod's convention: root_rank names a global rank; the request carries its position
    in the set; a root outside the set is refused before anything is submitted."""
    import numpy as np

    members = tuple(sorted(data.draw(st.sets(st.integers(0, n - 1), min_size=1))))
    root = data.draw(st.integers(-1, n))
    stub = _StubEngine(n)
    stub.pset = lambda pid: types.SimpleNamespace(ranks=members)
    saved, api.state._engine = api.state._engine, stub
    try:
        try:
            req = api.broadcast_async(np.zeros(3), root, name="b", process_set=1)
        except InvalidArgumentError as exc:
            assert root not in members, exc
        else:
            assert root in members and req.root == members.index(root)
    finally:
        api.state._engine = saved


# ---- parsing --------------------------------------------------------------------------------
@settings(max_examples=150, deadline=None)
@given(st.sampled_from(config.KNOBS), st.text(max_size=12))
def test_config_values_parse_or_raise_config_error(knob, text):
    try:
        cfg = config.load(environ={knob.env: text})
    except ConfigError as exc:
        assert knob.env in str(exc)
    else:
        value = getattr(cfg, knob.field)
        assert knob.check(value) is None


@settings(max_examples=150, deadline=None)
@given(st.text(alphabet="abcdegiklmnoprst*:;+0123 ", max_size=30))
def test_fault_specs_parse_or_raise_config_error(text):
    try:
        specs = faults.parse(text)
    except ConfigError as exc:
        assert faults.ENV in str(exc)
    else:
        for s in specs:
            assert s.site in faults.SITES and s.mode in faults.MODES and s.substring


@FAST
@given(st.text(max_size=3000), st.lists(st.integers(0, 1 << 40), max_size=4),
       st.sampled_from(DT))
def test_messages_round_trip_any_name(name, shape, dt):
    req = Request(Coll.ALLREDUCE, name, dt, tuple(shape), "sum")
    assert RankMessage.decode(RankMessage(requests=[req], cached=[3]).encode()).requests == [req]
    b = Batch(items=[Response(req), 5], joined=(1,))
    back = Batch.decode(b.encode())
    assert back.items == b.items and back.joined == (1,)


def test_fault_spec_matching():
    (spec,) = faults.parse("backend:grad:1+2")
    assert spec.matches("backend", ["x.grad"], 1, "end")
    assert not spec.matches("backend", ["x.grad"], 0, "end")
    assert not spec.matches("compressor", ["x.grad"], 1, "end")
    assert not spec.matches("backend", ["x.grad"], 1, "early")
    with pytest.raises(ConfigError):
        faults.parse("disk:x")
