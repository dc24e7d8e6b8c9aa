"""Worker: two training steps of a small model with DistributedOptimizer under torch.profiler
(profiling every thread, as docs/timeline.md says); the engine's phases must appear as ranges
in the profiler's events and in its exported Chrome trace. Prints ``OK rank N`` and how many
``lightcc::negotiate`` ranges it recorded."""
from __future__ import annotations

import json
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import lightcc.torch as hvd

trace = sys.argv[1]
hvd.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
with profile(activities=[ProfilerActivity.CPU], experimental_config=config) as prof:
    for _ in range(2):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
names = {e.name for e in prof.events()}
want = {"lightcc::bucket", "lightcc::wire"}
assert want <= names, sorted(n for n in names if "lightcc" in n)
assert any(n in names for n in ("lightcc::pack", "lightcc::unpack")) or \
    len([e for e in prof.events() if e.name == "lightcc::bucket"]) >= 2, names
path = f"{trace}.rank{hvd.rank()}.json"
prof.export_chrome_trace(path)
with open(path) as fh:
    exported = {e.get("name") for e in json.load(fh)["traceEvents"]}
assert want <= exported, sorted(n for n in exported if n and "lightcc" in n)
# a thread waiting in step() for the agreement: at least one rank blocks for it (the test
# counts the ranks); in the exported trace too, and never around a bucket (it is a wait)
negotiate = [e for e in prof.events() if e.name == "lightcc::negotiate"]
assert ("lightcc::negotiate" in exported) == bool(negotiate), exported
buckets = [e for e in prof.events() if e.name == "lightcc::bucket"]
for n in negotiate:
    inside = [b for b in buckets if b.thread == n.thread and
              n.time_range.start <= b.time_range.start <= n.time_range.end]
    assert not inside, (n, inside)
print(f"NEGOTIATE rank {hvd.rank()}: {len(negotiate)}", flush=True)
# without a profiler: no range is opened (the probe says so)
from lightcc.common.observability import ranges
assert ranges.enter("lightcc::x") is None
print(f"OK rank {hvd.rank()}", flush=True)
hvd.shutdown()
