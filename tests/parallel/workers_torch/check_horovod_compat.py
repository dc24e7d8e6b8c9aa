"""Horovod's semantics, checked on lightcc.torch (issue 17). ``argv[1]`` picks the group:

  grads       - gradients of allgather, broadcast, reducescatter (+ grouped) are Horovod's
  root        - root_rank is a global rank inside process sets (run on 3 ranks)
  intscale    - integer tensors with prescale/postscale factors, scaled as Horovod does
  compressors - Horovod's compressor objects and user-written compressor classes
  join        - join with uneven data (item 5)
  residuals   - error-feedback state kept per process set (item 8; run on 3 ranks)

Every reference is computed here from every rank's inputs and Horovod's documented behaviour
(its torch/mpi_ops.py autograd functions, its C++ ScaleBuffer, its test_torch.py), never from
lightcc's own output. A failing check aborts the whole job (see common.run).
"""
from __future__ import annotations

import itertools
import math
import sys

import numpy as np
import torch

import lightcc.torch as hvd
from common import check, close, raises, rank_input, run

R = N = 0


def case_init():
    global R, N
    hvd.init()
    R, N = hvd.rank(), hvd.size()


# ---- item 1: gradients ------------------------------------------------------------------------
def _upstream(shape, tag):
    """Every rank's gradient arriving at the collective's output (rank-dependent on purpose,
    so averaging and summing give different answers)."""
    return [rank_input(r, shape, torch.float64, tag) for r in range(N)]


def case_gradient_semantics_default_is_horovod():
    raises(ValueError, lambda: hvd.set_gradient_semantics("mean"), "unknown mode")
    previous = hvd.set_gradient_semantics("sum_of_losses")
    check(previous == "horovod", f"default gradient semantics {previous!r}, want 'horovod'")
    check(hvd.set_gradient_semantics(previous) == "sum_of_losses", "set returns previous")


def case_allgather_grad():
    # Horovod: backward = allreduce(grad, Average), then this rank's slice.
    rows = [r + 2 for r in range(N)]
    x = rank_input(R, (rows[R], 3), torch.float64, 1).requires_grad_()
    y = hvd.allgather(x, name="hc.ag")
    ups = _upstream((sum(rows), 3), 2)
    y.backward(ups[R])
    start = sum(rows[:R])
    want = (sum(ups) / N)[start:start + rows[R]]
    close(x.grad, want, "allgather gradient (Horovod: average of the ranks' gradients)",
          atol=1e-12)
    # Horovod's own test vector (test_horovod_allgather_grad): every rank passes the same
    # gradient, r on rank r's rows; rank r must get r.
    sizes = [3, 2, 7, 4, 6, 8, 10][:N]
    x = (torch.ones(sizes[R], 17) * R).requires_grad_()
    grad_ys = torch.cat([torch.ones(s, 17) * r for r, s in enumerate(sizes)])
    hvd.allgather(x).backward(grad_ys)
    close(x.grad, torch.ones(sizes[R], 17) * R, "Horovod test_horovod_allgather_grad")


def case_grouped_allgather_grad():
    xs = [rank_input(R, (R + 1 + k, 2), torch.float64, 3 + k).requires_grad_() for k in range(2)]
    ys = hvd.grouped_allgather(xs, name="hc.gag")
    ups = [_upstream((sum(r + 1 + k for r in range(N)), 2), 10 + k) for k in range(2)]
    torch.autograd.backward(ys, [u[R] for u in ups])
    for k in range(2):
        start = sum(r + 1 + k for r in range(R))
        want = (sum(ups[k]) / N)[start:start + R + 1 + k]
        close(xs[k].grad, want, f"grouped_allgather gradient {k}", atol=1e-12)


def case_broadcast_grad():
    # Horovod: backward = allreduce(grad, Average); zeros except on the root.
    for root in range(N):
        x = rank_input(R, (4, 3), torch.float64, 20).requires_grad_()
        ups = _upstream((4, 3), 21 + root)
        hvd.broadcast(x, root, name=f"hc.bc.{root}").backward(ups[R])
        want = sum(ups) / N if R == root else torch.zeros(4, 3, dtype=torch.float64)
        close(x.grad, want, f"broadcast gradient, root {root}", atol=1e-12)
        # Horovod's own test vector (test_horovod_broadcast_grad): ones in, 1 at the root.
        x = (torch.ones(17, 17) * R).requires_grad_()
        hvd.broadcast(x, root).backward(torch.ones(17, 17))
        close(x.grad, torch.ones(17, 17) * (1 if R == root else 0),
              f"Horovod test_horovod_broadcast_grad root {root}")


