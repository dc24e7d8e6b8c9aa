"""Every lightcc.torch collective against references built from all ranks' seeded inputs.

Covers dtypes (bfloat16 included), ops, non-contiguous and zero-size tensors, in-place and
async forms, handles, name matching, process sets, join, errors on every rank, and the
pre-init behaviour. Run under mpirun -np 2 (any N >= 2 works).
"""
from __future__ import annotations

import warnings

import torch

import lightcc.torch as hvd
from common import check, close, raises, rank_input, run, signal_ranks, wait_for_signal

DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
          torch.bfloat16, torch.float32, torch.float64]
R = N = 0


def all_inputs(shape, dtype, tag=0):
    return [rank_input(r, shape, dtype, tag) for r in range(N)]


def ref_reduce(xs, op):
    acc = torch.stack([x.to(torch.float64) for x in xs])
    if op == hvd.Sum:
        return acc.sum(0)
    if op == hvd.Average:
        return acc.sum(0) / len(xs)
    if op == hvd.Min:
        return acc.min(0).values
    if op == hvd.Max:
        return acc.max(0).values
    return acc.prod(0)


def tol(dtype):
    return {torch.float16: 2e-3, torch.bfloat16: 1e-2}.get(dtype, 1e-6)


def case_before_init():
    check(not hvd.is_initialized(), "initialized before init()")
    check(hvd.mpi_built() is True and hvd.gloo_built() is False, "*_built before init")
    check(isinstance(hvd.nccl_built(), int) and hvd.ddl_built() is False
          and hvd.ccl_built() is False and hvd.rocm_built() is False, "build flags")
    raises(ValueError, hvd.rank, "rank() before init", match="init")
    raises(ValueError, lambda: hvd.allreduce(torch.ones(2)), "allreduce before init")
    raises(ValueError, lambda: hvd.DistributedOptimizer(
        torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)), "optimizer before init")
    check(issubclass(hvd.HorovodInternalError, RuntimeError), "HorovodInternalError")


def case_init():
    global R, N
    hvd.init()
    R, N = hvd.rank(), hvd.size()
    check(hvd.is_initialized() and hvd.mpi_enabled(), "init")
    check(0 <= hvd.local_rank() < hvd.local_size() and hvd.cross_size() >= 1, "topology")
    check(isinstance(hvd.mpi_threads_supported(), bool), "mpi_threads_supported")


def case_allreduce_dtypes_ops():
    shape = (3, 5)
    for dtype in DTYPES:
        xs = all_inputs(shape, dtype, 1)
        ops = [hvd.Sum, hvd.Min, hvd.Max] + ([hvd.Average] if dtype != torch.uint8 else [])
        for op in ops:
            got = hvd.allreduce(xs[R], op=op, name=f"ar.{dtype}.{op}")
            want = ref_reduce(xs, op)
            if not dtype.is_floating_point:
                want = want.trunc()   # integer Average truncates toward zero
            close(got, want.to(dtype), f"allreduce {dtype} {op}", atol=tol(dtype), rtol=tol(dtype))
        close(xs[R], rank_input(R, shape, dtype, 1), f"input unchanged {dtype}")
    b = hvd.allreduce(torch.tensor([R % 2 == 0, True]), op=hvd.Max, name="ar.bool")
    close(b, torch.tensor([True, True]), "bool max")
    p = hvd.allreduce(torch.full((4,), float(R + 2)), op=hvd.Product, name="ar.prod")
    close(p, torch.full((4,), float(torch.arange(2, N + 2).prod())), "product")


def case_integer_average_truncates():
    x = torch.tensor([-3, 3, -1, 5], dtype=torch.int32) if R == 0 else torch.zeros(4, dtype=torch.int32)
    got = hvd.allreduce(x, name="ar.int.trunc")
    want = torch.tensor([int(v / N) for v in [-3, 3, -1, 5]], dtype=torch.int32)
    close(got, want, "integer average truncation")
    got = hvd.reducescatter(torch.tensor([[-3], [3]] * N, dtype=torch.int64) if R == 0
                            else torch.zeros((2 * N, 1), dtype=torch.int64), name="rs.int")
    close(got, torch.tensor([[int(-3 / N)], [int(3 / N)]], dtype=torch.int64), "rs trunc")


