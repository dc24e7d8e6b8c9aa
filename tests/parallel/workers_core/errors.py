"""Cross-rank mismatches fail on every rank with a message naming both sides, and the engine
keeps working afterwards; local misuse raises at once (run under mpirun -np N >= 2)."""
from __future__ import annotations

import numpy as np

import lightcc as lcc
from lightcc import (DuplicateNameError, InvalidArgumentError, MismatchError,
                     UnsupportedDTypeError)

lcc.init()
R, N = lcc.rank(), lcc.size()


def expect(exc_type, fn, *needles):
    try:
        fn()
    except exc_type as exc:
        text = str(exc)
        for needle in needles:
            assert needle in text, f"{needle!r} not in {text!r}"
        assert isinstance(exc, RuntimeError) or isinstance(exc, (ValueError, TypeError))
        return exc
    raise AssertionError(f"expected {exc_type.__name__} from {fn}")


def works(tag: str) -> None:
    got = lcc.allreduce(np.full(3, float(R)), op=lcc.Sum, name=f"after.{tag}")
    assert np.allclose(got, sum(range(N))), got


shape = (10, 4) if R == 0 else (10, 5)
# reported by the negotiation itself (a MismatchError, not a StallError after a timeout)
exc = expect(MismatchError, lambda: lcc.allreduce(np.zeros(shape), name="fc1.weight"),
             "allreduce 'fc1.weight'", "(10, 5)", "(10, 4)")
assert not isinstance(exc, lcc.StallError), exc
works("shape")

dt = np.float32 if R == 0 else np.float64
expect(MismatchError, lambda: lcc.allreduce(np.zeros(3, dt), name="dt"), "dtype", "float64",
       "float32")
works("dtype")

expect(MismatchError, lambda: lcc.allreduce(np.zeros(3), op=lcc.Sum if R else lcc.Max,
                                            name="op"), "op")
expect(MismatchError, lambda: lcc.broadcast(np.zeros(2), root_rank=0 if R == 0 else 1,
                                            name="root"), "root rank")
expect(MismatchError, lambda: lcc.allreduce(np.zeros(2), name="pre",
                                            prescale_factor=1.0 + R), "prescale")
expect(MismatchError, lambda: lcc.allgather(np.zeros((2, 3 + R)), name="ag"),
       "shape after the first dimension")
if R == 0:
    expect(MismatchError, lambda: lcc.allreduce(np.zeros(2), name="kind"),
           "collective type differs")
else:
    expect(MismatchError, lambda: lcc.allgather(np.zeros(2), name="kind"),
           "collective type differs")
works("many")

# an async mismatch does not disturb a concurrent good collective
h_bad = lcc.allreduce_async(np.zeros(2 + R), name="bad.async")
h_good = lcc.allreduce_async(np.ones(2), op=lcc.Sum, name="good.async")
expect(MismatchError, lambda: lcc.synchronize(h_bad), "bad.async")
assert np.allclose(lcc.synchronize(h_good), N)

# local misuse raises at once, before anything is sent
h = lcc.allreduce_async(np.ones(1), name="dup")
expect(DuplicateNameError, lambda: lcc.allreduce_async(np.ones(1), name="dup"), "already in flight")
lcc.synchronize(h)
expect(UnsupportedDTypeError, lambda: lcc.allreduce(np.zeros(2, np.complex64)), "complex64")
expect(UnsupportedDTypeError, lambda: lcc.allreduce(np.zeros(2, bool), op=lcc.Average),
       "Average")
expect(InvalidArgumentError, lambda: lcc.allreduce(np.zeros(2), op="median"), "unknown op")
expect(InvalidArgumentError, lambda: lcc.allreduce(np.zeros(2, bool), op=lcc.Max,
                                                    prescale_factor=2.0), "numeric")
expect(InvalidArgumentError, lambda: lcc.broadcast(np.zeros(2), root_rank=N), "out of range")
expect(InvalidArgumentError, lambda: lcc.broadcast(np.zeros(2), root_rank=-1), "out of range")
expect(InvalidArgumentError, lambda: lcc.alltoall(np.zeros(4), splits=[1] * (N + 1)), "entries")
expect(InvalidArgumentError, lambda: lcc.alltoall(np.zeros(4), splits=[5] + [0] * (N - 1)),
       "sum to")
expect(InvalidArgumentError, lambda: lcc.alltoall(np.zeros(4), splits=[-1] + [0] * (N - 1)),
       "sum to")
expect(InvalidArgumentError, lambda: lcc.allgather(np.float32(3)), "0-d")
expect(InvalidArgumentError, lambda: lcc.reducescatter(np.zeros(2), op=lcc.Adasum), "Adasum")
expect(InvalidArgumentError, lambda: lcc.allreduce(np.zeros(2), name=5), "name")
expect(UnsupportedDTypeError, lambda: lcc.allreduce("text"), "expected a NumPy array")
works("local")

print(f"rank {R}: errors ok", flush=True)
lcc.shutdown()
