"""lightcc's TCP links (backends/tcp.py) in one process: members are threads, the bootstrap's
allgather is a shared table. Messages are checked byte for byte against what was sent."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from lightcc.common.backends import tcp
from lightcc.common.exceptions import LightCCError


class _Comm:
    """The two things ``tcp.connect`` needs from a communicator: rank/size and an allgather."""

    def __init__(self, rank: int, shared: dict) -> None:
        self.rank, self.size, self._s = rank, shared["size"], shared

    def allgather_object(self, obj):
        s = self._s
        with s["cv"]:
            gen = s["gen"]
            s["table"][self.rank] = obj
            s["count"] += 1
            if s["count"] == self.size:
                s["result"], s["table"] = list(s["table"]), [None] * self.size
                s["count"], s["gen"] = 0, gen + 1
                s["cv"].notify_all()
            while s["gen"] == gen:
                s["cv"].wait()
            return list(s["result"])


def _mesh(size: int) -> list[tcp.Links]:
    shared = {"size": size, "cv": threading.Condition(), "gen": 0, "count": 0,
              "table": [None] * size, "result": None}
    out: list = [None] * size

    def member(r: int) -> None:
        out[r] = tcp.connect(_Comm(r, shared), "test")

    threads = [threading.Thread(target=member, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(isinstance(links, tcp.Links) for links in out), out
    return out


@pytest.fixture
def mesh3():
    links = _mesh(3)
    yield links
    for li in links:
        li.close()


def test_every_pair_exchanges_in_tag_order(mesh3, monkeypatch):
    monkeypatch.setattr(tcp, "PIECE_BYTES", 1000)        # messages span several pieces
    rng = np.random.default_rng(0)
    data = {(s, d, k): rng.standard_normal(1 + 997 * k).astype(np.float32)
            for s in range(3) for d in range(3) if s != d for k in range(5)}
    recvs = {}
    # receives for tags 0/1 posted before the sends, 2/3 after: both the posted and the
    # early-message paths; two messages share tag 3 and must arrive in the order sent
    for (s, d, k), arr in data.items():
        if k < 2:
            recvs[(s, d, k)] = (np.zeros_like(arr), None)
    for key, (buf, _) in list(recvs.items()):
        s, d, k = key
        recvs[key] = (buf, mesh3[d].irecv(buf, s, k))
    sends = [mesh3[s].isend(arr, d, min(k, 3)) for (s, d, k), arr in data.items()]
    for (s, d, k), arr in data.items():
        if k >= 2:
            buf = np.zeros_like(arr)
            recvs[(s, d, k)] = (buf, mesh3[d].irecv(buf, s, min(k, 3)))
    for req in sends:
        req.wait()
    for key, (buf, req) in recvs.items():
        req.wait()
        assert req.test() and req.source == key[0] and req.nbytes == buf.nbytes
        np.testing.assert_array_equal(buf, data[key])


def test_too_small_buffer_and_cancel(mesh3):
    req = mesh3[1].irecv(np.zeros(2, np.float32), 0, tag=7)
    mesh3[0].isend(np.ones(5, np.float32), 1, tag=7).wait()
    with pytest.raises(LightCCError, match="does not fit"):
        req.wait()
    pending = mesh3[2].irecv(np.zeros(4, np.float32), 0, tag=9)
    pending.cancel()
    assert pending.test()
    # a message for the cancelled tag goes to the next receive instead
    mesh3[0].isend(np.full(4, 3.0, np.float32), 2, tag=9).wait()
    buf = np.zeros(4, np.float32)
    mesh3[2].irecv(buf, 0, tag=9).wait()
    assert buf.tolist() == [3.0] * 4


def test_a_closed_peer_fails_waits_with_the_lost_rank_phrase():
    links = _mesh(2)
    try:
        req = links[1].irecv(np.zeros(8, np.float32), 0, tag=1)
        links[0].close()
        with pytest.raises(LightCCError, match="closed its connection"):
            req.wait()
        with pytest.raises(LightCCError, match="closed its connection"):
            links[1].irecv(np.zeros(8, np.float32), 0, tag=2).wait()
    finally:
        links[1].close()
