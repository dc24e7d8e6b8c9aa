"""Device-time mode of the training benchmark (``--compute device``): the real model's
parameters, autograd graph, hooks, optimizer, compressors and gradient sizes, with each layer's
compute replaced by the time it takes on a GPU.

Every module that owns parameters becomes a :class:`DeviceLayer` holding the same parameters
(same names, shapes, order). Its forward and its backward each take their device time from
:class:`DeviceClock`: ``cpu_share`` of it busy on the CPU (a spin loop that holds the GIL, like
kernel launches from Python), the rest asleep with the CPU and the GIL released. Backward
returns freshly allocated zero gradients of each parameter's shape (so AccumulateGrad, DDP's
reducer hooks and lightcc's post-accumulate-grad hooks run as usual); activations are a tiny
(N, 1) tensor, so nothing else costs memory bandwidth. Where layer times come from:
``profiles/*.json`` for the real-size models (see profiles/derive.py), or ``F``/``B`` given on
the command line for the synthetic ones, spread over the layers in proportion to their
parameter counts.
"""
from __future__ import annotations

import ctypes
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

PROFILES = Path(__file__).resolve().parent / "profiles"
PR_SET_TIMERSLACK = 29


def lower_timer_slack(ns: int = 1) -> bool:
    """Set this thread's timer slack (Linux ``prctl(PR_SET_TIMERSLACK)``, default 50 µs) so a
    short sleep ends when asked; returns False where the call is unavailable."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_TIMERSLACK, ctypes.c_ulong(ns), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


@dataclass
class DeviceClock:
    """Spends device time: ``cpu_share`` busy, the rest asleep. Sleeps overshoot (the wake-up
    latency of a loaded machine), so the clock carries what it overspent (``debt``, s) and takes
    it off the next sleeps: over a step, the time spent matches the time asked to within one
    wake-up. ``now``/``sleep`` are injectable for tests."""

    cpu_share: float = 0.1
    now: object = time.perf_counter
    sleep: object = time.sleep
    debt: float = 0.0
    asked: float = 0.0
    spent: float = 0.0
    busy: float = 0.0
    _slack: threading.local = field(default_factory=threading.local, repr=False)

    def spend(self, seconds: float) -> None:
        if seconds <= 0:
            return
        if not getattr(self._slack, "done", False):
            lower_timer_slack()
            self._slack.done = True
        t0 = self.now()
        busy_until = t0 + self.cpu_share * seconds
        while self.now() < busy_until:      # busy: the CPU part (launches), GIL held
            pass
        t1 = self.now()
        target = seconds - (t1 - t0) - self.debt
        if target > 0:
            self.sleep(target)
        t2 = self.now()
        self.debt = max(0.0, (t2 - t0) - (seconds - self.debt))
        self.asked += seconds
        self.spent += t2 - t0
        self.busy += t1 - t0

    def reset(self) -> None:
        self.debt = self.asked = self.spent = self.busy = 0.0


# ---- profiles -------------------------------------------------------------------------------
def load_profile(name: str, directory: Path = PROFILES) -> dict:
    """A profile file: ``{"model", "batch", "source", "layers": [{"name", "fwd_ms",
    "bwd_ms"}]}``, each layer named by its module path in the real model."""
    path = directory / f"{name}.json"
    prof = json.loads(path.read_text())
    for key in ("model", "batch", "source", "layers"):
        if key not in prof:
            raise ValueError(f"{path}: no {key!r}")
    for layer in prof["layers"]:
        if not (layer["fwd_ms"] >= 0 and layer["bwd_ms"] >= 0):
            raise ValueError(f"{path}: layer {layer['name']}: negative time")
    return prof


@dataclass(frozen=True)
class Layer:
    """One step of the device-time forward: a module path, its device times (s), and whether
    it owns parameters (``free``: a parameter-free layer such as GPT-2's tied LM head)."""

    name: str
    fwd_s: float
    bwd_s: float
    free: bool = False


def plan(model, profile: dict | None, batch: int, f_ms: float = 0.0, b_ms: float = 0.0
         ) -> list[Layer]:
    """The device-time layers of ``model`` in forward order. From a profile: its layers in the
    file's order, times scaled linearly from the profile's batch to ``batch``; every module
    that owns parameters must have exactly one entry. Without one: ``f_ms``/``b_ms`` spread over
    the parameter-owning modules in proportion to their parameter counts."""
    owners = _owners(model)
    if profile is None:
        total = sum(sum(p.numel() for p in ps) for ps in owners.values())
        return [Layer(n, f_ms / 1e3 * sum(p.numel() for p in ps) / total,
                      b_ms / 1e3 * sum(p.numel() for p in ps) / total)
                for n, ps in owners.items()]
    scale = batch / profile["batch"]
    layers = [Layer(l["name"], l["fwd_ms"] * scale / 1e3, l["bwd_ms"] * scale / 1e3,
                    bool(l.get("free", False))) for l in profile["layers"]]
    named = [l.name for l in layers if not l.free]
    missing = [n for n in owners if n not in named]
    extra = [n for n in named if n not in owners]
    twice = sorted({n for n in named if named.count(n) > 1})
    if missing or extra or twice:
        raise ValueError(f"profile {profile['model']}: modules without a time {missing[:5]}, "
                         f"times without a module {extra[:5]}, named twice {twice[:5]}")
    return layers


def _owners(model) -> dict[str, list]:
    """Module path -> the parameters it owns directly, each shared parameter with its first
    owner, in ``named_modules`` order (forward order for the models here)."""
    seen, out = set(), {}
    for name, module in model.named_modules():
        own = [p for p in module.parameters(recurse=False) if id(p) not in seen]
        seen.update(id(p) for p in own)
        if own:
            out[name] = own
    return out


# ---- the device-time model ------------------------------------------------------------------
def _make_fn():
    import torch

    class DeviceStep(torch.autograd.Function):
        """Forward and backward of one layer: device time, zero gradients of the right size."""

        @staticmethod
        def forward(ctx, h, clock, fwd_s, bwd_s, *params):
            ctx.clock, ctx.bwd_s = clock, bwd_s
            ctx.meta = [(p.shape, p.dtype) for p in params]
            clock.spend(fwd_s)
            return h + 0.0

        @staticmethod
        def backward(ctx, g):
            ctx.clock.spend(ctx.bwd_s)
            return (g, None, None, None,
                    *[torch.zeros(shape, dtype=dtype) for shape, dtype in ctx.meta])

    return DeviceStep


def convert(model, layers: list[Layer], clock: DeviceClock):
    """A module with ``model``'s parameters under the same names, whose forward runs each
    layer's device time in order; input: any (N, ...) tensor; output (N, 1)."""
    import torch.nn as nn

    step = _make_fn()
    owners = _owners(model)

    class DeviceLayer(nn.Module):
        def __init__(self, fwd_s: float, bwd_s: float) -> None:
            super().__init__()
            self.fwd_s, self.bwd_s = fwd_s, bwd_s

        def forward(self, h):
            return step.apply(h, clock, self.fwd_s, self.bwd_s,
                              *self.parameters(recurse=False))

    class DeviceModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.free = nn.ModuleDict()
            self.order: list[nn.Module] = []
            for layer in layers:
                mod = DeviceLayer(layer.fwd_s, layer.bwd_s)
                if layer.free:
                    self.free[layer.name.replace(".", "_")] = mod
                else:
                    pnames = {id(p): n for n, p in model.get_submodule(
                        layer.name).named_parameters(recurse=False)}
                    for p in owners[layer.name]:
                        mod.register_parameter(pnames[id(p)], p)
                    _attach(self, layer.name, mod)
                self.order.append(mod)

        def forward(self, x):
            h = x.new_zeros(x.shape[0], 1)
            for mod in self.order:
                h = mod(h)
            return h

    return DeviceModel()


def _attach(root, path: str, layer) -> None:
    """Put ``layer`` at module path ``path`` under ``root`` (dots -> nested containers)."""
    import torch.nn as nn

    parts = path.split(".")
    node = root
    for part in parts[:-1]:
        if not hasattr(node, part) or getattr(node, part) is None:
            node.add_module(part, nn.Module())
        node = getattr(node, part)
    node.add_module(parts[-1], layer)


def device_loss(out, target):
    """The loss of a device-time model (its output carries no information)."""
    return out.sum()
