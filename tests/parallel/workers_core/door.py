"""The public door the torch layer uses (lightcc.common.api): prepared allreduces, compressor
state, process-set queries, ``wake``, and backends.mpi's bootstrap and point-to-point calls.
Results are checked against NumPy references; errors against allreduce_async's own (run under
mpirun -np N >= 2)."""
from __future__ import annotations

import numpy as np

import lightcc as lcc
from lightcc import InvalidArgumentError, NotInitializedError, UnsupportedDTypeError
from lightcc.common import api
from lightcc.common.backends import mpi as bmpi
from lightcc.common.control.messages import Coll


def expect(exc_type, fn, *needles):
    try:
        fn()
    except exc_type as exc:
        for needle in needles:
            assert needle in str(exc), f"{needle!r} not in {str(exc)!r}"
        return str(exc)
    raise AssertionError(f"expected {exc_type} from {fn}")


x0 = np.ones(4, np.float32)
for fn in (lambda: api.prepare_allreduce(x0, name="x"), lambda: api.compressor(None, "fp16"),
           lambda: api.process_set_ranks(), lambda: api.process_set_rank(),
           lambda: api.root_index(0), lambda: api.auto_name("allreduce")):
    expect(NotInitializedError, fn, "not initialized")

lcc.init()
R, N = lcc.rank(), lcc.size()

# ---- prepared allreduce: validated once, submitted many times --------------------------------
rng = np.random.default_rng(1234)
data = rng.standard_normal((3, N, 5, 3)).astype(np.float32)    # [step, rank, ...]
buf = np.empty((5, 3), np.float32)
prep = api.prepare_allreduce(buf, lcc.Average, "door.grad")
assert prep.name == "door.grad"
for step in range(3):
    buf[...] = data[step, R]
    assert prep.fits(buf)
    got = lcc.synchronize(prep.submit(buf, buf))
    assert got is buf
    assert np.allclose(buf, data[step].mean(axis=0), atol=1e-6), (step, buf)

# scale factors and sum, result into a separate out
sprep = api.prepare_allreduce(buf, lcc.Sum, "door.scaled", prescale_factor=2.0,
                              postscale_factor=0.25)
out = np.empty_like(buf)
buf[...] = data[0, R]
lcc.synchronize(sprep.submit(buf, out))
assert np.allclose(out, data[0].sum(axis=0) * 0.5, atol=1e-5), out

# unnamed: matched by position on the allreduce stream, every submit a new position
uprep = api.prepare_allreduce(np.zeros(2, np.int64), lcc.Sum)
for k in range(3):
    v = np.array([R + k, 1], np.int64)
    assert np.array_equal(lcc.synchronize(uprep.submit(v, v, wake=False)),
                          [sum(range(N)) + N * k, N])

# fits: shape, dtype and kind must match
assert not prep.fits(np.empty((3, 5), np.float32))
assert not prep.fits(np.empty((5, 3), np.float64))
assert not prep.fits([[0.0] * 3] * 5)

# the same errors as allreduce_async, raised at preparation
bad = [dict(op="nope"), dict(name=7), dict(compression="zip"),
       dict(prescale_factor=0.5, op=lcc.BitwiseAnd), dict(op=lcc.BitwiseAnd),
       dict(process_set=api.ProcessSet([0]))]
for kw in bad:
    arr = np.ones(3, bool if kw.get("op") == lcc.BitwiseAnd else np.float32)
    if "prescale_factor" not in kw and kw.get("op") == lcc.BitwiseAnd:
        arr = arr.astype(np.float32)          # a bitwise op on floats
    kw = {"name": "door.bad", **kw}
    errors = (InvalidArgumentError, UnsupportedDTypeError)
    t1 = expect(errors, lambda: api.prepare_allreduce(arr, **kw))
    t2 = expect(errors, lambda: lcc.allreduce_async(arr, **kw))
    assert t1 == t2, (t1, t2)
expect(UnsupportedDTypeError, lambda: api.prepare_allreduce(np.array(["a"], object)), "dtype")
expect(InvalidArgumentError, lambda: api.prepare_allreduce(np.ones(2), process_set=99),
       "process set 99")