def case_reducescatter_grad():
    # Horovod: backward = allgather(grad * prescale * postscale (* size for Sum)).
    rows = 2 * N + 1
    counts = [rows // N + (1 if r < rows % N else 0) for r in range(N)]
    for op, pre, post in [(hvd.Average, 1.0, 1.0), (hvd.Sum, 1.0, 1.0), (hvd.Sum, 2.0, 0.5),
                          (hvd.Average, 3.0, 0.25)]:
        x = rank_input(R, (rows, 2), torch.float64, 30).requires_grad_()
        ups = [rank_input(r, (counts[r], 2), torch.float64, 31) for r in range(N)]
        out = hvd.reducescatter(x, op=op, prescale_factor=pre, postscale_factor=post)
        out.backward(ups[R])
        want = torch.cat(ups) * pre * post * (N if op == hvd.Sum else 1)
        close(x.grad, want, f"reducescatter gradient op={op} pre={pre} post={post}",
              atol=1e-12)
    # Horovod's own test vectors (test_horovod_reducescatter_grad / _grad_average).
    for op, factor in [(hvd.Sum, N), (hvd.Average, 1)]:
        x = torch.ones(N * 4, N * 4).requires_grad_()
        hvd.reducescatter(x, op=op).backward(torch.ones(4, N * 4))
        close(x.grad, torch.ones(N * 4, N * 4) * factor, f"Horovod reducescatter grad {op}")


def case_grouped_reducescatter_grad():
    xs = [rank_input(R, (2 * N, 3), torch.float64, 40 + k).requires_grad_() for k in range(2)]
    ups = [[rank_input(r, (2, 3), torch.float64, 42 + k) for r in range(N)] for k in range(2)]
    outs = hvd.grouped_reducescatter(xs, op=hvd.Sum, prescale_factor=0.5)
    torch.autograd.backward(outs, [u[R] for u in ups])
    for k in range(2):
        close(xs[k].grad, torch.cat(ups[k]) * 0.5 * N, f"grouped_reducescatter gradient {k}",
              atol=1e-12)


def case_sum_of_losses_opt_in():
    """The opt-in restores the gradient of the sum of all ranks' losses (N times Horovod's
    for allgather and broadcast, 1/N times for reducescatter)."""
    with hvd.gradient_semantics("sum_of_losses"):
        x = rank_input(R, (2, 3), torch.float64, 60).requires_grad_()
        ups = _upstream((2 * N, 3), 61)
        hvd.allgather(x).backward(ups[R])
        close(x.grad, sum(ups)[2 * R:2 * R + 2], "sum_of_losses allgather", atol=1e-12)
        x = torch.ones(N * 4, 3).requires_grad_()
        hvd.reducescatter(x, op=hvd.Sum).backward(torch.ones(4, 3))
        close(x.grad, torch.ones(N * 4, 3), "sum_of_losses reducescatter")
    check(hvd.set_gradient_semantics("horovod") == "horovod", "context manager restores")


# ---- item 2: global root ranks in process sets (3 ranks) -------------------------------------
def _sets():
    even = [r for r in range(N) if r % 2 == 0]
    odd = [r for r in range(N) if r % 2 == 1]
    return even, odd


def case_root_rank_is_global():
    check(N >= 3, "run the 'root' group on 3 ranks")
    even, odd = _sets()
    even_set, odd_set = hvd.add_process_set(even), hvd.add_process_set(odd)
    # {1, 2}: global rank 1 is the set's first member; a set-relative root 1 would be rank 2
    tail = list(range(1, N))
    tail_set = hvd.add_process_set(tail)
    mine, this_set = (even, even_set) if R in even else (odd, odd_set)
    for root in mine:        # Horovod's test_horovod_broadcast_process_sets
        x = torch.full((3, 4), float(R))
        want = torch.full((3, 4), float(root))
        close(hvd.broadcast(x, root, process_set=this_set), want, f"broadcast root {root}")
        close(hvd.synchronize(hvd.broadcast_async(x, root, process_set=this_set)), want,
              f"broadcast_async root {root}")
        y = x.clone()
        hvd.broadcast_(y, root, process_set=this_set)
        close(y, want, f"broadcast_ root {root}")
        y = x.clone()
        hvd.synchronize(hvd.broadcast_async_(y, root, process_set=this_set))
        close(y, want, f"broadcast_async_ root {root}")
        obj = hvd.broadcast_object({"from": R}, root_rank=root, process_set=this_set)
        check(obj == {"from": root}, f"broadcast_object root {root}: {obj}")
    if R in tail:
        got = hvd.broadcast(torch.tensor([float(R)]), 1, name="tail.bc", process_set=tail_set)
        close(got, torch.tensor([1.0]), "root_rank=1 in set [1, 2] is global rank 1")
    # the core NumPy API follows Horovod's core too (global root_rank)
    import lightcc

    if R in tail:
        got = lightcc.broadcast(np.array([R], np.int64), root_rank=N - 1, process_set=tail_set)
        check(int(got[0]) == N - 1, f"lightcc.broadcast global root: {got}")
    hvd.barrier()
    _cleanup = [even_set, odd_set, tail_set]
    globals()["_SETS"] = _cleanup


def case_root_not_in_set_raises_on_every_member():
    even_set, odd_set, tail_set = _SETS
    even, odd = _sets()
    this_set, outsider = (even_set, odd[0]) if R in even else (odd_set, even[0])
    t = torch.ones(2)
    for what, fn in [
            ("broadcast", lambda: hvd.broadcast(t, outsider, process_set=this_set)),
            ("broadcast_", lambda: hvd.broadcast_(t.clone(), outsider, process_set=this_set)),
            ("broadcast_async", lambda: hvd.broadcast_async(t, outsider, process_set=this_set)),
            ("broadcast_async_", lambda: hvd.broadcast_async_(t, outsider,
                                                              process_set=this_set)),
            ("broadcast_object", lambda: hvd.broadcast_object(R, outsider,
                                                              process_set=this_set)),
            ("broadcast_parameters", lambda: hvd.broadcast_parameters(
                [torch.ones(2)], outsider, process_set=this_set)),
            ("broadcast_optimizer_state", lambda: hvd.broadcast_optimizer_state(
                torch.optim.Adam([torch.nn.Parameter(torch.ones(2))]), outsider,
                process_set=this_set))]:
        e = raises(ValueError, fn, f"{what} with root {outsider} outside the set",
                   match=f"root_rank {outsider} is not a member")
        check(isinstance(e, hvd.HorovodInternalError), f"{what}: a lightcc error")
    # nothing was sent: the set still works, with nothing stale queued
    root = (even if R in even else odd)[-1]
    close(hvd.broadcast(torch.full((2,), float(R)), root, process_set=this_set),
          torch.full((2,), float(root)), "broadcast after the refused ones")
    hvd.barrier()


def case_process_set_grads():
    """Horovod's test_horovod_broadcast_grad_process_sets, with rank-dependent gradients: the
    average runs over the set, the root is a global rank."""
    even_set, odd_set, tail_set = _SETS
    even, odd = _sets()
    mine, this_set = (even, even_set) if R in even else (odd, odd_set)
    for root in mine:
        x = rank_input(R, (3, 2), torch.float64, 55).requires_grad_()
        ups = {r: rank_input(r, (3, 2), torch.float64, 56 + root) for r in mine}
        hvd.broadcast(x, root, process_set=this_set).backward(ups[R])
        want = sum(ups.values()) / len(mine) if R == root else torch.zeros(3, 2,
                                                                            dtype=torch.float64)
        close(x.grad, want, f"broadcast gradient in set {mine}, root {root}", atol=1e-12)
    x = rank_input(R, (2, 2), torch.float64, 50).requires_grad_()
    ups = {r: rank_input(r, (2 * len(mine), 2), torch.float64, 51) for r in mine}
    hvd.allgather(x, process_set=this_set).backward(ups[R])
    pos = mine.index(R)
    close(x.grad, (sum(ups.values()) / len(mine))[2 * pos:2 * pos + 2],
          f"allgather gradient in set {mine}", atol=1e-12)
    hvd.barrier()


def case_broadcast_state_in_process_sets():
    even_set, odd_set, tail_set = _SETS
    even, odd = _sets()
    mine, this_set = (even, even_set) if R in even else (odd, odd_set)
    root = mine[-1]                      # global rank 2 in {0, 2}: index 1
    torch.manual_seed(100 + R)
    model = torch.nn.Linear(3, 2)
    hvd.broadcast_parameters(model.state_dict(), root_rank=root, process_set=this_set)
    torch.manual_seed(100 + root)
    ref = torch.nn.Linear(3, 2)
    close(model.weight, ref.weight, "broadcast_parameters in a set")
    opt = torch.optim.SGD(model.parameters(), lr=0.1 * (R + 1), momentum=0.5)
    hvd.broadcast_optimizer_state(opt, root_rank=root, process_set=this_set)
    check(opt.param_groups[0]["lr"] == 0.1 * (root + 1),
          f"broadcast_optimizer_state in a set: lr {opt.param_groups[0]['lr']}")
    hvd.barrier()
    for ps in _SETS:
        hvd.remove_process_set(ps)


# ---- item 3: integer scaling ------------------------------------------------------------------
INT_DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]
_BITS = {torch.uint8: (8, False), torch.int8: (8, True), torch.int16: (16, True),
         torch.int32: (32, True), torch.int64: (64, True)}


