"""Worker: named allreduces (some fused, some fp16-compressed) on 2 ranks, then the metrics
checked against counts computed here, and rank 0's TensorBoard scalars read back from the event
file with TensorBoard's own reader. Prints ``OK rank N``."""
from __future__ import annotations

import sys

import numpy as np
import torch
from torch.utils.tensorboard import SummaryWriter

import lightcc.torch as hvd

logdir = sys.argv[1]
hvd.init()
rank, size = hvd.rank(), hvd.size()
sizes = [1000, 3000, 20000]
expected_payload = 0
steps = 4
log = None
if rank == 0:
    writer = SummaryWriter(log_dir=logdir)
    log = hvd.metrics_writer(writer)
for step in range(steps):
    handles = [hvd.allreduce_async(torch.full((n,), float(rank + 1)), name=f"g{i}")
               for i, n in enumerate(sizes)]
    outs = [hvd.synchronize(h) for h in handles]
    for out in outs:   # average of 1 and 2
        assert torch.allclose(out, torch.full_like(out, 1.5)), out[:4]
    expected_payload += sum(n * 4 for n in sizes)
    comp = hvd.allreduce(torch.full((50000,), 1.0), name="c", compression=hvd.Compression.fp16)
    assert torch.allclose(comp, torch.ones_like(comp))
    expected_payload += 50000 * 4
    if log is not None:
        written = log(step)
m = hvd.metrics()
assert m["collectives"] == steps * (len(sizes) + 1), m
assert m["collectives_by_type"] == {"allreduce": steps * (len(sizes) + 1)}, m
assert m["payload_bytes"] == expected_payload, (m["payload_bytes"], expected_payload)
assert 1 <= m["buckets"] <= m["collectives"]
assert m["wire"]["world"]["bytes_sent"] > 0 and m["bytes_sent"] >= m["wire"]["world"]["bytes_sent"]
# fp16 halves the bytes of its buckets: the ratio is above 1, below 2
assert 1.0 < m["compression_ratio"] < 2.0, m["compression_ratio"]
assert m["stalls"] == 0 and m["errors"] == 0
assert m["negotiation_s"] >= 0 and m["execute_s"] > 0
if rank == 0:
    writer.flush()
    writer.close()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(logdir)
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert "lightcc/collectives" in tags and "lightcc/wire/world/bytes_sent" in tags, tags
    got = [(e.step, e.value) for e in acc.Scalars("lightcc/payload_bytes")]
    assert [s for s, _ in got] == list(range(steps)), got
    # the last logged value is what the callback wrote at the last step
    assert got[-1][1] == written["lightcc/payload_bytes"], (got, written)
    assert got[-1][1] == expected_payload, (got, expected_payload)
    coll = [e.value for e in acc.Scalars("lightcc/collectives")]
    assert coll == [float((s + 1) * (len(sizes) + 1)) for s in range(steps)], coll
print(f"OK rank {rank}", flush=True)
hvd.shutdown()
