"""The control tree (tree.py, negotiator.py) with a whole job simulated in one process.

Every rank runs its real :class:`Negotiator`; messages travel as the bytes the engine sends, one
FIFO queue per tree edge, delivered in a random order across edges (as a loaded machine would).
What each rank executes is compared across ranks and against what the test itself submitted:
every rank executes the same responses in the same order, each submitted collective exactly
once, and a rank never executes a collective it is needed in without having submitted it (the
engine would hang or mismatch MPI calls there).
"""
from __future__ import annotations

import math
import random
from collections import defaultdict, deque

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightcc.common.control.controller import Coordinator
from lightcc.common.control.messages import SHARED_STREAM, Batch, Coll, OrderedItem, Request, Response
from lightcc.common.control.tree import bits, demote_after, layout
from lightcc.common.control.negotiator import Negotiator


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def ar(name: str, shape=(4,), pset=0, dtype="float32") -> Request:
    return Request(Coll.ALLREDUCE, name, dtype, tuple(shape), "sum", pset=pset)


def ag(name: str, first: int) -> Request:
    return Request(Coll.ALLGATHER, name, "int32", (first, 3))


class World:
    """``n`` simulated ranks; see module docstring. ``log[r]`` lists what rank ``r`` executed
    as ``(kind, what, error kind, per_rank)``."""

    def __init__(self, n: int, fanout: int = 2, seed: int = 0, stall_check: float = 0.0,
                 stall_shutdown: float = 0.0, capacity: int = 64) -> None:
        self.n = n
        self.clock = Clock()
        self.coord = Coordinator(n, capacity, 0.0, 1 << 40, stall_check, stall_shutdown,
                                 clock=self.clock)
        after = demote_after(stall_check, stall_shutdown)
        self.negs = [Negotiator(r, n, capacity, fanout, after,
                                self.coord if r == 0 else None, clock=self.clock)
                     for r in range(n)]
        self.links: dict[tuple[int, int], deque] = defaultdict(deque)
        self.inflight: list[dict] = [{} for _ in range(n)]
        self.streams: list[dict] = [defaultdict(deque) for _ in range(n)]
        self.seq: list[dict] = [defaultdict(int) for _ in range(n)]
        self.joined: set[int] = set()
        self.psets: dict[int, tuple[int, ...]] = {0: tuple(range(n))}
        self.dead: set[int] = set()
        self.log: list[list] = [[] for _ in range(n)]
        self.missing_entry: list = []
        self.warnings: list[str] = []
        self.rng = random.Random(seed)
        self.unsent: set[int] = set()

    # -- what the ranks do -----------------------------------------------------------------
    def submit(self, r: int, req: Request) -> None:
        assert req.key not in self.inflight[r], "a duplicate name (the engine refuses it)"
        self.inflight[r][req.key] = req
        self.negs[r].submit_named(req)
        self.unsent.add(r)

    def submit_ordered(self, r: int, req: Request, stream: int = SHARED_STREAM) -> None:
        pair = (req.pset, stream)
        seq = self.seq[r][pair]
        self.seq[r][pair] = seq + 1
        self.streams[r][pair].append(req)
        self.negs[r].submit_ordered(req.pset, stream, seq, req)
        self.unsent.add(r)

    def join(self, r: int) -> None:
        self.joined.add(r)
        self.submit(r, Request(Coll.JOIN, "join"))

    # -- the machinery ----------------------------------------------------------------------
    def _send_up(self, r: int) -> None:
        data = self.negs[r].outgoing()
        if data is not None:
            self.links[(r, self.negs[r].parent)].append(data)

    def _tick(self) -> bool:
        batch = self.coord.tick()
        self.warnings += self.coord.warnings
        if batch is None:
            return False
        data = batch.encode()
        for c in self.negs[0].children:
            self.links[(0, c)].append(data)
        self._execute(0, batch)
        return True

    def _deliver(self, src: int, dst: int) -> None:
        data = self.links[(src, dst)].popleft()
        neg = self.negs[dst]
        if src == neg.parent:                      # a batch: pass on, then apply
            for c in neg.children:
                self.links[(dst, c)].append(data)
            self._execute(dst, Batch.decode(data))
        else:
            neg.from_child(src, data)
            self._send_up(dst)

    def _execute(self, r: int, batch: Batch) -> None:
        responses = self.negs[r].absorb(batch)
        self._send_up(r)                           # what the batch demoted (engine: the same)
        for item, resp in zip(batch.items, responses):
            req = resp.request
            if isinstance(item, OrderedItem):
                pair = (item.pset, item.stream)
                queue = self.streams[r][pair]
                had = bool(queue)
                if had:
                    mine = queue.popleft()           # this position's request here
                    index = self.psets[item.pset].index(r)
                    if not resp.error and mine.shape != resp.request_of(index).shape:
                        self.missing_entry.append((r, "position answered out of order"))
                elif r in self.psets.get(item.pset, ()):
                    self.seq[r][pair] += 1                 # skipped while joined
                what = ("ordered", pair)
            else:
                had = self.inflight[r].pop(req.key, None) is not None
                what = (req.coll, req.name)
                if req.coll == Coll.JOIN:
                    self.joined.discard(r)
                if req.coll == Coll.ADD_PSET and not resp.error:
                    self.psets[resp.value] = tuple(req.splits)
            members = self.psets.get(req.pset, ())
            needed = r in members and not (r in batch.joined and req.pset == 0)
            if not resp.error and needed and not had and req.coll != Coll.JOIN:
                self.missing_entry.append((r, what))
            self.log[r].append((what, resp.error_kind, resp.per_rank,
                                tuple(batch.joined)))

    def run(self, max_events: int = 200000) -> None:
        """Deliver everything, in a random order across edges, until nothing moves."""
        for _ in range(max_events):
            moves = [("up", r) for r in self.unsent]
            moves += [("link", k) for k, q in self.links.items() if q]
            if not moves:
                if self._tick():
                    continue
                return
            kind, arg = self.rng.choice(moves)
            if kind == "up":
                self.unsent.discard(arg)
                self._send_up(arg)
            else:
                self._deliver(*arg)
            if self.rng.random() < 0.3:
                self._tick()
        raise AssertionError("the simulated job never went quiet")

    def advance(self, seconds: float) -> None:
        """Let time pass: every node scans for stalls, rank 0 ticks."""
        self.clock.t += seconds
        for r, neg in enumerate(self.negs):
            if neg.scan(self.clock.t):
                self._send_up(r)
        self.run()

    def lose(self, child: int) -> None:
        """``child``'s connection to its parent closed."""
        parent = self.negs[child].parent
        self.negs[parent].child_lost(child)
        self._send_up(parent)
        self.run()

    # -- checks -----------------------------------------------------------------------------
    def same_everywhere(self) -> list:
        for r in range(1, self.n):
            assert self.log[r] == self.log[0], f"rank {r} executed something else than rank 0"
        assert not self.missing_entry, self.missing_entry
        return self.log[0]


