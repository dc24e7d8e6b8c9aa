"""Pure logic of the algorithms package: the ``auto`` choice, chunking, element-wise ops."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

from lightcc.common import algorithms
from lightcc.common.algorithms import ring
from lightcc.common.arrays import reduce_into
from lightcc.common.comm import WireStats
from lightcc.common.topology import Topology, assign_nodes


@dataclass
class StubComm:
    rank: int
    size: int
    name: str = "stub"
    stats: WireStats = field(default_factory=WireStats)
    is_device: bool = False


def topo(nranks: int, local_size: int, rank: int = 0, device: bool = False) -> Topology:
    nodes = assign_nodes(["h"] * nranks, local_size)
    local_n = nodes.count(nodes[rank])
    cross_n = len(set(nodes))
    return Topology(world=StubComm(rank, nranks, is_device=device), local=StubComm(0, local_n),
                    cross=StubComm(0, cross_n), node_of_rank=nodes)


MB = 1 << 20


@pytest.mark.parametrize("nranks,local,nbytes,want", [
    (1, 0, 100 * MB, "flat"),          # single rank
    (4, 4, 100 * MB, "flat"),          # one node
    (4, 1, 100 * MB, "ring"),          # one rank per node: pipelined ring over the network
    (4, 1, 128 * 1024, "flat"),        # ... unless below the multi-node threshold
    (2, 1, 4 * MB, "flat"),            # ... or below the ring threshold (8 MB)
    (2, 1, 8 * MB, "ring"),
    (4, 2, 100 * MB, "native"),        # 2 x 2, large, host buffers: Open MPI's han
    (8, 4, 1 * MB, "native"),          # 2 x 4, medium
    (4, 2, 1024, "flat"),              # small: latency-bound
    (4, 2, 0, "flat"),                 # empty
    (3, 2, 100 * MB, "flat"),          # uneven 2 + 1, host buffers: the native call
    (4, 2, 128 * 1024, "flat"),        # between small and hierarchical thresholds
])
def test_auto_choice(nranks, local, nbytes, want):
    assert algorithms.choose("auto", nbytes, topo(nranks, local)) == want


def test_auto_device_buffers_use_native_hierarchical():
    assert algorithms.choose("auto", 100 * MB, topo(4, 2, device=True)) == "hierarchical"
    assert algorithms.choose("auto", 100 * MB, topo(4, 4, device=True)) == "flat"
    assert algorithms.choose("auto", 100 * MB, topo(4, 1, device=True)) == "flat"   # NCCL ring


def test_auto_is_same_on_every_rank():
    for r in range(6):
        for nbytes in (0, 10, 100 * 1024, 10 * MB):
            assert algorithms.choose("auto", nbytes, topo(6, 2, r)) == \
                algorithms.choose("auto", nbytes, topo(6, 2, 0))


def test_thresholds_are_overridable():
    t = topo(4, 2)
    saved = algorithms.THRESHOLDS
    try:
        algorithms.set_thresholds(multi_node="hierarchical", hierarchical_bytes=10 * MB)
        assert algorithms.choose("auto", 20 * MB, t) == "hierarchical"
        assert algorithms.choose("auto", 5 * MB, t) == "flat"
        algorithms.set_thresholds(small_bytes=1 * MB, small="tree")
        assert algorithms.choose("auto", 512 * 1024, t) == "tree"
        with pytest.raises(ValueError, match="not an algorithm"):
            algorithms.set_thresholds(small="bogus")
    finally:
        algorithms.THRESHOLDS = saved
    custom = algorithms.AutoThresholds(small_bytes=0, hierarchical_bytes=0, multi_node="ring")
    assert algorithms.choose("auto", 1, t, custom) == "ring"


def test_explicit_names_pass_through_and_unknown_fails():
    t = topo(4, 2)
    for name in ("flat", "ring", "hierarchical", "2d", "tree", "native"):
        assert algorithms.choose(name, 123, t) == name
    with pytest.raises(ValueError, match="unknown algorithm 'nope'"):
        algorithms.choose("nope", 1, t)
    assert algorithms.available_algorithms() == ["auto", "2d", "flat", "hierarchical", "native",
                                                 "ring", "tree"]


@pytest.mark.parametrize("counts,itemsize,want", [
    ([0, 0], 4, 1),
    ([10, 10], 4, 1),
    ([MB, MB], 4, 4),                 # 4 MiB segments / 1 MiB chunks
    ([MB + 1, MB], 4, 5),
    ([1 << 30], 4, ring.MAX_CHUNKS),  # capped
])
def test_num_chunks(counts, itemsize, want):
    assert ring.num_chunks(counts, itemsize) == want


@pytest.mark.parametrize("op,fn", [("sum", np.add), ("prod", np.multiply),
                                   ("min", np.minimum), ("max", np.maximum)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.int64])
def test_reduce_into(op, fn, dtype):
    a = np.array([3, -1, 2, 0], dtype)
    b = np.array([-2, 5, 2, 7], dtype)
    want = fn(a, b)
    view = a[:]
    reduce_into(view, b, op)
    assert np.array_equal(a, want)


def test_reduce_into_rejects_unknown_op():
    with pytest.raises(ValueError, match="unknown reduction op 'avg'"):
        reduce_into(np.zeros(2), np.zeros(2), "avg")


def test_sub_blocks_split_every_block_the_same_way():
    from lightcc.common.arrays import num_pieces, sub_blocks

    sizes, starts = sub_blocks([5, 0, 7], 3)
    assert sizes == [[2, 2, 1], [0, 0, 0], [3, 2, 2]]
    assert starts == [[0, 2, 4], [5, 5, 5], [5, 8, 10]]
    assert [num_pieces(n, 4, 3) for n in (0, 1, 4, 5, 100)] == [1, 1, 1, 2, 3]
    assert num_pieces(100, 4) == 25
