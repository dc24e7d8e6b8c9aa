"""Train one small model per configuration in barrier or cross-barrier mode; save the results.

Usage: ``cross_barrier_train.py MODE SET OUT`` with MODE ``barrier`` or ``xbar`` and SET
``exact`` (fp32/fp16/bf16 and optimizer variants: bucket splits do not change their bits) or
``lossy`` (fp8, TopK + error feedback, PowerSGD: per-bucket compressors, run with fusion off
so the bucket of a tensor is the tensor in both modes). Rank 0 saves, per configuration, the
parameters after STEPS steps and the outputs of the no_grad eval forwards, to ``OUT``; the
test compares the two modes' files bit for bit. In ``xbar`` mode each rank also trains a
single-process torch reference on the concatenated batch (uncompressed configurations) and
checks it within 1e-6.

The loop exercises, every run: an LR scheduler changing lr every step, ``zero_grad()`` between
``step()`` and the next forward, a branch used only on even steps (unused parameters), a module
called twice, a parameter shared by two modules, a no_grad eval forward every 5 steps,
``state_dict()`` mid-training and ``add_param_group`` at step ADD.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F
from common import close, run
from torch import nn

import lightcc.torch as hvd

STEPS, ADD = 20, 10
MODE, SET, OUT = sys.argv[1], sys.argv[2], sys.argv[3]
import lightcc.torch.optimizer.cross_barrier as _xb  # noqa: E402

PARTITION_BYTES = _xb.PARTITION_BYTES      # put back at the end (a shared job's next case)
if os.environ.get("XBAR_PARTITION"):     # cross-barrier mode cuts gradients into tiny pieces
    _xb.PARTITION_BYTES = int(os.environ["XBAR_PARTITION"])
R = N = 0
RESULTS: dict = {}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Linear(8, 16)
        self.block0 = nn.Linear(16, 16)
        self.block1 = nn.Linear(16, 16)
        self.tied = nn.Linear(16, 16)
        self.tied.weight = self.block1.weight            # one parameter, two owners
        self.branch = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)
        self.extra = nn.Linear(16, 4)                    # joins the optimizer at step ADD
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.emb(x))
        h = torch.tanh(self.block0(h))
        h = torch.tanh(self.block0(h))                   # called twice
        h = torch.tanh(self.block1(h))
        h = h + torch.tanh(self.tied(h))
        if self.step % 2 == 0:
            h = h + self.branch(h)
        return self.head(h) + self.extra(h)


def batch(rank: int, step: int, n: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)


def full_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [batch(r, step) for r in range(N)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def base_params(model: Net) -> list:
    return [p for n, p in model.named_parameters() if not n.startswith("extra.")]


def trained(opt: torch.optim.Optimizer) -> list:
    return [p for g in opt.param_groups for p in g["params"]]


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True,
                                      weight_decay=1e-3),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.05),
    "adam_foreach": lambda ps: torch.optim.Adam(ps, lr=0.01, foreach=True),
    "adam_fused": lambda ps: torch.optim.Adam(ps, lr=0.01, fused=True),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=0.01, momentum=0.5),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.05),
}
COMP = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16,
        "bf16": hvd.Compression.bf16, "fp8": hvd.Compression.fp8(),
        "topk": hvd.Compression.topk(0.1), "powersgd": hvd.Compression.powersgd(rank=2)}
# (optimizer, compression, variant); variant: "" | "bpps2" | "clip" | "scaler" | "pset"
CONFIGS = {
    "exact": [("sgd", "none", ""), ("adamw", "none", ""), ("adam_foreach", "none", ""),
              ("adam_fused", "none", ""), ("rmsprop", "none", ""), ("adagrad", "none", ""),
              ("sgd", "fp16", ""), ("adamw", "fp16", ""), ("sgd", "bf16", ""),
              ("sgd", "none", "bpps2"), ("sgd", "none", "clip"), ("adamw", "none", "scaler")],
    "lossy": [("sgd", "fp8", ""), ("sgd", "topk", ""), ("adamw", "topk", ""),
              ("sgd", "powersgd", "")],
    # 3 ranks, 4 ranks on 2 simulated nodes (run with fusion off for TopK)
    "core": [("sgd", "none", ""), ("adamw", "none", ""), ("sgd", "fp16", ""),
             ("adamw", "fp16", ""), ("sgd", "topk", ""), ("adamw", "topk", ""),
             ("sgd", "none", "pset")],
}


def train(opt_name: str, comp: str, variant: str) -> None:
    tag = f"{opt_name}.{comp}.{variant}"
    model = Net()
    xbar = MODE == "xbar"
    pset = hvd.add_process_set([0, N - 1]) if variant == "pset" else hvd.global_process_set
    opt = hvd.DistributedOptimizer(
        OPTIMIZERS[opt_name](base_params(model)),
        named_parameters=[(f"{tag}.{n}", p) for n, p in model.named_parameters()
                          if not n.startswith("extra.")],
        compression=COMP[comp], backward_passes_per_step=2 if variant == "bpps2" else 1,
        cross_barrier=xbar, model=model if xbar else None, process_set=pset)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, 0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8) if variant == "scaler" else None
    ref = ref_opt = ref_sched = None
    # (RMSprop is left out: dividing by sqrt(v) of tiny gradients turns the one-rounding
    # difference of a two-rank average into 5.5e-6 after 20 steps, in both modes.)
    if comp == "none" and variant in ("", "clip") and opt_name != "rmsprop":
        ref = Net()
        ref_opt = OPTIMIZERS[opt_name](base_params(ref))
        ref_sched = torch.optim.lr_scheduler.ExponentialLR(ref_opt, 0.9)
    evals = []
    probe = torch.randn(3, 8, generator=torch.Generator().manual_seed(99))
    for step in range(STEPS):
        model.step = step
        if step == ADD:
            opt.add_param_group({"params": list(model.extra.parameters()), "lr": 0.02})
            if ref is not None:
                ref_opt.add_param_group({"params": list(ref.extra.parameters()), "lr": 0.02})
        opt.zero_grad()
        for half in range(2 if variant == "bpps2" else 1):
            x, y = batch(R + 100 * half, step)
            loss = F.cross_entropy(model(x), y)
            (scaler.scale(loss) if scaler else loss).backward()
        if variant == "clip":
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(trained(opt), 0.5)
            with opt.skip_synchronize():
                opt.step()
        elif scaler is not None:
            opt.synchronize()
            scaler.unscale_(opt)
            with opt.skip_synchronize():
                scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        sched.step()
        if step % 5 == 4:
            model.eval()
            with torch.no_grad():
                evals.append(model(probe).clone())       # must see step's full update
            model.train()
        if step == 15:
            opt.state_dict()
        if ref is not None:
            ref.step = step
            fx, fy = full_batch(step)
            ref_opt.zero_grad()
            F.cross_entropy(ref(fx), fy).backward()
            for g in ref_opt.param_groups:      # Horovod: a gradient no rank computed is zeros
                for q in g["params"]:
                    if q.grad is None:
                        q.grad = torch.zeros_like(q)
            if variant == "clip":
                torch.nn.utils.clip_grad_norm_(trained(ref_opt), 0.5)
            ref_opt.step()
            ref_sched.step()
    opt.synchronize()
    if ref is not None:
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            close(p, q, f"{tag} vs single-process torch: {name}", atol=1e-6, rtol=0)
    RESULTS[tag] = {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
                    "evals": evals}


def make_case(cfg: tuple) -> object:
    def case() -> None:
        train(*cfg)
    case.__name__ = "train_" + "_".join(c for c in cfg if c)
    return case


def save() -> None:
    if R == 0:
        torch.save(RESULTS, OUT)


if __name__ == "__main__":
    hvd.init()
    R, N = hvd.rank(), hvd.size()
    run([make_case(c) for c in CONFIGS[SET]] + [save])
    hvd.shutdown()
    _xb.PARTITION_BYTES = PARTITION_BYTES
