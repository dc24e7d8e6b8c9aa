"""Negotiation logic (Coordinator, validate, cache) without MPI."""
from __future__ import annotations

import pytest

from lightcc.common.control.cache import ResponseCache
from lightcc.common.control.controller import Coordinator, validate
from lightcc.common.control.messages import Batch, Coll, RankMessage, Request, Response


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def ar(name: str, shape=(4,), dtype="float32", op="sum", **kw) -> Request:
    return Request(Coll.ALLREDUCE, name, dtype, tuple(shape), op, **kw)


def make(size=2, cycle=0.0, threshold=1 << 20, stall=60.0, stall_shutdown=0.0, capacity=16):
    clock = Clock()
    coord = Coordinator(size, capacity, cycle, threshold, stall, stall_shutdown, clock=clock)
    return coord, clock


def submit(coord, rank, *reqs, cached=()):
    coord.receive(rank, RankMessage(cached=list(cached), requests=list(reqs)))


def test_ready_only_when_every_rank_submitted():
    coord, _ = make(size=3)
    submit(coord, 0, ar("a"))
    submit(coord, 1, ar("a"))
    assert coord.tick() is None
    submit(coord, 2, ar("a"))
    batch = coord.tick()
    assert [r.request.name for r in batch.items] == ["a"]
    assert not coord.pending


def test_order_follows_readiness_not_submission():
    coord, clock = make()
    submit(coord, 0, ar("a"), ar("b"))
    submit(coord, 1, ar("b"))
    clock.t = 1.0
    batch = coord.tick()
    assert [r.request.name for r in batch.items] == ["b"]
    submit(coord, 1, ar("a"))
    assert [r.request.name for r in coord.tick().items] == ["a"]


@pytest.mark.parametrize("field,value,text", [
    ("shape", (5,), "rank 1 has shape (5,), rank 0 has (4,)"),
    ("dtype", "float64", "rank 1 has dtype float64, rank 0 has float32"),
    ("op", "max", "rank 1 has op max, rank 0 has sum"),
    ("prescale", 2.0, "rank 1 has prescale factor 2.0, rank 0 has 1.0"),
    ("postscale", 0.5, "rank 1 has postscale factor 0.5, rank 0 has 1.0"),
    ("compression", "fp16", "rank 1 has compression fp16, rank 0 has none"),
    ("priority", 3, "rank 1 has priority 3, rank 0 has 0"),
])
def test_mismatch_errors_name_tensor_ranks_and_difference(field, value, text):
    coord, _ = make()
    submit(coord, 0, ar("fc1.weight"))
    kwargs = {"shape": (4,), "dtype": "float32", "op": "sum"}
    if field in kwargs:
        kwargs[field] = value
        bad = ar("fc1.weight", **kwargs)
    else:
        bad = ar("fc1.weight", **{field: value})
    submit(coord, 1, bad)
    batch = coord.tick()
    (resp,) = batch.items
    assert resp.error_kind == "mismatch"
    assert "allreduce 'fc1.weight'" in resp.error and text in resp.error


def test_broadcast_root_mismatch():
    coord, _ = make()
    submit(coord, 0, Request(Coll.BROADCAST, "w", "float32", (3,), root=0))
    submit(coord, 1, Request(Coll.BROADCAST, "w", "float32", (3,), root=1))
    (resp,) = coord.tick().items
    assert "root rank 1" in resp.error


def test_allgather_first_dim_may_differ_but_rest_must_match():
    coord, _ = make()
    submit(coord, 0, Request(Coll.ALLGATHER, "g", "int32", (2, 3)))
    submit(coord, 1, Request(Coll.ALLGATHER, "g", "int32", (5, 3)))
    (resp,) = coord.tick().items
    assert not resp.error and resp.per_rank == (2, 5)
    submit(coord, 0, Request(Coll.ALLGATHER, "h", "int32", (2, 3)))
    submit(coord, 1, Request(Coll.ALLGATHER, "h", "int32", (2, 4)))
    (resp,) = coord.tick().items
    assert "shape after the first dimension" in resp.error


