"""Run under lccrun: check that the flags' LCC_* values reached this rank and parse.

argv: expected values as NAME=VALUE pairs. Prints 'ENV-OK rank R of N' or exits 1.
"""
import os
import sys
import traceback

from mpi4py import MPI

from lightcc.common.config import load

comm = MPI.COMM_WORLD
problems = []
for pair in sys.argv[1:]:
    name, _, want = pair.partition("=")
    got = os.environ.get(name)
    if got != want:
        problems.append(f"{name}: got {got!r}, want {want!r}")
try:
    cfg = load()  # the values must also be valid for init()
except Exception as exc:  # noqa: BLE001
    problems.append(f"config.load() failed: {exc}")
else:
    if "LCC_FUSION_THRESHOLD" in os.environ and \
            cfg.fusion_threshold != int(os.environ["LCC_FUSION_THRESHOLD"]):
        problems.append(f"config fusion_threshold {cfg.fusion_threshold}")
if os.environ.get("LCC_RUNNER_STATUS_DIR") is None:
    problems.append("LCC_RUNNER_STATUS_DIR not set for a local rank")
if not any(f.filename.endswith(os.path.join("runner", "_rankwrap.py"))
           for f in traceback.extract_stack()):
    problems.append("rank was not started through the rank wrapper")
everyone = comm.allgather(problems)
if comm.rank == 0:
    for rank, probs in enumerate(everyone):
        for p in probs:
            print(f"rank {rank}: {p}", flush=True)
if problems:
    sys.exit(1)
print(f"ENV-OK rank {comm.rank} of {comm.size}", flush=True)