def _wrap(v: int, dtype) -> int:
    bits, signed = _BITS[dtype]
    v %= 1 << bits
    return v - (1 << bits) if signed and v >= 1 << (bits - 1) else v


def _hvd_scale(v: int, factor: float, dtype) -> int:
    """Horovod's ScaleBufferCPUImpl on one integer: ``(T)(double factor * v)`` (C truncates
    toward zero)."""
    return _wrap(math.trunc(factor * float(v)), dtype)


def _hvd_reduce(values, dtype, op, pre, post, n):
    """Horovod's allreduce of integers (MPI path): prescale, sum, postscale; Average folds
    1/size into the postscale factor (operations.cc / mpi_operations.cc)."""
    if op == hvd.Average:
        post = post / n
    scaled = [[_hvd_scale(v, pre, dtype) if pre != 1.0 else v for v in vs] for vs in values]
    total = [_wrap(sum(col), dtype) for col in zip(*scaled)]
    return [_hvd_scale(v, post, dtype) if post != 1.0 else v for v in total]


def _ints(rank, dtype, n=12, tag=0):
    g = torch.Generator().manual_seed(700 + 31 * rank + tag)
    lo, hi = (0, 30) if dtype == torch.uint8 else (-30, 30)
    return torch.randint(lo, hi, (n,), generator=g).to(dtype)