def test_collective_type_mismatch_for_same_name():
    coord, _ = make()
    submit(coord, 0, ar("x"))
    submit(coord, 1, Request(Coll.ALLGATHER, "x", "float32", (4,)))
    batch = coord.tick()
    assert len(batch.items) == 2
    assert all("collective type differs" in r.error for r in batch.items)
    assert "rank 0 submitted allreduce" in batch.items[0].error


def test_same_name_different_types_is_fine_when_both_complete():
    coord, _ = make()
    submit(coord, 0, ar("x"), Request(Coll.ALLGATHER, "x", "float32", (4,)))
    submit(coord, 1, ar("x"))
    batch = coord.tick()
    assert [(r.request.coll, r.error) for r in batch.items] == [(Coll.ALLREDUCE, "")]


def test_cache_ids_replace_requests_in_steady_state():
    coord, clock = make()
    worker = ResponseCache(16)
    submit(coord, 0, ar("a"))
    submit(coord, 1, ar("a"))
    (resp,) = coord.tick().items
    assert isinstance(resp, Response)
    assert worker.add(resp, 1) == 0
    cid = worker.lookup(ar("a"))
    assert cid == 0
    submit(coord, 0, cached=[cid])
    submit(coord, 1, cached=[cid])
    assert coord.tick().items == [0]
    # a changed shape misses the cache and is validated again
    assert worker.lookup(ar("a", shape=(8,))) == -1


def names(batch) -> list[str]:
    return [r.request.name for r in batch.items]


def test_priority_orders_a_batch_and_unprioritized_requests_go_first():
    """Cross-barrier mode: the coordinator sends ready allreduces in ascending priority (the
    next forward's order), whatever order they completed in; one decision for every rank."""
    coord, _ = make()
    reqs = [ar("l3", priority=3), ar("plain"), ar("l1", priority=1), ar("l2", priority=2)]
    for rank in (0, 1):
        submit(coord, rank, *reqs)
    assert names(coord.tick()) == ["plain", "l1", "l2", "l3"]


def test_priority_window_holds_the_rest_and_a_later_higher_priority_overtakes(monkeypatch):
    """At most PRIORITY_WINDOW_BYTES (when set) of prioritized allreduces per batch (at least
    one): what is held goes next tick, behind a higher-priority request completed meanwhile."""
    from lightcc.common.control import outcomes
    monkeypatch.setattr(outcomes, "PRIORITY_WINDOW_BYTES", 1 << 20)
    per = outcomes.PRIORITY_WINDOW_BYTES // 4 // 2 + 1     # float32: two fit, not three
    coord, _ = make(threshold=1 << 30)
    big = [ar(f"l{i}", shape=(per,), priority=i) for i in (5, 6, 7)]
    for rank in (0, 1):
        submit(coord, rank, *big)
    assert names(coord.tick()) == ["l5"]
    assert coord.next_deadline() == 0.0                  # the held ones go at once
    for rank in (0, 1):
        submit(coord, rank, ar("l1", priority=1))
    assert names(coord.tick()) == ["l1", "l6"]
    assert names(coord.tick()) == ["l7"]
    assert coord.tick() is None and not coord.pending
    huge = ar("huge", shape=(4 * per,), priority=2)        # larger than the window: alone
    for rank in (0, 1):
        submit(coord, rank, huge)
    assert names(coord.tick()) == ["huge"]


def test_priority_orders_cache_ids_in_steady_state():
    coord, _ = make()
    worker = ResponseCache(16)
    reqs = [ar("b", priority=2), ar("a", priority=1)]
    for rank in (0, 1):
        submit(coord, rank, *reqs)
    for resp in coord.tick().items:
        worker.add(resp, 1)
    ids = [worker.lookup(r) for r in reqs]          # b, a
    for rank in (0, 1):
        submit(coord, rank, cached=ids)
    assert coord.tick().items == ids[::-1]


def test_cached_and_new_request_mismatch_detected():
    coord, _ = make()
    submit(coord, 0, ar("a"))
    submit(coord, 1, ar("a"))
    coord.tick()
    submit(coord, 0, cached=[0])
    submit(coord, 1, ar("a", shape=(9,)))
    (resp,) = coord.tick().items
    assert "rank 1 has shape (9,), rank 0 has (4,)" in resp.error