def case_layouts_and_inplace():
    base = [rank_input(r, (4, 6), torch.float32, 2) for r in range(N)]
    nc = base[R].clone().t()                     # non-contiguous
    check(not nc.is_contiguous(), "setup")
    out = hvd.allreduce(nc, op=hvd.Sum, name="ar.nc")
    close(out, sum(b for b in base).t(), "non-contiguous out-of-place")
    ret = hvd.allreduce_(nc, op=hvd.Sum, name="ar.nc.inplace")
    check(ret is nc, "allreduce_ returns its argument")
    close(nc, sum(b for b in base).t(), "non-contiguous in-place")
    t = base[R].clone()
    ptr = t.data_ptr()
    hvd.allreduce_(t, name="ar.inplace")
    check(t.data_ptr() == ptr, "in-place keeps storage")
    close(t, sum(base) / N, "in-place average")
    for shape in [(0,), (0, 3), ()]:
        x = torch.ones(shape)
        close(hvd.allreduce(x, op=hvd.Sum, name=f"ar.shape{shape}"), x * N, f"shape {shape}")
    bf = torch.full((8,), 1.0 + R, dtype=torch.bfloat16)
    hvd.allreduce_(bf, name="ar.bf16.inplace")
    close(bf, torch.full((8,), (N + 1) / 2, dtype=torch.bfloat16), "bf16 in-place", atol=1e-2)
    x = torch.full((3,), float(R + 1))
    got = hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5, name="ar.scale")
    close(got, torch.full((3,), float(sum(range(1, N + 1)))), "pre/postscale")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = hvd.allreduce(x, average=False, name="ar.avgflag")
    close(got, torch.full((3,), float(sum(range(1, N + 1)))), "average=False sums")
    check(any(issubclass(w.category, DeprecationWarning) for w in caught), "average= warns")
    raises(ValueError, lambda: hvd.allreduce(x, average=True, op=hvd.Sum), "average and op")


def case_async_poll_and_names():
    x = torch.ones(16) * (R + 1)
    # The other ranks submit only after rank 0 has polled, so poll() must say False; a poll
    # that blocked until completion would never return (the job's timeout fails the test).
    if R == 0:
        h = hvd.allreduce_async(x, name="async.a", op=hvd.Sum)
        check(hvd.poll(h) is False, "poll() True before the other ranks submitted")
        signal_ranks("async.a.polled")
    else:
        wait_for_signal("async.a.polled")
        h = hvd.allreduce_async(x, name="async.a", op=hvd.Sum)
    out = hvd.synchronize(h)
    close(out, torch.ones(16) * sum(range(1, N + 1)), "async result")
    check(hvd.synchronize(h) is None, "second synchronize returns None")
    # matched by name, not submission order
    names = ["order.a", "order.b", "order.c"]
    vals = {n: torch.full((5,), float(i + 10 * R)) for i, n in enumerate(names)}
    seq = names if R % 2 == 0 else names[::-1]
    hs = {n: hvd.allreduce_async(vals[n], name=n, op=hvd.Sum) for n in seq}
    for i, n in enumerate(names):
        close(hvd.synchronize(hs[n]), torch.full((5,), float(N * i + 10 * sum(range(N)))), n)
    h = hvd.broadcast_async_(torch.zeros(3) + R, 0, name="async.bcast")
    close(hvd.synchronize(h), torch.zeros(3), "broadcast_async_")


def case_grouped():
    xs = [rank_input(R, (k + 1, 3), torch.float32, 30 + k) for k in range(3)]
    refs = [sum(rank_input(r, (k + 1, 3), torch.float32, 30 + k) for r in range(N))
            for k in range(3)]
    outs = hvd.grouped_allreduce(xs, op=hvd.Sum, name="grp")
    for k in range(3):
        close(outs[k], refs[k], f"grouped {k}")
    h = hvd.grouped_allreduce_async_(xs, name="grp.inplace")
    res = hvd.synchronize(h)
    check(all(a is b for a, b in zip(res, xs)), "grouped in-place returns inputs")
    for k in range(3):
        close(xs[k], refs[k] / N, f"grouped in-place {k}")
    gathered = hvd.grouped_allgather([torch.full((R + 1, 2), float(R)), torch.arange(R + 1)])
    close(gathered[0], torch.cat([torch.full((r + 1, 2), float(r)) for r in range(N)]), "gag 0")
    close(gathered[1], torch.cat([torch.arange(r + 1) for r in range(N)]), "gag 1")
    rs = hvd.grouped_reducescatter([torch.ones(2 * N, 2) * (R + 1), torch.ones(N) * R],
                                   op=hvd.Sum)
    close(rs[0], torch.ones(2, 2) * sum(range(1, N + 1)), "grs 0")
    close(rs[1], torch.ones(1) * sum(range(N)), "grs 1")
    check(hvd.grouped_allreduce([]) == [], "empty group")