def names_of(entries) -> list[str]:
    return [what[1] for what, *_ in entries]


def step(world: World, names, shape=(4,), order=None) -> None:
    for r in order or range(world.n):
        for name in world.rng.sample(list(names), len(names)):
            world.submit(r, ar(name, shape))
    world.run()


# ---- layout ----------------------------------------------------------------------------------
@pytest.mark.parametrize("fanout", [1, 2, 3, 4, 8])
def test_layout_is_a_tree_of_contiguous_subtrees(fanout):
    for size in list(range(1, 40)) + [257, 1024]:
        parent, children, end = layout(size, fanout)
        assert parent[0] == -1 and end[0] == size
        for r in range(size):
            kids = children[r]
            assert len(kids) <= fanout
            assert all(parent[c] == r for c in kids)
            # the children's subtrees tile (r, end[r]) in order
            cover = r + 1
            for c in kids:
                assert c == cover and end[c] <= end[r]
                cover = end[c]
            assert cover == end[r]
        depth = max(_depth(parent, r) for r in range(size))
        if fanout >= 2 and size > 1:
            assert depth <= math.ceil(math.log(size, fanout)) + 1, (size, depth)


def _depth(parent, r):
    d = 0
    while parent[r] >= 0:
        r, d = parent[r], d + 1
    return d