def test_cache_capacity_zero_never_caches():
    coord, _ = make(capacity=0)
    submit(coord, 0, ar("a"))
    submit(coord, 1, ar("a"))
    (resp,) = coord.tick().items
    assert ResponseCache(0).add(resp, 0) == -1


def test_cycle_time_holds_small_buckets_while_others_arrive():
    coord, clock = make(cycle=0.005)
    submit(coord, 0, ar("a"), ar("b"))
    submit(coord, 1, ar("a"))
    assert coord.tick() is None          # 'b' is still arriving: hold 'a' for fusion
    clock.t = 0.002
    submit(coord, 1, ar("b"))
    names = [r.request.name for r in coord.tick().items]
    assert names == ["a", "b"]


def test_cycle_time_expires():
    coord, clock = make(cycle=0.005)
    submit(coord, 0, ar("a"), ar("b"))
    submit(coord, 1, ar("a"))
    assert coord.tick() is None
    clock.t = 0.006
    assert [r.request.name for r in coord.tick().items] == ["a"]


def test_lone_request_is_not_held():
    coord, _ = make(cycle=10.0)
    submit(coord, 0, ar("a"))
    submit(coord, 1, ar("a"))
    assert coord.tick() is not None


def test_full_bucket_is_not_held():
    coord, _ = make(cycle=10.0, threshold=32)
    submit(coord, 0, ar("a", shape=(8,)), ar("b"))
    submit(coord, 1, ar("a", shape=(8,)))
    assert coord.tick() is not None


def test_stall_warning_names_tensor_and_missing_ranks():
    coord, clock = make(size=3, stall=2.0)
    submit(coord, 0, ar("lonely"))
    clock.t = 1.0
    assert coord.tick() is None and coord.warnings == []
    clock.t = 2.5
    coord.tick()
    (warning,) = coord.warnings
    assert "allreduce 'lonely'" in warning and "missing ranks [1, 2]" in warning
    clock.t = 3.0
    coord.tick()
    assert coord.warnings == []           # not repeated before another stall period


def test_stall_shutdown_fails_the_tensor():
    coord, clock = make(stall=1.0, stall_shutdown=5.0)
    submit(coord, 1, ar("lonely"))
    clock.t = 6.0
    (resp,) = coord.tick().items
    assert resp.error_kind == "stall" and "never by rank 0" in resp.error
    assert not coord.pending


def test_rank_shutdown_fails_tensors_waiting_for_it():
    coord, _ = make()
    submit(coord, 0, ar("a"))
    coord.receive(1, RankMessage(shutdown=True))
    (resp,) = coord.tick().items
    assert resp.error_kind == "shutdown" and "rank 1 shut down" in resp.error


def test_gone_ranks_are_announced_once_even_with_nothing_pending():
    coord, _ = make(size=3)
    assert coord.tick() is None
    coord.receive(2, RankMessage(shutdown=True))
    batch = coord.tick()
    assert batch is not None and batch.items == [] and batch.gone == (2,)
    assert coord.tick() is None                      # nothing new: no empty batches
    coord.lose(1)
    assert coord.tick().gone == (1, 2)               # the whole set, in every batch


def test_join_makes_joined_ranks_contribute_and_reports_last():
    coord, _ = make(size=3)
    submit(coord, 1, Request(Coll.JOIN, "join"))
    submit(coord, 0, ar("a"))
    submit(coord, 2, ar("a"))
    batch = coord.tick()
    assert batch.joined == (1,)
    assert [r.request.name for r in batch.items] == ["a"]
    submit(coord, 2, Request(Coll.JOIN, "join"))
    submit(coord, 0, Request(Coll.JOIN, "join"))
    batch = coord.tick()
    (resp,) = batch.items
    assert resp.request.coll == Coll.JOIN and resp.value == 0


def test_join_with_broadcast_is_an_error():
    coord, _ = make()
    submit(coord, 1, Request(Coll.JOIN, "join"))
    submit(coord, 0, Request(Coll.BROADCAST, "w", "float32", (2,), root=0))
    (resp,) = coord.tick().items
    assert resp.error_kind == "join"