SCALES = [(hvd.Sum, 0.37, 1.0), (hvd.Sum, 1.0, 0.61), (hvd.Sum, 1.5, 0.5),
          (hvd.Average, 1.0, 1.7), (hvd.Average, 2.5, 0.3), (hvd.Min, 0.5, 1.0),
          (hvd.Max, 1.0, -0.5)]


def case_integer_allreduce_scaling():
    for dtype, (op, pre, post) in itertools.product(INT_DTYPES, SCALES):
        if dtype == torch.uint8 and post < 0:
            continue
        xs = [_ints(r, dtype) for r in range(N)]
        what = f"allreduce {dtype} op={op} pre={pre} post={post}"
        if op in (hvd.Min, hvd.Max):
            pick = min if op == hvd.Min else max
            scaled = [[_hvd_scale(int(v), pre, dtype) for v in x.tolist()] for x in xs]
            want = [_hvd_scale(pick(col), post, dtype) if post != 1.0 else pick(col)
                    for col in zip(*scaled)]
        else:
            want = _hvd_reduce([x.tolist() for x in xs], dtype, op, pre, post, N)
        want = torch.tensor(want, dtype=torch.int64).to(dtype)
        got = hvd.allreduce(xs[R], op=op, prescale_factor=pre, postscale_factor=post)
        close(got, want, what, atol=0)
        y = xs[R].clone()
        hvd.allreduce_(y, op=op, prescale_factor=pre, postscale_factor=post)
        close(y, want, "in-place " + what, atol=0)


