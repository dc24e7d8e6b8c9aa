"""lightcc's DDP hooks on scikit-learn's digits: DDP on the "lightcc" backend (2 ranks), a
64-128-10 ReLU MLP (He initialization), each hook against no hook with the same seeds, same
bars as DistributedOptimizer's compressors (mean test accuracy drop over seeds, points):
fp16/bf16/fp8 0.5, TopK 1 % + error feedback 1.5, PowerSGD 1.0 (margins: test_c10d.py). CI
runs 2 seeds a hook (CONV_SEED_SCALE=0.1); benchmarks/convergence/run.py ddp-hooks runs them all.
Also: parameters bitwise identical on every rank, the hook state's residuals, a hook state for
another compressor is refused. (Hooks on DDP over gloo: c10d_ddp.py.)
"""
from __future__ import annotations

import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from sklearn.datasets import load_digits
from torch.nn.parallel import DistributedDataParallel as DDP

import lightcc
import lightcc.torch  # noqa: F401 - registers the backend
from common import check, raises, run
from lightcc.torch import ddp_hooks

R = N = 0
STEPS, BATCH, LR, MOMENTUM = 300, 64, 0.1, 0.9
HIDDEN = 128
# kind -> (allowed mean accuracy drop in points, seeds): TopK's drop varies most from seed to
# seed, so it gets the most seeds (CONV_SEED_SCALE scales them all, for measuring the margins)
SCALE = float(os.environ.get("CONV_SEED_SCALE", "1"))
BARS = {"none": (0.0, 20), "fp16": (0.5, 4), "bf16": (0.5, 4), "fp8": (0.5, 4),
        "fp8_e5m2": (0.5, 4), "topk": (1.5, 20), "powersgd": (1.0, 6)}
BARS = {k: (bar, max(2, round(seeds * SCALE))) for k, (bar, seeds) in BARS.items()}

digits = load_digits()
X = torch.tensor(digits.data / 16.0, dtype=torch.float32)
Y = torch.tensor(digits.target)
perm = np.random.default_rng(123).permutation(len(X))
TRAIN, TEST = perm[:1437], perm[1437:]
RESULTS: dict[str, np.ndarray] = {}


def train(kind: str, seed: int) -> tuple[float, ddp_hooks.HookState | None,
                                         list[torch.Tensor]]:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(64, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 10))
    for layer in (net[0], net[2]):              # He initialization (ReLU), zero biases
        nn.init.kaiming_normal_(layer.weight)
        nn.init.zeros_(layer.bias)
    model = DDP(net)
    state = None if kind == "none" else ddp_hooks.register(model, kind)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    rng = np.random.default_rng(seed)
    for _ in range(STEPS):
        batch = TRAIN[rng.integers(0, len(TRAIN), BATCH)]
        mine = np.array_split(batch, N)[R]
        opt.zero_grad()
        nn.functional.cross_entropy(model(X[mine]), Y[mine]).backward()
        opt.step()
    with torch.no_grad():
        acc = (model(X[TEST]).argmax(1) == Y[TEST]).float().mean().item() * 100
    return acc, state, [p.detach().clone() for p in model.parameters()]


def identical(params: list[torch.Tensor], what: str) -> None:
    flat = torch.cat([p.reshape(-1) for p in params])
    outs = [torch.empty_like(flat) for _ in range(N)]
    dist.all_gather(outs, flat)
    check(all(torch.equal(outs[0], o) for o in outs), f"{what}: parameters differ by rank")


def case_init():
    global R, N
    dist.init_process_group("lightcc")
    R, N = dist.get_rank(), dist.get_world_size()


def case_hooks_within_bars():
    for kind, (_, seeds) in BARS.items():
        runs = [train(kind, s) for s in range(seeds)]
        RESULTS[kind] = np.array([acc for acc, _, _ in runs])
        identical(runs[-1][2], kind)
        state = runs[-1][1]
        if state is not None:
            check(state.steps == STEPS, f"{kind}: hook ran {state.steps} times")
    base = RESULTS["none"]
    drops = {k: base[:len(a)] - a for k, a in RESULTS.items()}   # paired by seed
    failed = [k for k, (bar, _) in BARS.items() if drops[k].mean() > bar]
    if R == 0:
        for kind, d in drops.items():
            print(f"hook {kind:9s} accuracy {RESULTS[kind].mean():6.2f} drop {d.mean():5.2f} "
                  f"sd {d.std(ddof=1):4.2f} over {len(d)} seeds (bar {BARS[kind][0]})",
                  flush=True)
    check(not failed, f"accuracy bars missed by {failed}: {drops}")


def case_state_and_errors():
    _, state, _ = train("topk", 0)
    saved = state.state_dict()
    residuals = saved["state"]["residuals"]
    # per parameter, by name (those of 4096 bytes or more: the two weight matrices)
    keys = sorted(residuals)
    check(keys == [f"{state.name}:0.weight", f"{state.name}:2.weight"], f"residual keys {keys}")
    check(all(np.abs(r).sum() > 0 for r in residuals.values()), "a TopK residual is empty")
    state.load_state_dict(saved)
    check(state.wire_bytes(10_000, 2) == 8 * 100, f"TopK wire bytes {state.wire_bytes(10_000, 2)}")
    model = DDP(nn.Linear(64, 64))
    wrong = ddp_hooks.HookState(ddp_hooks.Compression.fp16)
    model.register_comm_hook(wrong, ddp_hooks.topk_hook)
    raises(lightcc.LightCCError, lambda: model(torch.ones(2, 64)).sum().backward(),
           "state for fp16 given to topk_hook", match="topk_hook")


run([case_init, case_hooks_within_bars, case_state_and_errors])