def case_allgather_broadcast():
    for dtype in DTYPES + [torch.bool]:
        x = rank_input(R, (R + 1, 2), dtype, 4)
        want = torch.cat([rank_input(r, (r + 1, 2), dtype, 4) for r in range(N)])
        close(hvd.allgather(x, name=f"ag.{dtype}"), want, f"allgather {dtype}")
    empty = torch.ones((0, 3)) if R == 0 else torch.ones((2, 3))
    close(hvd.allgather(empty, name="ag.empty"), torch.ones((2 * (N - 1), 3)), "allgather empty")
    for root in range(N):
        x = rank_input(R, (3, 4), torch.float64, 5).t()   # non-contiguous
        want = rank_input(root, (3, 4), torch.float64, 5).t()
        out = hvd.broadcast(x, root, name=f"bc.{root}")
        close(out, want, f"broadcast root {root}")
        close(x, rank_input(R, (3, 4), torch.float64, 5).t(), "broadcast leaves input")
        hvd.broadcast_(x, root, name=f"bc_.{root}")
        close(x, want, f"broadcast_ root {root}")
    bf = torch.full((3,), float(R), dtype=torch.bfloat16)
    close(hvd.broadcast(bf, N - 1), torch.full((3,), float(N - 1), dtype=torch.bfloat16), "bf16 bc")