def test_bits_lists_set_positions():
    assert list(bits(0)) == [] and list(bits(0b101001)) == [0, 3, 5]
    assert list(bits(1 << 300 | 2)) == [1, 300]


# ---- the steady state --------------------------------------------------------------------------
@pytest.mark.parametrize("n,fanout", [(2, 4), (3, 1), (5, 2), (9, 2), (12, 3)])
def test_steady_state_is_agreed_in_bit_vectors_same_order_everywhere(n, fanout):
    world = World(n, fanout, seed=n)
    names = [f"g{i}" for i in range(7)]
    step(world, names)
    assert world.coord.slow_pairs == n * len(names)      # the first step: rank by rank
    for s in range(4):
        step(world, names, order=world.rng.sample(range(n), n))
    log = world.same_everywhere()
    assert sorted(names_of(log)) == sorted(names * 5)
    assert all(err == "" for _, err, *_ in log)
    # after the first step nothing went to rank 0 rank by rank: 7 keys per step, in the tree
    assert world.coord.slow_pairs == n * len(names)
    assert world.coord.fast_keys == 4 * len(names)


def test_a_batch_never_answers_before_every_rank_submitted():
    world = World(5, 2, seed=3)
    step(world, ["a", "b"])
    for r in range(4):                      # rank 4 late
        world.submit(r, ar("a"))
        world.submit(r, ar("b"))
    world.run()
    assert len(world.log[0]) == 2
    world.submit(4, ar("b"))
    world.run()
    assert names_of(world.log[0][2:]) == ["b"]
    world.submit(4, ar("a"))
    world.run()
    assert names_of(world.same_everywhere()[2:]) == ["b", "a"]


def test_process_sets_wait_for_members_only_and_stay_in_bit_vectors():
    world = World(7, 2, seed=1)
    for r in range(7):
        world.submit(r, Request(Coll.ADD_PSET, "add", splits=(1, 4, 6)))
    world.run()
    pset = max(world.psets)
    assert world.psets[pset] == (1, 4, 6)
    for s in range(3):
        for r in (6, 1, 4):
            world.submit(r, ar("p", pset=pset))
            world.submit(r, ar("q", shape=(2,), pset=pset))
        world.run()
    log = world.same_everywhere()
    assert names_of(log[1:]) .count("p") == 3 and names_of(log[1:]).count("q") == 3
    assert world.coord.fast_keys == 4                      # steps 2 and 3: two keys each
    assert world.coord.slow_pairs == 7 + 3 * 2


def test_changed_shape_in_steady_state_is_a_mismatch_on_every_rank_then_recovers():
    world = World(6, 2, seed=2)
    step(world, ["w", "v"])
    for r in range(6):
        world.submit(r, ar("w", shape=(5,) if r == 4 else (4,)))
        world.submit(r, ar("v"))
    world.run()
    log = world.same_everywhere()
    errors = [(what, err) for what, err, *_ in log[2:]]
    assert ((Coll.ALLREDUCE, "w"), "mismatch") in errors and ((Coll.ALLREDUCE, "v"), "") in errors
    assert world.coord.demoted_keys >= 1
    step(world, ["w", "v"])
    slow = world.coord.slow_pairs
    step(world, ["w", "v"])                  # the demotion ended with its round: bits again
    assert world.coord.slow_pairs == slow
    assert all(err == "" for _, err, *_ in world.same_everywhere()[4:])