def test_process_sets_only_wait_for_members():
    coord, _ = make(size=3)
    for r in range(3):
        submit(coord, r, Request(Coll.ADD_PSET, "add_process_set[0, 2]", splits=(0, 2)))
    (resp,) = coord.tick().items
    assert resp.value == 1 and coord.psets[1] == (0, 2)
    submit(coord, 0, ar("p", pset=1))
    submit(coord, 2, ar("p", pset=1))
    (resp,) = coord.tick().items
    assert resp.request.pset == 1 and not resp.error


def test_validate_alltoall_collects_splits():
    reqs = {0: Request(Coll.ALLTOALL, "t", "int64", (3,), splits=(1, 2)),
            1: Request(Coll.ALLTOALL, "t", "int64", (4,), splits=(4, 0))}
    resp = validate((0, 1), reqs)
    assert resp.per_rank == ((1, 2), (4, 0))
    assert resp.request_of(1).splits == (4, 0)


def test_batch_and_message_round_trip():
    batch = Batch(items=[3, Response(ar("z"), per_rank=(1, 2))], joined=(1,), shutdown="",
                  settings={"fusion_threshold": 5}, gone=(2, 3))
    again = Batch.decode(batch.encode())
    assert again.items[0] == 3 and again.items[1] == batch.items[1]
    assert again.joined == (1,) and again.settings == {"fusion_threshold": 5}
    assert again.gone == (2, 3)
    msg = RankMessage(cached=[1, 2], requests=[ar("q")], shutdown=True)
    back = RankMessage.decode(msg.encode())
    assert back.cached == [1, 2] and back.requests == [ar("q")] and back.shutdown


# ---- ordered streams (matched by position) ------------------------------------------------
from lightcc.common.control.cache import SignatureCache  # noqa: E402
from lightcc.common.control.messages import SHARED_STREAM, OrderedItem, signature  # noqa: E402


def ordered(coord, rank, *items, pset=0, stream=SHARED_STREAM, seq=None):
    """``rank``'s next requests on a stream; positions count per (coordinator, rank, stream)
    as the engine numbers them, unless ``seq`` gives the first one."""
    counts = coord.__dict__.setdefault("_test_seq", {})
    first = counts.get((rank, pset, stream), 0) if seq is None else seq
    counts[(rank, pset, stream)] = first + len(items)
    coord.receive(rank, RankMessage(ordered=[(pset, stream, first + i, x)
                                             for i, x in enumerate(items)]))


def test_ordered_requests_match_by_position_not_label():
    coord, _ = make()
    ordered(coord, 0, ar("label-a"), ar("label-b", shape=(8,)))
    ordered(coord, 1, ar("other-a"))
    batch = coord.tick()
    (item,) = batch.items
    assert isinstance(item, OrderedItem) and item.payload.request.shape == (4,)
    assert not item.payload.error
    ordered(coord, 1, ar("other-b", shape=(8,)))
    (item,) = coord.tick().items
    assert item.payload.request.shape == (8,) and not item.payload.error


@pytest.mark.parametrize("change,text", [
    ({"shape": (5,)}, "rank 1 has shape (5,), rank 0 has (4,)"),
    ({"dtype": "int32"}, "rank 1 has dtype int32, rank 0 has float32"),
    ({"op": "max"}, "rank 1 has op max, rank 0 has sum"),
])
def test_ordered_mismatch_is_an_error_for_that_position_only(change, text):
    coord, _ = make()
    ordered(coord, 0, ar("x"), ar("y"))
    kw = {"shape": (4,), "dtype": "float32", "op": "sum", **change}
    ordered(coord, 1, ar("x", **kw), ar("y"))
    first, second = coord.tick().items
    assert first.payload.error_kind == "mismatch" and text in first.payload.error
    assert not second.payload.error


def test_ordered_collective_type_mismatch_on_the_shared_stream():
    coord, _ = make()
    ordered(coord, 0, ar("x"))
    ordered(coord, 1, Request(Coll.BROADCAST, "x", "float32", (4,), root=0))
    (item,) = coord.tick().items
    assert "rank 1 has collective broadcast, rank 0 has allreduce" in item.payload.error


