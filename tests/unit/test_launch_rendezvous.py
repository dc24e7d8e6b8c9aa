"""The MPI-free start in one process: ranks as threads over lightcc's own store, the launch
rule, and the TCP communicator's collectives against NumPy references."""
from __future__ import annotations

import logging
import pickle
import socket
import threading
import time

import numpy as np
import pytest

from lightcc.common.backends import kvstore, launch, rendezvous
from lightcc.common.backends.tcpcomm import TCPCommunicator
from lightcc.common.exceptions import ConfigError, LightCCError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ranks(size, body, timeout=30.0, stores=None):
    """Run ``body(rank, store)`` on ``size`` threads sharing one lightcc store; results by
    rank (an exception is returned in place of a result)."""
    port = _free_port()
    master = kvstore.LightStore("127.0.0.1", port, True, timeout)
    out: dict[int, object] = {}
    prefix = rendezvous.next_prefix()

    def run(rank):
        store = master if rank == 0 else kvstore.LightStore("127.0.0.1", port, False, timeout)
        try:
            out[rank] = body(rank, store, prefix)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out[rank] = exc
    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 10)
    master.close()
    return out


def _world(rank, store, size, prefix, timeout=20.0):
    links, hosts, _ = rendezvous.connect(store, rank, size, timeout, prefix=prefix)
    comm = TCPCommunicator(links, range(size), "world")
    comm.owns_mesh = True
    return comm


# ---- the rule -------------------------------------------------------------------------------
@pytest.mark.parametrize("env,given,want", [
    ({"OMPI_COMM_WORLD_SIZE": "2", "RANK": "0", "WORLD_SIZE": "2"}, (False, False), "mpi"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, (False, False), "tcp"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, (False, False), "tcp"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "PMIX_RANK": "0"}, (False, False), "mpi"),
    ({}, (False, False), "mpi"),
    ({}, (False, True), "tcp"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, (True, False), "mpi"),
])
def test_transport_rule(env, given, want):
    assert launch.choose_transport("auto", *given, env=env)[0] == want


def test_forced_transport_wins():
    env = {"OMPI_COMM_WORLD_SIZE": "2"}
    assert launch.choose_transport("tcp", False, False, env=env)[0] == "tcp"
    assert launch.choose_transport("mpi", False, True, env={"RANK": "0", "WORLD_SIZE": "2"})[0] \
        == "mpi"


def test_bad_transport_value_is_a_config_error(monkeypatch):
    from lightcc.common import config
    monkeypatch.setenv("LCC_TRANSPORT", "carrier-pigeon")
    with pytest.raises(ConfigError, match="LCC_TRANSPORT"):
        config.load()


def test_slurm_variables_and_first_host():
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1",
           "SLURM_JOB_NODELIST": "gpu[07-09,12],cpu1", "SLURM_JOB_ID": "12345"}
    got = launch.from_environment(env)
    assert (got.rank, got.size, got.local_rank) == (3, 4, 1)
    assert got.master_addr == "gpu07" and got.master_port == launch.SLURM_BASE_PORT + 345
    assert launch.first_host("node1") == "node1"
    assert launch.first_host("a[3-4]") == "a3"


def test_torchrun_variables_and_rank_out_of_range():
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1234",
           "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    got = launch.from_environment(env)
    assert (got.rank, got.size, got.master_addr, got.master_port) == (1, 2, "h", 1234)
    with pytest.raises(ConfigError, match="rank 2 is not in 0..1"):
        launch.from_environment(dict(env, RANK="2"))


# ---- the store and the rendezvous -----------------------------------------------------------
def test_light_store_set_get_add_check():
    port = _free_port()
    a = kvstore.LightStore("127.0.0.1", port, True, 5.0)
    b = kvstore.LightStore("127.0.0.1", port, False, 0.5)
    assert a.add("n", 2) == 2 and b.add("n", 3) == 5
    assert not b.check(["k"])
    a.set("k", b"v")
    assert b.check(["k"]) and b.get("k") == b"v"
    with pytest.raises(TimeoutError):
        b.get("missing")
    b.close()
    a.close()