def test_allgather_whose_sizes_change_is_revalidated_with_every_rank_size():
    world = World(5, 2, seed=4)
    for sizes in ([1, 2, 3, 4, 5], [1, 2, 3, 4, 5], [1, 2, 9, 4, 5], [1, 2, 9, 4, 5]):
        for r in range(5):
            world.submit(r, ag("gat", sizes[r]))
        world.run()
        what, err, per_rank, _ = world.same_everywhere()[-1]
        assert err == "" and per_rank == tuple(sizes)


def test_ordered_allgather_whose_ranks_pick_different_cached_signatures():
    """Sizes (1, 2), (1, 3), then (1, 2) again: rank 0 finds (1, 3)'s signature in its
    cache (its own size is 1 in both), rank 1 (1, 2)'s; the tree forwards both ids with their
    ranges and rank 0 validates rank by rank (taking one id for all would say (1, 3))."""
    world = World(2, 2, seed=12)
    for sizes in ([1, 2], [1, 3], [1, 2], [2, 2], [1, 2], [1, 2]):
        for r in range(2):
            world.submit_ordered(r, ag("g", sizes[r]))
        world.run()
        what, err, per_rank, _ = world.same_everywhere()[-1]
        assert err == "" and per_rank == tuple(sizes), (sizes, per_rank)


def test_a_node_ignores_reports_for_positions_already_decided():
    world = World(3, 2, seed=13)
    node = world.negs[0].node
    node.resolve([], [(0, SHARED_STREAM)])         # position 0 was decided (say, a stall error)
    node.own_ordered(0, SHARED_STREAM, 0, 5)        # a late report for it
    assert not node.has_partial()
    node.own_ordered(0, SHARED_STREAM, 1, 5)
    assert node.has_partial()


def test_ordered_streams_positions_and_signature_changes():
    world = World(6, 2, seed=5)
    expect = []
    for s in range(6):
        firsts = [1 + (r if s >= 4 else 0) for r in range(6)]      # sizes differ from step 4
        for r in world.rng.sample(range(6), 6):
            world.submit_ordered(r, ar(f"label{r}", shape=(3,)))
            world.submit_ordered(r, ag("x", firsts[r]))
            world.submit_ordered(r, ar("u", shape=(2,)), stream=int(Coll.ALLREDUCE))
        expect += [(), tuple(firsts), ()]
        world.run()
    log = world.same_everywhere()
    per_stream = [p for (what, err, p, _) in log if what == ("ordered", (0, SHARED_STREAM))]
    assert per_stream == [e for i, e in enumerate(expect) if i % 3 != 2]
    assert all(err == "" for _, err, *_ in log)
    assert world.coord.fast_keys >= 3 * 3


def test_ordered_positions_are_answered_in_order_when_one_needs_detail():
    """Position 0 is new on one rank (rank by rank), position 1 cached everywhere (in the
    tree, complete first): every rank must still execute 0 before 1."""
    world = World(5, 2, seed=11)
    for r in range(5):
        world.submit_ordered(r, ar("a", shape=(3,)))
        world.submit_ordered(r, ar("b", shape=(2,)))
    world.run()
    for r in range(5):
        world.submit_ordered(r, ar("a", shape=(3,) if r != 2 else (3, 1)))
        world.submit_ordered(r, ar("b", shape=(2,)))
    world.run()
    log = world.same_everywhere()
    assert [err for _, err, *_ in log] == ["", "", "mismatch", ""]
    assert world.coord.fast_keys >= 1


def test_ordered_mismatch_in_steady_state_fails_that_position_everywhere():
    world = World(4, 1, seed=6)                 # a chain: every report relayed three times
    for s in range(3):
        for r in range(4):
            world.submit_ordered(r, ar("x", shape=(4,) if (s < 2 or r != 3) else (6,)))
            world.submit_ordered(r, ar("y", shape=(2,)))
        world.run()
    log = world.same_everywhere()
    assert [err for _, err, *_ in log] == ["", "", "", "", "mismatch", ""]