# ---- compressor state ------------------------------------------------------------------------
assert api.compressor(None, None) is None and api.compressor(None, "none") is None
assert api.compressor(None, "topk:0.5") is None           # none made yet, create=False
big = np.arange(8192, dtype=np.float32) * (R + 1)
lcc.allreduce(big, name="door.topk", compression="topk:0.5")
comp = api.compressor(None, "topk:0.5")
assert comp is not None and api.compressor(None, "topk:0.5", create=True) is comp
made = api.compressor(None, "fp16", create=True)
assert made is not None and api.compressor(None, lcc.Compression.fp16) is made
expect(InvalidArgumentError, lambda: api.compressor(None, "zip"), "zip")

# ---- process-set queries ---------------------------------------------------------------------
assert api.process_set_ranks() == tuple(range(N)) and api.process_set_rank() == R
ps = lcc.add_process_set([0, 1])
assert api.process_set_ranks(ps) == (0, 1)
assert api.process_set_rank(ps) == (R if R < 2 else -1)
assert api.root_index(1, ps) == 1 and api.root_index(N - 1) == N - 1
expect(InvalidArgumentError, lambda: api.root_index(N, None, "bcast 'w'"), "bcast 'w'",
       f"root_rank {N} is out of range")
expect(InvalidArgumentError, lambda: api.root_index("0"), "must be an int")
expect(InvalidArgumentError, lambda: api.root_index(True), "must be an int")
if N > 2:
    expect(InvalidArgumentError, lambda: api.root_index(2, ps), "not a member")
first = api.auto_name("allreduce")
assert first.startswith("allreduce.noname.")
n0 = int(first.rsplit(".", 1)[1])
assert api.auto_name(Coll.ALLREDUCE) == f"allreduce.noname.{n0 + 1}"
assert api.auto_name("broadcast", ps).startswith("broadcast.noname.")
expect(InvalidArgumentError, lambda: api.auto_name("bogus"), "bogus")
expect(InvalidArgumentError, lambda: api.process_set_ranks(99), "process set 99")

# ---- wake (public) and _wake (deprecated alias) ----------------------------------------------
for kw in ({"wake": False}, {"wake": True}, {"_wake": False}):
    h = lcc.allreduce_async(np.full(2, float(R)), lcc.Sum, name="door.wake", **kw)
    assert np.allclose(lcc.synchronize(h), sum(range(N)))
    h = lcc.broadcast_async(np.full(2, float(R)), 0, name="door.wb", **kw)
    assert np.allclose(lcc.synchronize(h), 0.0)
lcc.barrier()

# ---- backends.mpi: bootstrap and point-to-point ----------------------------------------------
from mpi4py import MPI  # noqa: E402  (the reference, independent of backends.mpi)

assert bmpi.thread_multiple() == (MPI.Query_thread() == MPI.THREAD_MULTIPLE)
assert bmpi.world_rank_size() == (MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size())
assert bmpi.world_bcast({"from": R, "n": [R] * 3}) == {"from": 0, "n": [0, 0, 0]}
assert bmpi.max_tag() >= 32767
comm = bmpi.p2p_communicator(None)
if comm is not None:
    assert (comm.rank, comm.size) == (R, N)
    send = np.arange(6, dtype=np.float64) + 10 * R
    recv = np.full(6, -1.0)
    rreq = comm.irecv(recv, None, 5)              # from any rank
    sreq = comm.isend(send, (R + 1) % N, 5)
    rreq.wait()
    sreq.wait()
    left = (R - 1) % N
    assert rreq.source == left and rreq.nbytes == 48, (rreq.source, rreq.nbytes)
    assert np.array_equal(recv, np.arange(6) + 10 * left), recv
    late = comm.irecv(np.empty(1), left, 99)      # nobody sends tag 99
    assert not late.test()
    late.cancel()
    comm.barrier()
    comm.free()
    pair = bmpi.p2p_communicator([0, 1]) if R < 2 else None
    if pair is not None:
        assert (pair.rank, pair.size) == (R, 2)
        one = np.array([R], np.int32)
        other = np.empty(1, np.int32)
        reqs = [pair.isend(one, 1 - R, 1), pair.irecv(other, 1 - R, 1)]
        while not all(r.test() for r in reqs):
            pass
        assert other[0] == 1 - R and reqs[1].source == 1 - R
        pair.free()

# ---- after shutdown and re-init, a prepared request no longer fits ---------------------------
lcc.shutdown()
assert not prep.fits(buf)
lcc.init()
assert not prep.fits(buf)
again = api.prepare_allreduce(buf, lcc.Sum, "door.again")
assert again.fits(buf)
buf[...] = R
assert np.allclose(lcc.synchronize(again.submit(buf, buf)), sum(range(N)))
lcc.shutdown()
print(f"rank {R}: door ok", flush=True)