def case_integer_grouped_and_reducescatter_scaling():
    for dtype in INT_DTYPES:
        xs = [[_ints(r, dtype, n=6 * N, tag=k) for k in range(3)] for r in range(N)]
        outs = hvd.grouped_allreduce(xs[R], op=hvd.Average, prescale_factor=1.5,
                                     postscale_factor=0.7)
        for k in range(3):
            want = _hvd_reduce([xs[r][k].tolist() for r in range(N)], dtype, hvd.Average, 1.5,
                               0.7, N)
            close(outs[k], torch.tensor(want).to(dtype), f"grouped_allreduce {dtype} {k}",
                  atol=0)
        for op, pre, post in [(hvd.Sum, 0.45, 1.0), (hvd.Average, 1.0, 2.5),
                              (hvd.Sum, 1.5, 0.5)]:
            full = _hvd_reduce([xs[r][0].tolist() for r in range(N)], dtype, op, pre, post, N)
            got = hvd.reducescatter(xs[R][0], op=op, prescale_factor=pre, postscale_factor=post)
            close(got, torch.tensor(full[6 * R:6 * R + 6]).to(dtype),
                  f"reducescatter {dtype} op={op} pre={pre} post={post}", atol=0)
        outs = hvd.grouped_reducescatter([xs[R][1], xs[R][2]], op=hvd.Sum,
                                         prescale_factor=0.8)
        for k, out in zip((1, 2), outs):
            full = _hvd_reduce([xs[r][k].tolist() for r in range(N)], dtype, hvd.Sum, 0.8, 1.0,
                               N)
            close(out, torch.tensor(full[6 * R:6 * R + 6]).to(dtype),
                  f"grouped_reducescatter {dtype} {k}", atol=0)


def case_horovod_integer_scaling_test_vectors():
    """Horovod's test_horovod_allreduce_prescale / _postscale for IntTensor and LongTensor:
    the same tensor on every rank; the factor applied in float64, then cast."""
    for dtype, dim in itertools.product([torch.int32, torch.int64], [1, 2, 3]):
        torch.manual_seed(1234)
        np.random.seed(1234)
        factor = np.random.uniform()
        tensor = torch.FloatTensor(*([17] * dim)).random_(-100, 100).to(dtype)
        summed = hvd.allreduce(tensor, average=False, prescale_factor=factor)
        want = (torch.tensor(factor, dtype=torch.float64) * tensor.double()).to(dtype) * N
        close(summed, want, f"Horovod prescale test {dtype} dim {dim}", atol=0)
        summed = hvd.allreduce(tensor, average=False, postscale_factor=factor)
        want = (N * tensor.double() * torch.tensor(factor, dtype=torch.float64)).to(dtype)
        close(summed, want, f"Horovod postscale test {dtype} dim {dim}", atol=0)


def case_bool_scaling_still_refused():
    raises(ValueError, lambda: hvd.allreduce(torch.ones(3, dtype=torch.bool), op=hvd.Max,
                                             prescale_factor=2.0), "bool with prescale",
           match="numeric")
    close(hvd.allreduce(torch.ones(2), op=hvd.Sum), torch.ones(2) * N, "works afterwards")


# ---- item 4: compressor objects ---------------------------------------------------------------
def _counting_cast():
    """A user-written Horovod-style compressor class (float tensors travel as bfloat16) that
    counts its compress() calls; built on first use, as it subclasses the library's base."""

    class CountingCast(hvd.compression.Compressor):
        calls = 0

        @staticmethod
        def compress(tensor):
            CountingCast.calls += 1
            if tensor.dtype.is_floating_point:
                return tensor.to(torch.bfloat16), tensor.dtype
            return tensor, tensor.dtype

        @staticmethod
        def decompress(tensor, ctx):
            return tensor.to(ctx)

    return CountingCast


class FixedPoint8:
    """An 8-bit compressor in the style of the Horovod course labs: a fixed scale known to
    every rank, int8 on the wire (not a Compressor subclass: duck typing, as Horovod allows)."""

    SCALE = 4.0

    @staticmethod
    def compress(tensor):
        return torch.round(tensor * FixedPoint8.SCALE).to(torch.int8), tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        return tensor.to(ctx) / FixedPoint8.SCALE


def _q8(t: torch.Tensor) -> list[int]:
    """The 8-bit code of each value (values stay small enough that no sum overflows int8)."""
    return [int(v) for v in torch.round(t * FixedPoint8.SCALE).to(torch.int64).tolist()]