def test_join_goes_rank_by_rank_then_back_to_bit_vectors():
    world = World(6, 2, seed=7)
    step(world, ["a", "b"])
    world.join(3)
    world.run()
    for r in (0, 1, 2, 4, 5):
        world.submit(r, ar("a"))
        world.submit(r, ar("b"))
    world.run()
    log = world.same_everywhere()
    assert [j for *_, j in log[-2:]] == [(3,), (3,)] and sorted(names_of(log[-2:])) == ["a", "b"]
    for r in (0, 1, 2, 4, 5):
        world.join(r)
    world.run()
    assert world.same_everywhere()[-1][0] == (Coll.JOIN, "join")
    fast = world.coord.fast_keys
    step(world, ["a", "b"])
    step(world, ["a", "b"])
    assert world.coord.fast_keys == fast + 4           # the steady state is back
    world.same_everywhere()


def test_stall_is_demoted_and_names_missing_ranks_and_what_they_wait_in():
    world = World(7, 2, seed=8, stall_check=2.0, stall_shutdown=6.0)
    step(world, ["grad", "other"])
    for r in range(7):
        if r != 5:
            world.submit(r, ar("grad"))
    world.submit(5, Request(Coll.BARRIER, "barrier.noname.0"))
    world.run()
    for _ in range(10):
        world.advance(0.5)                      # 5 s: the stall warning, not yet the error
    text = " ".join(world.warnings)
    assert "allreduce 'grad'" in text and "missing rank 5" in text, text
    assert "rank 5 waits in barrier 'barrier.noname.0'" in text, text
    for _ in range(4):
        world.advance(0.5)
    log = world.same_everywhere()
    errs = {what: err for what, err, *_ in log[2:]}
    assert errs[(Coll.ALLREDUCE, "grad")] == "stall" and errs[(Coll.BARRIER, "barrier.noname.0")]


def test_a_lost_relay_cuts_off_its_subtree_and_fails_what_needs_it():
    world = World(7, 2, seed=9)                 # 0 -> (1 -> 2, 3), (4 -> 5, 6)
    step(world, ["a"])
    assert world.negs[4].children == (5, 6)
    for r in (0, 1, 2, 3):
        world.submit(r, ar("a"))
    world.run()
    world.lose(4)
    assert world.coord.gone == {4, 5, 6}
    errors = [(what, err) for what, err, *_ in world.log[0][1:]]
    assert errors == [((Coll.ALLREDUCE, "a"), "shutdown")]


# ---- random jobs --------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(2, 9), st.integers(1, 4), st.integers(0, 10 ** 6), st.data())
def test_random_jobs_execute_the_same_everywhere_and_each_collective_once(n, fanout, seed,
                                                                          data):
    """Random steps of named (some with changing shapes), unnamed and shared-stream calls in
    random submission orders and random delivery: every rank executes the same responses in
    the same order; each step's collectives exactly once; shape changes are mismatches."""
    world = World(n, fanout, seed=seed)
    pool = [f"t{i}" for i in range(5)]
    steps = data.draw(st.integers(2, 6))
    expected: list = []
    for s in range(steps):
        names = data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=4, unique=True))
        bad = data.draw(st.sampled_from([None] + names))
        culprit = data.draw(st.integers(0, n - 1))
        for r in data.draw(st.permutations(range(n))):
            for name in names:
                wide = name == bad and r == culprit
                world.submit(r, ar(name, (5,) if wide else (4,)))
            world.submit_ordered(r, ar("o", shape=(2,)))
        world.run()
        expected.append((sorted(names), bad))
    log = world.same_everywhere()
    got = [e for e in log if e[0][0] != "ordered"]
    assert len(got) == sum(len(names) for names, _ in expected)
    i = 0
    for names, bad in expected:
        chunk = got[i:i + len(names)]
        i += len(names)
        assert sorted(names_of(chunk)) == names
        for what, err, *_ in chunk:
            assert err == ("mismatch" if what[1] == bad and n > 1 else ""), (what, err)
    assert len([e for e in log if e[0][0] == "ordered"]) == steps
