"""``DistributedOptimizer(op=Adasum)`` at 2 ranks against Horovod's documented Adasum step,
simulated here in one process (run under mpirun -np 2).

The reference keeps one model copy and one SGD-with-momentum optimizer per rank: every step,
each copy steps with its own rank's data from the same starting weights, ``delta_r = new_r -
start`` is taken in float32, the two deltas are combined per parameter by the Adasum formula in
float64 (``(1 - a.b/2|a|^2) a + (1 - a.b/2|b|^2) b``), and every copy is set to ``start + delta``
(float32). Momentum stays local to each rank, so reducing gradients instead of deltas, or
averaging, gives other weights. Cases: 1 and 2 backward passes per step, and fp16 compression
(each delta cast to float16 before the reduction and back after, as in Horovod).
"""
from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

import lightcc.torch as hvd
from lightcc import InvalidArgumentError
from lightcc.torch.compression import per_tensor

hvd.init()
R, N = hvd.rank(), hvd.size()
assert N == 2, N
TINY = math.sqrt(np.finfo(np.float64).tiny)
STEPS = 4


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def make_opt(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def batch(rank: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * index + rank)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def backward(model: nn.Module, rank: int, index: int) -> None:
    x, y = batch(rank, index)
    nn.functional.mse_loss(model(x), y).backward()


def ref_pair(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    dot, aa, bb = float(a @ b), float(a @ a), float(b @ b)
    ca = 1.0 - dot / (2 * aa) if aa >= TINY else 1.0
    cb = 1.0 - dot / (2 * bb) if bb >= TINY else 1.0
    return ca * a + cb * b


def reference(passes: int, wire: torch.dtype | None) -> list[torch.Tensor]:
    models = [make_model() for _ in range(N)]
    opts = [make_opt(m.parameters()) for m in models]
    for step in range(STEPS):
        starts = [p.detach().clone() for p in models[0].parameters()]
        deltas = []
        for r in range(N):
            opts[r].zero_grad()
            for k in range(passes):
                backward(models[r], r, step * passes + k)
            opts[r].step()
            deltas.append([(p.detach() - s) for p, s in zip(models[r].parameters(), starts)])
        for i, start in enumerate(starts):
            parts = [d[i] if wire is None else d[i].to(wire) for d in deltas]
            combined = ref_pair(*[t.double().numpy().reshape(-1) for t in parts])
            delta = torch.from_numpy(combined).view_as(start)
            delta = delta.to(wire).float() if wire is not None else delta.float()
            new = start + delta
            for m in models:
                list(m.parameters())[i].data.copy_(new)
    return [p.detach() for p in models[0].parameters()]


def run(passes: int, compression, tag: str) -> list[torch.Tensor]:
    model = make_model()
    opt = hvd.DistributedOptimizer(make_opt(model.parameters()),
                                   named_parameters=[(f"{tag}.{n}", p)
                                                     for n, p in model.named_parameters()],
                                   compression=compression, op=hvd.Adasum,
                                   backward_passes_per_step=passes)
    for step in range(STEPS):
        opt.zero_grad()
        for k in range(passes):
            backward(model, R, step * passes + k)
        opt.step()
    return [p.detach() for p in model.parameters()]


def compare(got: list[torch.Tensor], want: list[torch.Tensor], atol: float, what: str) -> None:
    for g, w in zip(got, want):
        err = float((g - w).abs().max())
        assert err <= atol, f"rank {R} {what}: max |difference| {err:.3g} > {atol}"


# float32: one rounding of the reduced delta per step (measured: 0, bitwise equal, in 3 runs;
# the bars allow reordered float64 sums); fp16: the delta rounded to float16 (measured: 0 too)
compare(run(1, hvd.Compression.none, "one"), reference(1, None), 1e-6, "1 pass")
compare(run(2, hvd.Compression.none, "two"), reference(2, None), 1e-6, "2 passes")
compare(run(1, hvd.Compression.fp16, "fp16"), reference(1, torch.float16), 2e-4, "fp16")

# what it does not support fails on every rank at construction
m = make_model()
for bad, needle in ((dict(compression=hvd.Compression.topk(0.1)), "compression"),
                    (dict(groups=2), "groups")):
    try:
        hvd.DistributedOptimizer(make_opt(m.parameters()), named_parameters=m.named_parameters(),
                                 op=hvd.Adasum, **bad)
    except InvalidArgumentError as exc:
        assert needle in str(exc), exc
    else:
        raise AssertionError(f"expected an error for {bad}")
opt = hvd.DistributedOptimizer(make_opt(m.parameters()), named_parameters=m.named_parameters(),
                               op=hvd.Adasum)
try:
    with opt.skip_synchronize():
        pass
except AssertionError as exc:
    assert "not supported" in str(exc), exc
else:
    raise AssertionError("skip_synchronize should raise with Adasum")

# hvd.allreduce(op=Adasum) on torch tensors
t = torch.tensor([1.0, 0.0]) if R == 0 else torch.tensor([0.0, 2.0])
assert torch.equal(hvd.allreduce(t, op=hvd.Adasum), torch.tensor([1.0, 2.0]))
t = torch.tensor([2.0, 2.0])
assert torch.equal(hvd.allreduce(t, op=hvd.Adasum, name="par"), t)
# Compression.fp16 / .bf16 with Adasum are casts of the tensor itself, as in Horovod: the
# Adasum formula runs on the float16 values and the result is cast back to float32
half = hvd.allreduce(torch.tensor([1.0, 0.0]) if R == 0 else torch.tensor([0.0, 2.0]),
                     op=hvd.Adasum, compression=per_tensor(hvd.Compression.fp16))
assert half.dtype == torch.float32 and torch.equal(half, torch.tensor([1.0, 2.0])), half
gen = [torch.Generator().manual_seed(70 + r) for r in range(N)]
vecs = [torch.randn(300, generator=g) for g in gen]
for cast, wire in ((hvd.Compression.fp16, np.float16), (hvd.Compression.bf16, None)):
    got = hvd.allreduce(vecs[R], op=hvd.Adasum, compression=cast, name=f"cast.{wire}")
    assert got.dtype == torch.float32, got.dtype
    assert torch.equal(got, hvd.allreduce(vecs[R], op=hvd.Adasum, compression=per_tensor(cast),
                                          name=f"per_tensor.{wire}")), "differs from per_tensor"
    if wire is not None:        # NumPy reference on the float16-rounded inputs, in float64
        a, b = (v.numpy().astype(wire).astype(np.float64) for v in vecs)
        dot, aa, bb = a @ b, a @ a, b @ b
        want = (1 - dot / (2 * aa)) * a + (1 - dot / (2 * bb)) * b
        err = np.abs(got.numpy() - want).max() / np.abs(want).max()
        assert err < 2e-3, f"fp16 Adasum relative error {err:.3g}"
hvd.shutdown()
print("OK adasum optimizer", flush=True)