def case_alltoall_reducescatter():
    x = torch.arange(2 * N, dtype=torch.float32) + 100 * R
    want = torch.cat([torch.arange(2 * R, 2 * R + 2, dtype=torch.float32) + 100 * r
                      for r in range(N)])
    close(hvd.alltoall(x, name="a2a.even"), want, "alltoall even")
    splits = [(R + d) % 3 for d in range(N)]                 # rank R sends splits[d] rows to d
    rows = sum(splits)
    x = torch.arange(rows * 2, dtype=torch.int64).reshape(rows, 2) + 1000 * R
    out, received = hvd.alltoall(x, splits=torch.tensor(splits, dtype=torch.int32), name="a2a.s")
    recv = [(r + R) % 3 for r in range(N)]
    close(received, torch.tensor(recv, dtype=torch.int32), "received splits")
    parts = []
    for r in range(N):
        sp = [(r + d) % 3 for d in range(N)]
        start = sum(sp[:R])
        parts.append(torch.arange(sum(sp) * 2, dtype=torch.int64).reshape(-1, 2)[start:start + sp[R]]
                     + 1000 * r)
    close(out, torch.cat(parts), "alltoall splits")
    out, received = hvd.synchronize(hvd.alltoall_async(torch.ones(N, 1), name="a2a.async"))
    check(received.tolist() == [1] * N, "alltoall_async returns received splits")
    raises(ValueError, lambda: hvd.alltoall(torch.ones(3), splits=[1] * (N + 1)), "bad splits")
    raises(ValueError, lambda: hvd.alltoall(torch.ones(3), splits=[5] + [0] * (N - 1)),
           "splits sum")
    rows = 2 * N + 1
    xs = [rank_input(r, (rows, 3), torch.float32, 6) for r in range(N)]
    total = sum(xs)
    counts = [rows // N + (1 if r < rows % N else 0) for r in range(N)]
    start = sum(counts[:R])
    got = hvd.reducescatter(xs[R], name="rs.avg")
    close(got, total[start:start + counts[R]] / N, "reducescatter average (default)")
    got = hvd.reducescatter(xs[R], op=hvd.Sum, name="rs.sum")
    close(got, total[start:start + counts[R]], "reducescatter sum")
    got = hvd.reducescatter(xs[R], op=hvd.Sum, compression=hvd.Compression.fp16, name="rs.fp16")
    close(got, total[start:start + counts[R]], "reducescatter fp16", atol=1e-2, rtol=1e-3)


def _grad_check(fn, ref_fn, shape, what, tag):
    """fn(x) on each rank vs the gradient of sum_r loss_r computed in one process."""
    xs = [rank_input(r, shape, torch.float64, tag).requires_grad_() for r in range(N)]
    ws = [rank_input(r, (), torch.float64, tag + 1) + 1.5 for r in range(N)]
    x = xs[R].detach().clone().requires_grad_()
    y = fn(x)
    y = y[0] if isinstance(y, tuple) else y
    (ws[R] * (y * torch.linspace(0.5, 1.5, y.numel(), dtype=y.dtype).reshape(y.shape)).sum()
     ).backward()
    total = 0
    for r in range(N):
        yr = ref_fn(xs, r)
        total = total + (ws[r] * (yr * torch.linspace(0.5, 1.5, yr.numel(), dtype=yr.dtype)
                                  .reshape(yr.shape)).sum())
    total.backward()
    want = xs[R].grad if xs[R].grad is not None else torch.zeros_like(xs[R])
    close(x.grad, want, f"gradient of {what}", atol=1e-9)


def case_autograd():
    """The opt-in "sum_of_losses" gradients against a one-process reference (Horovod's default
    gradients are checked by check_horovod_compat.py)."""
    with hvd.gradient_semantics("sum_of_losses"):
        _autograd_sum_of_losses()


def _autograd_sum_of_losses():
    shape = (3, 2)
    _grad_check(lambda x: hvd.allreduce(x, name="g.avg"),
                lambda xs, r: sum(xs) / N, shape, "allreduce average", 40)
    _grad_check(lambda x: hvd.allreduce(x, op=hvd.Sum, prescale_factor=3.0, name="g.sum"),
                lambda xs, r: 3 * sum(xs), shape, "allreduce sum", 42)
    _grad_check(lambda x: hvd.allreduce(x + 1e-3 * R, op=hvd.Max, name="g.max"),   # no ties
                lambda xs, r: torch.stack([x + 1e-3 * k for k, x in enumerate(xs)]).max(0).values,
                shape, "allreduce max", 44)
    _grad_check(lambda x: hvd.allreduce(x, op=hvd.Product, name="g.prod"),
                lambda xs, r: torch.stack(xs).prod(0), shape, "allreduce product", 46)
    _grad_check(lambda x: hvd.grouped_allreduce([x, 2 * x], op=hvd.Sum)[1],
                lambda xs, r: 2 * sum(xs), shape, "grouped allreduce", 48)
    _grad_check(lambda x: hvd.allgather(x[: R + 1]),
                lambda xs, r: torch.cat([xs[k][: k + 1] for k in range(N)]), shape,
                "allgather", 50)
    _grad_check(lambda x: hvd.broadcast(x, N - 1, name="g.bc"),
                lambda xs, r: xs[N - 1], shape, "broadcast", 52)
    _grad_check(lambda x: hvd.alltoall(x.reshape(-1).repeat(N), splits=[6] * N),
                lambda xs, r: torch.cat([xs[k].reshape(-1) for k in range(N)]), shape,
                "alltoall", 54)
    rows = 2 * N + 1
    counts = [rows // N + (1 if r < rows % N else 0) for r in range(N)]

    def rs_ref(xs, r, scale):
        start = sum(counts[:r])
        return scale * sum(xs)[start:start + counts[r]]

    _grad_check(lambda x: hvd.reducescatter(x, name="g.rs"),
                lambda xs, r: rs_ref(xs, r, 1.0 / N), (rows, 2), "reducescatter avg", 56)
    _grad_check(lambda x: hvd.reducescatter(x, op=hvd.Sum, postscale_factor=2.0),
                lambda xs, r: rs_ref(xs, r, 2.0), (rows, 2), "reducescatter sum", 58)


def case_errors_on_every_rank():
    raises(RuntimeError, lambda: hvd.allreduce(torch.ones(3 + R), name="err.shape"),
           "shape mismatch", match="err.shape")
    raises(RuntimeError, lambda: hvd.allreduce(torch.ones(3, dtype=torch.float32 if R == 0
                                                          else torch.float64), name="err.dtype"),
           "dtype mismatch", match="err.dtype")
    raises(RuntimeError, lambda: hvd.allreduce(torch.ones(3), op=hvd.Sum if R == 0 else hvd.Max,
                                               name="err.op"), "op mismatch")
    raises(RuntimeError, lambda: hvd.broadcast(torch.ones(2), R % 2, name="err.root"),
           "root mismatch")
    e = raises(RuntimeError, lambda: hvd.allgather(torch.ones(2, 2 + R), name="err.ag"),
               "allgather trailing dims")
    check(isinstance(e, hvd.HorovodInternalError), "errors are HorovodInternalError")
    close(hvd.allreduce(torch.ones(3), op=hvd.Sum, name="err.after"), torch.ones(3) * N,
          "collectives work after errors")
    h = hvd.allreduce_async(torch.ones(2), name="err.inflight")
    raises(ValueError, lambda: hvd.allreduce_async(torch.ones(2), name="err.inflight"),
           "name already in flight")
    hvd.synchronize(h)
    raises((TypeError, ValueError), lambda: hvd.allreduce(torch.ones(2, dtype=torch.complex64)),
           "complex tensor")
    raises(ValueError, lambda: hvd.broadcast(torch.ones(2), N + 3), "root out of range")
    raises(ValueError, lambda: hvd.poll(987654), "poll unknown handle")
    hvd.barrier()


def case_objects():
    obj = {"rank": R, "items": [1, 2.5, "x"], "f": (lambda v: v + R)}
    got = hvd.broadcast_object(obj, root_rank=N - 1)
    check(got["rank"] == N - 1 and got["f"](1) == N, "broadcast_object")
    got = hvd.allgather_object({"r": R, "pad": "y" * (R * 100)})
    check([g["r"] for g in got] == list(range(N)) and len(got[-1]["pad"]) == 100 * (N - 1),
          "allgather_object")
    check(hvd.broadcast_object(None, 0) is None, "broadcast None")


def case_process_sets():
    ps0 = hvd.add_process_set([0])
    rest = hvd.add_process_set(list(range(1, N)))
    check(ps0.included() == (R == 0) and ps0.size() == 1, "ps0 membership")
    if R == 0:
        close(hvd.allreduce(torch.ones(2) * 7, process_set=ps0, name="ps.ar"), torch.ones(2) * 7,
              "allreduce in singleton set")
        # the other ranks wait for this barrier to return: it must not need them
        hvd.barrier(process_set=ps0)
        signal_ranks("ps0.barrier.done")
    else:
        wait_for_signal("ps0.barrier.done")
        got = hvd.allreduce(torch.ones(2) * R, op=hvd.Sum, process_set=rest, name="ps.rest")
        close(got, torch.ones(2) * sum(range(1, N)), "allreduce in rest set")
        check(rest.rank() == R - 1, "rank within set")
        # root_rank is a global rank (rank 1 = the set's first member), as in Horovod
        got = hvd.broadcast_object("hello" if R == 1 else None, root_rank=1, process_set=rest)
        check(got == "hello", "broadcast_object in set")
    hvd.barrier()
    check(hvd.remove_process_set(ps0) and hvd.remove_process_set(rest), "remove")


def case_join():
    x = torch.ones(4) * (R + 1)
    if R == 0:
        got = [hvd.allreduce(x, op=hvd.Sum, name=f"join.{i}") for i in range(3)]
        close(got[0], torch.ones(4) * sum(range(1, N + 1)), "before join")
        close(got[2], torch.ones(4), "joined ranks contribute zeros")
        last = hvd.join()
    else:
        hvd.allreduce(x, op=hvd.Sum, name="join.0")
        last = hvd.join()
    check(last == 0, f"join() returned {last}, want 0 (last to join)")
    close(hvd.allreduce(torch.ones(1), op=hvd.Sum, name="join.after"), torch.ones(1) * N,
          "after join")


def case_timeline():
    import os
    import tempfile

    path = os.path.join(tempfile.gettempdir(), f"lcc_torch_timeline_{os.getppid()}.json")
    hvd.start_timeline(path)
    hvd.allreduce(torch.ones(4), name="timeline.tensor")
    hvd.stop_timeline()
    if R == 0:
        text = open(path).read()
        os.unlink(path)
        check("timeline.tensor" in text, "timeline names the tensor")


def case_shutdown_reinit():
    hvd.shutdown()
    check(not hvd.is_initialized(), "shutdown")
    hvd.init()
    close(hvd.allreduce(torch.ones(1), op=hvd.Sum, name="reinit"), torch.ones(1) * N, "re-init")


if __name__ == "__main__":
    run([case_before_init, case_init, case_allreduce_dtypes_ops, case_integer_average_truncates,
         case_layouts_and_inplace, case_async_poll_and_names, case_grouped,
         case_allgather_broadcast, case_alltoall_reducescatter, case_autograd,
         case_errors_on_every_rank, case_objects, case_process_sets, case_join,
         case_timeline, case_shutdown_reinit])
