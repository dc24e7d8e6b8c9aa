"""Collectives completed by the background thread alone (nobody waits on the handle; a thread
waits on an event that the handle's done-callback sets, as a torch future does). Every one must
complete, and the background thread must never sleep out its timeout with such work queued
(a lost wake-up made about 20 % of these wait a full second). Prints ``background ok``."""
from __future__ import annotations

import threading

import numpy as np

import lightcc as lcc
from lightcc.common import api

lcc.init()
R, N = lcc.rank(), lcc.size()
a = np.ones(100, np.float32)
for i in range(300):
    ev = threading.Event()
    h = lcc.allreduce_async(a, op=lcc.Sum, ordered=True)
    h.add_done_callback(lambda _h, ev=ev: ev.set())
    assert ev.wait(120), f"collective {i} never completed"
    assert np.all(h.wait() == N)
assert api.engine().missed_wakeups == 0, api.engine().missed_wakeups
print(f"background ok {R}", flush=True)
lcc.shutdown()
