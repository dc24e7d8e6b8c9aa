"""The MPI-free plane's same-host shared-memory allreduce (backends/shm.py), ranks started with
torchrun's variables by hand: results against NumPy on 2 and 3 ranks, the path really taken
(its log line), and its segment never left in /dev/shm, also when a rank is killed."""
from __future__ import annotations

import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from launch_harness import NO_MPI, WORKERS, by_hand  # noqa: E402

pytestmark = pytest.mark.timeout(300)
WORKER = str(WORKERS / "shm_allreduce.py")


def _segments(out: str) -> list[str]:
    found = re.findall(r"reduce through (/dev/shm/lightcc-[0-9a-f]{32})", out)
    assert found, out[-4000:]
    return found


@pytest.mark.parametrize("np_,links", [(2, ""), (3, ""), (3, "1")])
def test_shm_allreduce_matches_numpy_and_leaves_no_segment(np_, links):
    """``links``: the link-message barriers (non-x86) instead of the flag words."""
    codes, out = by_hand(np_, [NO_MPI, "--no-torch", WORKER],
                         env={"LCC_LOG_LEVEL": "info", "SHM_LINK_BARRIER": links})
    assert codes == [0] * np_, out[-6000:]
    assert out.count("shm checks passed") == np_, out[-6000:]
    for path in _segments(out):
        assert not os.path.exists(path), path


def test_no_segment_left_when_a_rank_is_killed():
    codes, out = by_hand(2, [NO_MPI, "--no-torch", WORKER], timeout=200,
                         env={"LCC_LOG_LEVEL": "info", "SHM_KILL": "1"})
    assert codes[1] != 0 and out.count("shm checks passed") == 2, out[-6000:]
    for path in _segments(out):
        assert not os.path.exists(path), path


def test_a_rank_killed_inside_a_barrier_is_named_not_waited_for():
    """Rank 1 dies while rank 0 polls the segment's flags: rank 0 sees the link fail, names
    rank 1 and exits non-zero, and the segment is gone."""
    codes, out = by_hand(2, [NO_MPI, "--no-torch", WORKER], timeout=120,
                         env={"LCC_LOG_LEVEL": "info", "SHM_KILL": "mid"})
    assert codes[0] != 0 and codes[1] != 0, out[-6000:]
    assert "rank 1" in out and "shm checks passed" not in out, out[-6000:]
    for path in _segments(out):
        assert not os.path.exists(path), path


def test_ranks_on_hosts_of_different_names_keep_the_links():
    """Two ranks that share /dev/shm but report different host names (as the netns simulated
    hosts do) must not use the segment; their results still match NumPy."""
    codes, out = by_hand(2, [NO_MPI, "--no-torch", WORKER], env={"LCC_LOG_LEVEL": "info"},
                         per_rank={1: {"SHM_HOST": "elsewhere"}})
    assert codes == [0, 0] and out.count("shm checks passed") == 2, out[-6000:]
    assert "reduce through" not in out, out[-6000:]