def test_ordered_signature_cache_ids_in_steady_state():
    coord, _ = make()
    worker = SignatureCache(16)
    ordered(coord, 0, ar("x"))
    ordered(coord, 1, ar("x"))
    (item,) = coord.tick().items
    assert worker.add(item.payload, 1) == 0
    sid = worker.lookup(signature(ar("any label")))
    assert sid == 0
    ordered(coord, 0, sid)
    ordered(coord, 1, sid)
    (item,) = coord.tick().items
    assert item.payload == 0           # only the id travels
    assert worker.lookup(signature(ar("x", shape=(2,)))) == -1


def test_ordered_streams_are_independent():
    coord, _ = make()
    ordered(coord, 0, ar("a"), stream=int(Coll.ALLREDUCE))
    ordered(coord, 0, Request(Coll.ALLGATHER, "g", "float32", (2, 3)),
            stream=int(Coll.ALLGATHER))
    ordered(coord, 1, Request(Coll.ALLGATHER, "g", "float32", (5, 3)),
            stream=int(Coll.ALLGATHER))
    (item,) = coord.tick().items
    assert item.stream == int(Coll.ALLGATHER) and item.payload.per_rank == (2, 5)
    ordered(coord, 1, ar("a"), stream=int(Coll.ALLREDUCE))
    (item,) = coord.tick().items
    assert item.stream == int(Coll.ALLREDUCE)


def test_joined_rank_skips_ordered_positions_and_stays_aligned():
    coord, _ = make(size=2)
    submit(coord, 1, Request(Coll.JOIN, "join"))
    ordered(coord, 0, ar("p0"), ar("p1"))
    batch = coord.tick()
    assert len(batch.items) == 2 and batch.joined == (1,)
    submit(coord, 0, Request(Coll.JOIN, "join"))
    coord.tick()
    # after join, rank 1's next ordered request lines up with rank 0's next one (a joined
    # rank counts the positions it skipped: the engine's _take_ordered)
    ordered(coord, 0, ar("after", shape=(2,)))
    ordered(coord, 1, ar("after", shape=(2,)), seq=2)
    (item,) = coord.tick().items
    assert not item.payload.error and item.payload.request.shape == (2,)


def test_ordered_stall_names_what_the_missing_rank_waits_in():
    coord, clock = make(stall=1.0, stall_shutdown=5.0)
    ordered(coord, 0, ar("grad"))
    submit(coord, 1, Request(Coll.BARRIER, "barrier.noname.0"))
    clock.t = 6.0
    texts = [getattr(i, "payload", i).error for i in coord.tick().items]
    assert any("allreduce 'grad'" in t and "never by rank 1" in t
               and "rank 1 waits in barrier 'barrier.noname.0'" in t for t in texts), texts


def test_a_member_that_leaves_fails_an_answered_ordered_position_in_its_place():
    """Position 0 is complete but held (cycle time, another request still open) when rank 2
    exits: the position fails with ShutdownError where it stood, and position 1 follows."""
    coord, clock = make(size=3, cycle=10.0)
    for r in range(3):
        ordered(coord, r, ar("p0"))
    submit(coord, 0, ar("x"))
    assert coord.tick() is None                    # held: 'x' is still open
    coord.lose(2)
    items = coord.tick().items
    pos = [i for i in items if isinstance(i, OrderedItem)]
    assert len(pos) == 1 and pos[0].payload.error_kind == "shutdown", items
    assert "rank 2 exited or lost its connection before it could run" in pos[0].payload.error
    for r in range(2):
        ordered(coord, r, ar("p1"))
    clock.t = 20.0
    batch = coord.tick()
    assert [i.payload.error_kind for i in batch.items if isinstance(i, OrderedItem)] == \
        ["shutdown"]                                # position 1 needs rank 2 as well


def test_a_late_report_of_an_earlier_round_yields_to_the_tree_agreement():
    """Rank 1's report of round 1 arrives after round 1 failed (a stall error raced with it);
    round 2 is then agreed in the control tree: one answer, the cache id, and nothing left
    pending from the late report."""
    from lightcc.common.control.messages import Report

    coord, _ = make()
    submit(coord, 0, ar("a"))
    submit(coord, 1, ar("a"))
    coord.tick()                                   # 'a' is cached as id 0 from here on
    submit(coord, 1, cached=[0])                   # the late one
    coord.take(Report(named=1 << 0))               # round 2, complete in the tree
    assert coord.tick().items == [0]
    assert not coord.pending and coord.next_deadline() > 0
