"""One training step in barrier mode above the same step in cross-barrier mode, on one time axis.

    mpirun -np 2 python tools/xbar_timeline.py --out docs/img/cross-barrier-step.png
    python tests/netns/simhosts.py -- python tools/xbar_timeline.py --compare 4 --steps 10
    (or under the simulated hosts: python benchmarks/training.py's --netns launcher is not
    needed; any 2-rank launch works, e.g. ``lccrun -np 2``)

Each rank trains ``benchmarks/models.py``'s model (default resmlp) for a few steps in each mode
with lightcc's timeline on (``start_timeline``), adding its own spans: the forward and the
backward of every top-level module, each update (barrier mode: ``step()``; cross-barrier mode:
each pre-forward wait, red, with the update it applies, green, on top) and the step boundaries. Rank 0 then draws, per mode,
the step ``--step`` from the start of its forward to the end of the next forward: rows
forward / backward / wire (every bucket's reduction span from the engine's timeline) / update.
Needs matplotlib.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))

import lightcc.torch as lcc  # noqa: E402
from lightcc.common.observability import timeline  # noqa: E402

warnings.filterwarnings("ignore", message="Full backward hook")
WIRE = ("ALLREDUCE", "COMPRESSED_ALLREDUCE", "REDUCE_SCATTER", "ALLGATHER")
ROWS = ("forward", "backward", "wire", "update")
COLORS = {"forward": "#1f77b4", "backward": "#ff7f0e", "wire": "#9467bd", "update": "#2ca02c",
          "wait": "#d62728"}


def span(track: str, name: str, t0: float, t1: float) -> None:
    tl = timeline.active()
    if tl is not None:
        tl.span(track, name, t0, t1)


def instrument(model: torch.nn.Module) -> None:
    """forward / backward spans of every top-level module, or of the blocks of a top-level
    Sequential / ModuleList (pre-hooks run after lightcc's)."""
    mods = []
    for name, mod in model.named_children():         # a Sequential/ModuleList: its children
        if isinstance(mod, (torch.nn.Sequential, torch.nn.ModuleList)):
            mods += [(f"{name}.{n}", m) for n, m in mod.named_children()]
        else:
            mods.append((name, mod))
    for name, mod in mods:
        def pre(m, a, name=name):
            m._xt0 = time.perf_counter()

        def post(m, a, out, name=name):
            span("xb.forward", name, m._xt0, time.perf_counter())

        def bpre(m, g, name=name):
            m._xb0 = time.perf_counter()

        def bpost(m, gi, go, name=name):
            span("xb.backward", name, m._xb0, time.perf_counter())
        mod.register_forward_pre_hook(pre)
        mod.register_forward_hook(post)
        mod.register_full_backward_pre_hook(bpre)
        mod.register_full_backward_hook(bpost)


def train(mode: str, model_name: str, batch: int, steps: int, compression, path: str) -> None:
    import models
    torch.manual_seed(0)
    model = models.build(model_name)
    xbar = mode == "xbar"
    opt = lcc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                   named_parameters=[(f"{mode}.{n}", p) for n, p in
                                                     model.named_parameters()],
                                   compression=compression, cross_barrier=xbar,
                                   model=model if xbar else None)
    if xbar:            # each pre-forward wait + update (red), each update inside it (green)
        apply, ready = opt._apply, opt._apply_ready

        def timed_apply(params):
            t0 = time.perf_counter()
            apply(params)
            if params:
                span("xb.update", "update", t0, time.perf_counter())

        def timed_ready(params):
            t0 = time.perf_counter()
            ready(params)
            span("xb.update", "wait", t0, time.perf_counter())
        opt._apply, opt._apply_ready = timed_apply, timed_ready
    instrument(model)
    lcc.broadcast_parameters(model.state_dict(), root_rank=0)
    g = torch.Generator().manual_seed(lcc.rank())
    x = torch.randn(batch, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)
    lcc.start_timeline(path)
    starts = []
    for _ in range(steps):
        t = time.perf_counter()
        starts.append(t)
        span("xb.step", "STEP", t, t + 1e-6)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        t0 = time.perf_counter()
        opt.step()
        if not xbar:
            span("xb.update", "step()", t0, time.perf_counter())
    model(x)                                    # the forward after the last step
    opt.synchronize()
    lcc.stop_timeline()
    times = sorted(b - a for a, b in zip(starts[1:], starts[2:]))
    if lcc.rank() == 0 and times:
        print(f"{mode}: step ms (from the second step) median {1e3 * times[len(times) // 2]:.0f}"
              f", min {1e3 * times[0]:.0f}, max {1e3 * times[-1]:.0f}", flush=True)


