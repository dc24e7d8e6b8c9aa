"""Negotiation during a long exchange (Negotiation.pump through Communicator.progress): a tensor
submitted while a pipelined fp16 bucket is being exchanged is sent to the coordinator from
inside that exchange, not after it, and both results are right. Prints ``pump ok``."""
from __future__ import annotations

import numpy as np

import lightcc as lcc
from lightcc.common import api
from lightcc.common.compression import twophase

twophase.PIECE_BYTES = 4096            # many pieces: the hook runs between them
lcc.init()
R, N = lcc.rank(), lcc.size()
eng = api.engine()
real_pump = eng.negotiation.pump
seen: dict = {}
b_in = np.full(1000, float(R + 1), np.float32)


def spy() -> None:
    """At the first piece boundary: submit B (as backward would), then let the engine pump."""
    if "b" not in seen:
        seen["b"] = lcc.allreduce_async(b_in, op=lcc.Sum, name="pump.b")
        seen["queued"] = len(eng.submissions.queue)
        real_pump()
        entry = eng.submissions.inflight.get(seen["b"].request.key)
        seen["sent_inside"] = entry is not None and entry.sent_at > 0.0 and not eng.submissions.queue
        seen["a_done_then"] = seen["a"].done()
        return
    real_pump()


for group in eng.groups.values():
    group.progress = spy
    group.apply(group.settings)          # pushes the hook to the group's communicators
rng = np.random.default_rng(R)
a_in = rng.standard_normal(200_000).astype(np.float32)
seen["a"] = lcc.allreduce_async(a_in, op=lcc.Sum, name="pump.a", compression="fp16")
a = lcc.synchronize(seen["a"])
b = lcc.synchronize(seen["b"])
assert seen["queued"] >= 1, seen
assert seen["sent_inside"], "B was not sent to the coordinator from inside A's exchange"
assert not seen["a_done_then"], "the hook ran after A had completed"
want = sum(np.random.default_rng(r).standard_normal(200_000).astype(np.float32)
           .astype(np.float16).astype(np.float32) for r in range(N))
assert np.abs(a - want).max() <= 2e-3 * np.abs(want).max(), np.abs(a - want).max()
assert np.array_equal(b, np.full(1000, N * (N + 1) / 2, np.float32)), b[:4]
for group in eng.groups.values():
    group.progress = real_pump
    group.apply(group.settings)
print(f"pump ok {R}", flush=True)
lcc.shutdown()