def test_unreachable_store_names_the_address():
    port = _free_port()
    with pytest.raises(LightCCError, match=f"127.0.0.1:{port}"):
        kvstore.LightStore("127.0.0.1", port, False, 1.0)


def test_missing_rank_is_named_within_the_timeout():
    out = _run_ranks(2, lambda r, s, p: rendezvous.connect(s, r, 3, 2.0, where="here", prefix=p))
    for r in (0, 1):
        assert isinstance(out[r], LightCCError), out
        assert "ranks [2] of world size 3" in str(out[r])


def test_duplicate_rank_is_named():
    out = _run_ranks(3, lambda r, s, p: rendezvous.connect(s, min(r, 1), 3, 3.0, where="here",
                                                              prefix=p))
    errors = [str(e) for e in out.values() if isinstance(e, LightCCError)]
    assert len(errors) == 3 and all("RANK=1" in e for e in errors), out


def test_world_size_disagreement_is_named():
    out = _run_ranks(2, lambda r, s, p: rendezvous.connect(s, r, 2 if r == 0 else 3, 2.0,
                                                              prefix=p))
    assert all(isinstance(e, LightCCError) for e in out.values()), out
    assert "ranks [1] have [3]" in str(out[0]), out


def test_a_stranger_is_dropped_and_logged(caplog):
    """A connection without the job's secret, made to rank 0's data listener before rank 1
    arrives, is logged and closed; the job's links still carry its data."""
    port = _free_port()
    master = kvstore.LightStore("127.0.0.1", port, True, 20.0)
    out: dict = {}
    prefix = rendezvous.next_prefix()

    def rank(r, store):
        comm = _world(r, store, 2, prefix)
        buf = np.full(5, r + 1.0)
        comm.allreduce(buf)
        out[r] = buf
        comm.free()
    t0 = threading.Thread(target=rank, args=(0, master), daemon=True)
    with caplog.at_level(logging.WARNING, logger="lightcc"):
        t0.start()
        key = f"{prefix}addr/0"
        while not master.check([key]):
            time.sleep(0.01)
        listen_port = pickle.loads(master.get(key))[0]
        stranger = socket.create_connection(("127.0.0.1", listen_port))
        stranger.sendall(b"GET / HTTP/1.0\r\n\r\n")
        time.sleep(0.3)
        other = kvstore.LightStore("127.0.0.1", port, False, 20.0)
        t1 = threading.Thread(target=rank, args=(1, other), daemon=True)
        t1.start()
        t0.join(30)
        t1.join(30)
    stranger.close()
    master.close()
    assert np.array_equal(out[0], np.full(5, 3.0)) and np.array_equal(out[1], out[0])
    assert any("dropped a connection" in m for m in caplog.messages), caplog.messages