def compare(model_name: str, batch: int, steps: int, rounds: int, compression) -> None:
    """Barrier and cross-barrier mode trained alternately in this job (``rounds`` rounds of
    ``steps`` timed steps each, after 3 untimed); rank 0 prints each round's mean step time
    and the median of cross-barrier / barrier (same job, same load: lower is better)."""
    import statistics

    import models
    runs = {}
    for mode in ("barrier", "xbar"):
        torch.manual_seed(0)
        model = models.build(model_name)
        xbar = mode == "xbar"
        runs[mode] = (model, lcc.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
            named_parameters=[(f"c{mode}.{n}", p) for n, p in model.named_parameters()],
            compression=compression, cross_barrier=xbar, model=model if xbar else None))
    x, y = torch.randn(batch, 1, 28, 28), torch.randint(0, 10, (batch,))
    ms: dict = {mode: [] for mode in runs}
    for _ in range(rounds):
        for mode, (model, opt) in runs.items():
            for s in range(steps + 3):
                if s == 3:
                    t0 = time.perf_counter()
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
            model(x)
            opt.synchronize()
            ms[mode].append((time.perf_counter() - t0) / steps * 1e3)
    if lcc.rank() == 0:
        ratio = statistics.median(a / b for a, b in zip(ms["xbar"], ms["barrier"]))
        print(f"step ms per round: barrier {[round(v) for v in ms['barrier']]}, cross-barrier "
              f"{[round(v) for v in ms['xbar']]}; cross-barrier / barrier median {ratio:.2f} "
              f"(load {os.getloadavg()[0]:.1f})", flush=True)


def load(path: str) -> list[dict]:
    text = open(path, encoding="utf-8").read().rstrip()
    if not text.endswith("]"):
        text = text.rstrip(",") + "]"
    events = json.loads(text)
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    for e in events:
        e["track"] = names.get(e.get("tid"), "")
    return [e for e in events if e.get("ph") == "X"]


def rows_of(events: list[dict], step: int) -> tuple[dict, float, float]:
    starts = sorted(e["ts"] for e in events if e["track"] == "xb.step")
    lo = starts[step]
    nxt = starts[step + 1] if step + 1 < len(starts) else None
    end = starts[step + 2] if step + 2 < len(starts) else float("inf")
    bwd = [e["ts"] for e in events if e["track"] == "xb.backward" and nxt is not None
           and nxt <= e["ts"] < end]
    end = min(bwd) if bwd else end                    # the next backward starts
    later = [e["ts"] + e["dur"] for e in events
             if e["track"] == "xb.forward" and nxt is not None and nxt <= e["ts"] < end]
    hi = max(later) if later else lo                  # the next step's forward is done
    rows: dict = {r: [] for r in ROWS}
    for e in events:
        end = e["ts"] + e["dur"]
        if end < lo or e["ts"] > hi:
            continue
        if e["track"] == "xb.forward":
            rows["forward"].append(e)
        elif e["track"] == "xb.backward":
            rows["backward"].append(e)
        elif e["track"] == "xb.update":
            rows["update"].append(e)
        elif e["track"].startswith("bucket") and e["name"] in WIRE:
            rows["wire"].append(e)
    return rows, lo, hi


def plot(paths: dict, step: int, out: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(12, 4.6), sharex=True)
    for ax, (mode, path) in zip(axes, paths.items()):
        rows, lo, hi = rows_of(load(path), step)
        for y, row in enumerate(ROWS):        # waits first: the updates inside them on top
            for i, e in enumerate(sorted(rows[row], key=lambda e: (e["name"] != "wait",
                                                                    e["ts"]))):
                color = COLORS["wait"] if e["name"] == "wait" else COLORS[row]
                ax.barh(y, e["dur"] / 1e3, left=(e["ts"] - lo) / 1e3, height=0.7,
                        color=color, alpha=0.55 + 0.45 * (i % 2), edgecolor="none")
        ax.axvline((hi - lo) / 1e3, color="k", lw=1)
        ax.text((hi - lo) / 1e3, -0.6, f" next forward done: {(hi - lo) / 1e3:.0f} ms",
                fontsize=8, va="bottom")
        ax.set_yticks(range(len(ROWS)), ROWS, fontsize=8)
        ax.invert_yaxis()
        ax.set_title(f"{'barrier mode' if mode == 'barrier' else 'cross_barrier=True'}",
                     fontsize=9, loc="left")
    axes[-1].set_xlabel("ms since the step's forward started (rank 0; alternate shades: "
                        "consecutive modules / buckets)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="resmlp")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--step", type=int, default=3, help="which step to draw (0-based)")
    p.add_argument("--compression", default="fp16", help="none, fp16, ...")
    p.add_argument("--trace-dir", default="/tmp")
    p.add_argument("--out", default="cross-barrier-step.png")
    p.add_argument("--compare", type=int, default=0, metavar="ROUNDS",
                   help="no picture: train both modes alternately for ROUNDS rounds of "
                        "--steps steps and print the step times")
    args = p.parse_args(argv)
    lcc.init()
    comp = getattr(lcc.Compression, args.compression)
    if args.compare:
        compare(args.model, args.batch, args.steps, args.compare, comp)
        lcc.shutdown()
        return 0
    paths = {}
    for mode in ("barrier", "xbar"):
        paths[mode] = os.path.join(args.trace_dir, f"xbar_timeline_{mode}.json")
        train(mode, args.model, args.batch, args.steps, comp, paths[mode])
    if lcc.rank() == 0:
        plot(paths, args.step, args.out,
             f"{args.model}, batch {args.batch}/rank, {lcc.size()} ranks, "
             f"{args.compression}: one step and the next forward")
        print(f"wrote {args.out}")
    lcc.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