def case_builtin_compressors_have_horovods_interface():
    t = torch.tensor([1.0 + 2 ** -12, -3.5, 1e-3], dtype=torch.float32)
    c, ctx = hvd.Compression.fp16.compress(t)
    check(c.dtype == torch.float16 and ctx == torch.float32, f"fp16.compress: {c.dtype} {ctx}")
    back = hvd.Compression.fp16.decompress(c, ctx)
    check(back.dtype == torch.float32, "fp16.decompress restores the dtype")
    close(back, t.half().float(), "fp16 round trip", atol=0)
    i = torch.arange(4)
    c, ctx = hvd.Compression.fp16.compress(i)
    check(c is i and hvd.Compression.fp16.decompress(c, ctx) is i, "fp16 leaves ints alone")
    c, ctx = hvd.Compression.none.compress(t)
    check(c is t and ctx is None and hvd.Compression.none.decompress(c, ctx) is t, "none")
    c, ctx = hvd.Compression.bf16.compress(t)
    check(c.dtype == torch.bfloat16, "bf16.compress")
    check(issubclass(hvd.Compression.fp16, hvd.compression.Compressor), "fp16 is a Compressor")
    raises(ValueError, lambda: hvd.Compression.topk(0.5).compress(t), "topk per tensor",
           match="inside the engine")
    # still lightcc's bucket compressors: usable as compression= on allreduce
    x = torch.full((2048,), 1.0 + 2 ** -12) * (R + 1)
    got = hvd.allreduce(x, op=hvd.Sum, compression=hvd.Compression.fp16, name="hc.fp16")
    close(got, torch.full((2048,), float(sum(range(1, N + 1)))), "fp16 bucket allreduce",
          atol=1e-2)


def case_user_compressor_in_collectives():
    CountingCast = _counting_cast()
    xs = [rank_input(r, (8, 3), torch.float32, 80) for r in range(N)]
    # the sum happens in the wire dtype (one rounding to bfloat16 of the exact sum, as
    # Horovod's float16 sum does for two ranks)
    want = sum(x.to(torch.bfloat16).float() for x in xs).to(torch.bfloat16).float()
    got = hvd.allreduce(xs[R], op=hvd.Sum, compression=CountingCast, name="hc.user")
    check(got.dtype == torch.float32 and CountingCast.calls == 1, "user compress applied")
    close(got, want, "allreduce with a user compressor", atol=1e-6)
    outs = hvd.grouped_allreduce([xs[R], 2 * xs[R]], op=hvd.Sum, compression=CountingCast)
    check(CountingCast.calls == 3, f"grouped: compress called {CountingCast.calls} times")
    close(outs[1], 2 * want, "grouped_allreduce with a user compressor", atol=1e-6)
    rows = [rank_input(r, (2 * N, 2), torch.float32, 81) / 16 for r in range(N)]
    got = hvd.reducescatter(rows[R], op=hvd.Sum, compression=FixedPoint8)
    want = [sum(col) for col in zip(*[_q8(r_.reshape(-1)) for r_ in rows])]
    want = torch.tensor(want, dtype=torch.float32).reshape(2 * N, 2)[2 * R:2 * R + 2]
    want = want / FixedPoint8.SCALE
    close(got, want, "reducescatter with an 8-bit user compressor", atol=0)


def _train_with(compression, groups=None, steps=2):
    torch.manual_seed(5)
    model = torch.nn.Linear(4, 3)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                   named_parameters=model.named_parameters(),
                                   compression=compression, groups=groups)
    torch.manual_seed(5)
    ref = torch.nn.Linear(4, 3)
    for step in range(steps):
        data = [rank_input(r, (5, 4), torch.float32, 90 + step) / 8 for r in range(N)]
        opt.zero_grad()
        model(data[R]).square().sum().backward()
        opt.step()
        # reference: every rank's gradients compressed, averaged as Horovod averages int8
        # (sum, then times 1/size in float64, truncated), decompressed
        grads = []
        for r in range(N):
            probe = torch.nn.Linear(4, 3)
            probe.load_state_dict(ref.state_dict())
            probe(data[r]).square().sum().backward()
            grads.append([p.grad for p in probe.parameters()])
        with torch.no_grad():
            for i, p in enumerate(ref.parameters()):
                cols = zip(*[_q8(g[i].reshape(-1)) for g in grads])
                avg = [math.trunc((1.0 / N) * sum(col)) for col in cols]
                avg = torch.tensor(avg, dtype=torch.float32) / FixedPoint8.SCALE
                p -= 0.5 * avg.reshape(p.shape)
    return model, ref


