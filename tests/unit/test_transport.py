"""The control plane (a TCP tree rooted at rank 0; a star up to fanout + 1 ranks) with several
ranks as threads of one process."""
from __future__ import annotations

import socket
import threading
import time

import pytest

from lightcc.common.control.transport import ControlPlane, candidate_addresses, interface_addresses
from lightcc.common.exceptions import LightCCError


class FakeComm:
    """Just enough of an mpi4py communicator for ControlPlane's bootstrap (bcast, allgather),
    shared by threads that play the ranks."""

    def __init__(self, shared: dict, rank: int, size: int) -> None:
        self.shared, self.rank, self.size = shared, rank, size

    def Get_rank(self) -> int:
        return self.rank

    def Get_size(self) -> int:
        return self.size

    def _exchange(self, tag: str, value):
        box = self.shared.setdefault(tag, {})
        box[self.rank] = value
        self.shared["barrier"].wait(30)
        return box

    def bcast(self, value, root=0):
        self.calls = getattr(self, "calls", 0) + 1
        return self._exchange(f"bcast{self.calls}", value)[root]

    def allgather(self, value):
        box = self._exchange("allgather", value)
        return [box[r] for r in range(self.size)]


def make_planes(n: int, hostnames=None, fanout: int = 4) -> list[ControlPlane]:
    shared = {"barrier": threading.Barrier(n)}
    planes: list = [None] * n
    errors: list = []

    def build(r: int) -> None:
        try:
            planes[r] = ControlPlane(FakeComm(shared, r, n), hostnames or ["h"] * n,
                                     fanout=fanout)
        except BaseException as exc:
            errors.append(exc)
            shared["barrier"].abort()

    threads = [threading.Thread(target=build, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return planes


def poll_until(plane: ControlPlane, count: int, timeout: float = 10.0) -> list:
    got: list = []
    deadline = time.monotonic() + timeout
    while len(got) < count and time.monotonic() < deadline:
        got += plane.poll(0.05)
    return got


def test_frames_reach_rank0_and_back_in_order():
    planes = make_planes(3)
    try:
        for r in (1, 2):
            for i in range(5):
                planes[r].send(0, f"{r}:{i}".encode())
        got = poll_until(planes[0], 10)
        by_src = {r: [p.decode() for s, p in got if s == r] for r in (1, 2)}
        assert by_src == {1: [f"1:{i}" for i in range(5)], 2: [f"2:{i}" for i in range(5)]}
        planes[0].send(2, b"batch")
        assert poll_until(planes[2], 1) == [(0, b"batch")]
    finally:
        for p in planes:
            p.close()


def test_a_tree_connects_each_rank_to_its_parent_and_children_only():
    planes = make_planes(7, fanout=2)           # 0 -> (1 -> 2, 3), (4 -> 5, 6)
    try:
        assert [p.parent for p in planes] == [None, 0, 1, 1, 0, 4, 4]
        assert planes[0].children == (1, 4) and planes[4].children == (5, 6)
        assert [sorted(p._conns) for p in planes] == [[1, 4], [0, 2, 3], [1], [1], [0, 5, 6],
                                                       [4], [4]]
        for r in (2, 3):                         # leaves to their parent, in order
            for i in range(3):
                planes[r].send(1, f"{r}:{i}".encode())
        got = poll_until(planes[1], 6)
        assert [p.decode() for s, p in got if s == 2] == ["2:0", "2:1", "2:2"]
        assert [p.decode() for s, p in got if s == 3] == ["3:0", "3:1", "3:2"]
        planes[0].send(4, b"down")
        planes[0].send(2, b"not a neighbour")   # no connection: dropped, not delivered
        assert poll_until(planes[4], 1) == [(0, b"down")]
        assert poll_until(planes[2], 1, timeout=0.5) == []
        planes[4].close()                         # a relay leaves: both sides see it
        deadline = time.monotonic() + 10
        while not (4 in planes[0].closed and 4 in planes[5].closed) and \
                time.monotonic() < deadline:
            planes[0].poll(0.05)
            planes[5].poll(0.05)
        assert planes[0].closed == {4} and planes[5].closed == {4}
    finally:
        for p in planes:
            p.close()


def test_large_frames_survive_partial_reads_and_writes():
    planes = make_planes(2)
    try:
        big = bytes(range(256)) * (3 * 4096 + 7)        # ~3 MB, more than one socket buffer
        for _ in range(3):
            planes[1].send(0, big)
        got: list = []
        deadline = time.monotonic() + 20
        while len(got) < 3 and time.monotonic() < deadline:
            planes[1].poll(0.0)                         # flushes what the socket refused
            got += planes[0].poll(0.05)
        assert [p for _, p in got] == [big] * 3
    finally:
        for p in planes:
            p.close()


@pytest.mark.timeout(120)
def test_wake_interrupts_a_blocked_poll_and_wait():
    planes = make_planes(2)
    try:
        # blocked far longer than the test's timeout: only the wake can end these calls
        for blocker in (lambda: planes[0].poll(3600.0), lambda: planes[0].wait(3600.0)):
            threading.Timer(0.2, planes[0].wake).start()
            blocker()
        # repeated wakes before anyone blocks leave at most a spurious early return (a lower
        # bound on the wait: a loaded machine can only make it longer, never fail it)
        planes[0].wake()
        planes[0].wake()
        planes[0].poll(0.0)
        t0 = time.monotonic()
        assert planes[0].poll(0.3) == []
        assert time.monotonic() - t0 >= 0.25
    finally:
        for p in planes:
            p.close()


def test_a_peer_that_closes_is_reported():
    planes = make_planes(3)
    try:
        planes[2].close()
        deadline = time.monotonic() + 10
        while 2 not in planes[0].closed and time.monotonic() < deadline:
            planes[0].poll(0.05)
        assert planes[0].closed == {2}
        planes[0].send(2, b"lost")                      # sending to a gone peer is a no-op
        planes[0].close()
        deadline = time.monotonic() + 10
        while 0 not in planes[1].closed and time.monotonic() < deadline:
            planes[1].poll(0.05)
        assert planes[1].closed == {0}
    finally:
        planes[1].close()


def test_stray_connections_are_ignored():
    """A connection with the wrong token reaches rank 0's listener before rank 1's own."""
    class StrayComm(FakeComm):
        def allgather(self, value):
            out = super().allgather(value)
            if not hasattr(self, "stray") and isinstance(out[0], tuple):   # rank 0's port
                self.stray = socket.create_connection(("127.0.0.1", out[0][0]))
                self.stray.sendall(b"x" * 12)
            return out

    shared = {"barrier": threading.Barrier(2)}
    planes: list = [None, None]
    comms = [FakeComm(shared, 0, 2), StrayComm(shared, 1, 2)]
    threads = [threading.Thread(target=lambda r=r: planes.__setitem__(
        r, ControlPlane(comms[r], ["h", "h"]))) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    try:
        assert hasattr(comms[1], "stray")
        planes[1].send(0, b"ok")
        assert poll_until(planes[0], 1) == [(1, b"ok")]
    finally:
        comms[1].stray.close()
        for p in planes:
            p.close()


def test_unreachable_rank0_fails_on_every_rank_with_a_clear_error(monkeypatch):
    from lightcc.common.control import transport

    monkeypatch.setattr(transport, "ACCEPT_TIMEOUT_S", 1.0)
    monkeypatch.setattr(transport, "CONNECT_TIMEOUT_S", 0.5)
    # other "hosts" get an address nothing listens on
    monkeypatch.setattr(transport, "candidate_addresses", lambda override="": ["192.0.2.1"])   # TEST-NET-1
    shared = {"barrier": threading.Barrier(2)}
    errors: list = [None, None]

    def build(r: int) -> None:
        try:
            ControlPlane(FakeComm(shared, r, 2), ["a", "b"])
        except LightCCError as exc:
            errors[r] = exc

    threads = [threading.Thread(target=build, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(isinstance(e, LightCCError) for e in errors), errors
    assert "failed on ranks [1]" in str(errors[0]) and "LCC_CONTROL_ADDR" in str(errors[0])


def test_interface_addresses_include_loopback_and_override_by_name():
    ifaces = interface_addresses()
    if "lo" not in ifaces:
        pytest.skip("no loopback interface visible")
    assert ifaces["lo"].startswith("127.")
    assert candidate_addresses("lo") == [ifaces["lo"]]
    assert all(not a.startswith("127.") for a in candidate_addresses())