# ---- collectives against NumPy --------------------------------------------------------------
def _data(rank, n, dtype, seed=0):
    return (np.random.default_rng(seed * 100 + rank).standard_normal(n) * 10).astype(dtype)


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("n", [1, 7, 40000])       # below and above SMALL_BYTES
def test_collectives_match_numpy(size, n):
    def body(rank, store, prefix):
        comm = _world(rank, store, size, prefix)
        got = {}
        for op, ref in (("sum", np.sum), ("max", np.max), ("min", np.min)):
            buf = _data(rank, n, np.float64)
            comm.allreduce(buf, op)
            got[op] = buf
        ints = np.arange(n, dtype=np.int32) * (rank + 1)
        comm.allreduce(ints, "bxor")
        got["bxor"] = ints
        counts = [n + r for r in range(size)]
        gathered = np.empty(sum(counts), np.float32)
        comm.allgatherv(_data(rank, counts[rank], np.float32), gathered, counts)
        got["allgather"] = gathered
        rs = np.empty(counts[rank], np.float64)
        comm.reduce_scatterv(_data(rank, sum(counts), np.float64, 1), rs, counts)
        got["reduce_scatter"] = rs
        sendcounts = [(rank + 1) * (d + 1) for d in range(size)]
        recvcounts = [(s + 1) * (rank + 1) for s in range(size)]
        send = np.arange(sum(sendcounts), dtype=np.int64) + 1000 * rank
        recv = np.empty(sum(recvcounts), np.int64)
        comm.alltoallv(send, sendcounts, recv, recvcounts)
        got["alltoall"] = recv
        b = _data(rank, n, np.float16)
        comm.bcast(b, size - 1)
        got["bcast"] = b
        comm.barrier()
        sub = comm.split(rank % 2, -rank, "odd-even")
        s = np.array([rank], np.int64)
        sub.allreduce(s)
        got["split"] = (sub.rank, sub.size, int(s[0]))
        got["objects"] = comm.allgather_object({"r": rank})
        comm.free()
        return got

    out = _run_ranks(size, body)
    for rank in range(size):
        got = out[rank]
        assert isinstance(got, dict), got
        every = [_data(r, n, np.float64) for r in range(size)]
        np.testing.assert_allclose(got["sum"], np.sum(every, axis=0), rtol=1e-12)
        np.testing.assert_array_equal(got["max"], np.max(every, axis=0))
        np.testing.assert_array_equal(got["min"], np.min(every, axis=0))
        x = np.zeros(n, np.int32)
        for r in range(size):
            x ^= np.arange(n, dtype=np.int32) * (r + 1)
        np.testing.assert_array_equal(got["bxor"], x)
        counts = [n + r for r in range(size)]
        np.testing.assert_array_equal(
            got["allgather"], np.concatenate([_data(r, counts[r], np.float32)
                                              for r in range(size)]))
        full = np.sum([_data(r, sum(counts), np.float64, 1) for r in range(size)], axis=0)
        start = sum(counts[:rank])
        np.testing.assert_allclose(got["reduce_scatter"], full[start:start + counts[rank]],
                                   rtol=1e-12)
        expect = []
        for s in range(size):
            sc = [(s + 1) * (d + 1) for d in range(size)]
            block = np.arange(sum(sc), dtype=np.int64) + 1000 * s
            expect.append(block[sum(sc[:rank]):sum(sc[:rank]) + sc[rank]])
        np.testing.assert_array_equal(got["alltoall"], np.concatenate(expect))
        np.testing.assert_array_equal(got["bcast"], _data(size - 1, n, np.float16))
        same = [r for r in range(size) if r % 2 == rank % 2]
        assert got["split"] == (sorted(same, reverse=True).index(rank), len(same), sum(same))
        assert got["objects"] == [{"r": r} for r in range(size)]
    # every rank holds the same bits of the sum (the owner reduced each block)
    assert all(np.array_equal(out[0]["sum"], out[r]["sum"]) for r in range(size))


def test_rank_0_names_the_ranks_it_waits_for_while_it_waits(caplog, monkeypatch):
    """Issue 38 item 1 without lccrun: while ranks are missing, rank 0 logs how many arrived
    and which it waits for, every PROGRESS_S seconds, before the timeout's error."""
    monkeypatch.setattr(rendezvous, "PROGRESS_S", 0.4)
    with caplog.at_level("WARNING", logger="lightcc"):
        out = _run_ranks(2, lambda r, s, p: rendezvous.connect(s, r, 3, 2.5, where="here",
                                                                  prefix=p))
    assert all(isinstance(out[r], LightCCError) for r in (0, 1)), out
    lines = [rec.getMessage() for rec in caplog.records if "ranks arrived" in rec.getMessage()]
    assert len(lines) >= 3, lines                 # 2.5 s of waiting, a line every 0.4 s
    assert all("rendezvous at here: 2/3 ranks arrived after" in ln and
               ln.endswith("waiting for ranks [2]") for ln in lines), lines