def case_user_compressor_in_distributed_optimizer():
    for groups in (None, 1):
        model, ref = _train_with(FixedPoint8, groups=groups)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            close(p, q, f"DistributedOptimizer + 8-bit user compressor (groups={groups}) "
                        f"{name}", atol=1e-6)
    CountingCast = _counting_cast()
    torch.manual_seed(5)
    model = torch.nn.Linear(4, 3)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                   named_parameters=model.named_parameters(),
                                   compression=CountingCast, groups=[list(model.parameters())])
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    check(CountingCast.calls == 2, f"groups: compress called {CountingCast.calls} times, want 2")


def case_subclass_overriding_a_builtin_runs_per_tensor():
    class Tagged(hvd.Compression.fp16):
        calls = 0

        @staticmethod
        def compress(tensor):
            Tagged.calls += 1
            return hvd.Compression.fp16.compress(tensor)

    x = torch.ones(4) * (R + 1)
    got = hvd.allreduce(x, op=hvd.Sum, compression=Tagged)
    check(Tagged.calls == 1, "an overridden compress() is called")
    close(got, torch.ones(4) * sum(range(1, N + 1)), "override result")
    got = hvd.allreduce(x, op=hvd.Sum, compression=hvd.compression.per_tensor(
        hvd.Compression.fp16))
    close(got, torch.ones(4) * sum(range(1, N + 1)), "per_tensor(fp16)")


# ---- item 5: join ---------------------------------------------------------------------------
def case_join_allreduce_uneven():
    """Horovod's test_horovod_join_allreduce: joined ranks contribute zeros; Average divides
    by the full size (integers truncate); join returns the same rank everywhere, not the first
    to join. Fused (two tensors), cached (names seen before) and uncached."""
    dtypes = [torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
              torch.bfloat16, torch.float32, torch.float64]
    for dtype, dim, first, caching in itertools.product(dtypes, [1, 2, 3], range(N),
                                                        [False, True]):
        torch.manual_seed(1234)
        lo, hi = (-60, 60) if dtype == torch.int8 else (-100, 100)   # no int8 overflow
        a = torch.FloatTensor(*([5] * dim)).random_(lo, hi).to(dtype)
        b = torch.FloatTensor(*([17] * dim)).random_(lo, hi).to(dtype)
        tag = f"{dtype}.{dim}.{first}"
        names = ("join.a", "join.b") if caching else (f"join.a.{tag}", f"join.b.{tag}")
        if caching:
            hvd.synchronize(hvd.allreduce_async(a, name=names[0]))
            hvd.synchronize(hvd.allreduce_async(b, name=names[1]))
        if R == first:
            ret = hvd.join()
        else:
            ha = hvd.allreduce_async(a, name=names[0])
            hb = hvd.allreduce_async(b, name=names[1])
            got_a, got_b = hvd.synchronize(ha), hvd.synchronize(hb)
            ret = hvd.join()
            for t, got in ((a, got_a), (b, got_b)):
                if dtype.is_floating_point:
                    want = (t.double() * (N - 1) / N).to(dtype)
                else:
                    want = torch.div(t * (N - 1), N, rounding_mode="trunc")
                close(got, want, f"join allreduce {tag} caching={caching}",
                      atol=1e-2 if dtype in (torch.float16, torch.bfloat16) else 0)
        check(ret != first or N == 1, f"join returned the first rank to join ({first})")
        rets = hvd.allgather_object(ret)
        check(rets == [ret] * N, f"join returned {rets}")


