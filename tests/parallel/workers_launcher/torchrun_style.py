"""A script written for torchrun: rank and rendezvous from the environment only, any backend
(argv[1]); prints what it saw so the test can check lccrun exported torch's variables."""
import os
import sys

import torch
import torch.distributed as dist

names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
seen = {n: os.environ[n] for n in names}                # KeyError if lccrun did not set one
if sys.argv[1] == "lightcc":
    import lightcc.torch  # noqa: F401 - registers the backend
dist.init_process_group(sys.argv[1], init_method="env://")
t = torch.ones(3) * (int(seen["RANK"]) + 1)
dist.all_reduce(t)
assert dist.get_rank() == int(seen["RANK"]) and dist.get_world_size() == int(seen["WORLD_SIZE"])
print(f"rank {seen['RANK']}/{seen['WORLD_SIZE']} local {seen['LOCAL_RANK']}/"
      f"{seen['LOCAL_WORLD_SIZE']} sum {t[0].item():g} backend {dist.get_backend()}", flush=True)
dist.destroy_process_group()