def case_join_uneven_training():
    """Horovod's use of join: ranks hold different numbers of batches; a rank that runs out
    joins while the others keep stepping a DistributedOptimizer. Each step averages over the
    full size with zeros from the joined ranks (Horovod's join semantics), so the reference
    divides the sum of the still-active ranks' gradients by N."""
    batches = [2 + 2 * r for r in range(N)]           # rank r has 2 + 2r batches
    torch.manual_seed(11)
    model = torch.nn.Linear(3, 2)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    torch.manual_seed(11)
    ref = torch.nn.Linear(3, 2)
    for step in range(max(batches)):
        active = [r for r in range(N) if step < batches[r]]
        grads = []
        for r in active:
            probe = torch.nn.Linear(3, 2)
            probe.load_state_dict(ref.state_dict())
            probe(rank_input(r, (4, 3), torch.float32, 120 + step)).square().sum().backward()
            grads.append([p.grad for p in probe.parameters()])
        with torch.no_grad():
            for i, p in enumerate(ref.parameters()):
                p -= 0.1 * sum(g[i] for g in grads) / N
        if R in active:
            opt.zero_grad()
            model(rank_input(R, (4, 3), torch.float32, 120 + step)).square().sum().backward()
            opt.step()
    last = hvd.join()
    check(last == N - 1, f"join returned {last}, want {N - 1} (the rank with most batches)")
    if R == N - 1:
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            close(p, q, f"uneven training with join: {name}", atol=1e-5)


def case_join_allgather_raises():
    """Horovod's test_horovod_join_allgather: an allgather while a rank has joined raises on
    the ranks that did not join."""
    for first in range(N):
        if R == first:
            ret = hvd.join()
        else:
            raises(RuntimeError, lambda: hvd.allgather(torch.ones(17, 17)),
                   f"allgather with rank {first} joined")
            ret = hvd.join()
        check(ret != first, f"join returned the first rank to join ({first})")
        check(hvd.allgather_object(ret) == [ret] * N, "join result differs across ranks")


# ---- item 8: residuals per process set (3 ranks) ---------------------------------------------
def case_error_feedback_is_per_process_set():
    """Sets A = [0, 1] and B = [1, 2] both generate the name allreduce.noname.0. A's step
    leaves a residual on rank 1 (top-k with error feedback sends 10 %); B only ever reduces
    zeros, so its result must be zeros whatever the compressor does. A residual shared by
    name would leak A's residual into B's sum on rank 1."""
    check(N >= 3, "run the 'residuals' group on 3 ranks")
    a, b = hvd.add_process_set([0, 1]), hvd.add_process_set([1, 2])
    comp = hvd.Compression.topk(0.1, error_feedback=True)
    n = 4096
    if R in (0, 1):
        x = (torch.arange(n, dtype=torch.float32) + 1) * (1 + R)
        hvd.allreduce(x, op=hvd.Sum, compression=comp, process_set=a)
    hvd.barrier()
    if R in (1, 2):
        for step in range(2):
            got = hvd.allreduce(torch.zeros(n), op=hvd.Sum, compression=comp, process_set=b)
            close(got, torch.zeros(n), f"set B step {step}: zeros in, zeros out", atol=0)
    hvd.barrier()
    hvd.remove_process_set(a)
    hvd.remove_process_set(b)


GROUPS = {
    "grads": [case_allgather_grad, case_grouped_allgather_grad, case_broadcast_grad,
              case_reducescatter_grad, case_grouped_reducescatter_grad,
              case_gradient_semantics_default_is_horovod, case_sum_of_losses_opt_in],
    "root": [case_root_rank_is_global, case_root_not_in_set_raises_on_every_member,
             case_process_set_grads, case_broadcast_state_in_process_sets],
    "intscale": [case_integer_allreduce_scaling, case_integer_grouped_and_reducescatter_scaling,
                 case_horovod_integer_scaling_test_vectors, case_bool_scaling_still_refused],
    "compressors": [case_builtin_compressors_have_horovods_interface,
                    case_user_compressor_in_collectives,
                    case_user_compressor_in_distributed_optimizer,
                    case_subclass_overriding_a_builtin_runs_per_tensor],
    "join": [case_join_allreduce_uneven, case_join_uneven_training, case_join_allgather_raises],
    "residuals": [case_error_feedback_is_per_process_set],
}

_SETS: list = []

if __name__ == "__main__":
    # argv[2:] (optional): run only these cases of the group, e.g. to see one fail alone
    chosen = [c for c in GROUPS[sys.argv[1]] if len(sys.argv) < 3 or c.__name__ in sys.argv[2:]]
    run([case_init, *chosen])
