"""Every torch.distributed call on the "lightcc" backend against references every rank builds
from all ranks' seeded inputs (torch ops on the full data, never lightcc's output).

Run under mpirun -np 3 (any N >= 2): init with no argument but the backend (MPI rendezvous),
every collective and op, async forms, subgroups, object collectives, send/recv, callbacks
that issue collectives, errors on every rank, destroy.
"""
from __future__ import annotations

import os
import re
import threading
import warnings
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

import lightcc
import lightcc.torch  # noqa: F401 - registers the backend
from common import check, close, raises, rank_input, run

R = N = 0
FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
INTS = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]
OPS = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg", dist.ReduceOp.MIN: "min",
       dist.ReduceOp.MAX: "max", dist.ReduceOp.PRODUCT: "prod"}


def inputs(shape, dtype, tag):
    return [rank_input(r, shape, dtype, tag) for r in range(N)]


def ref_reduce(xs, op):
    """Reference reduction in float64 / int64, on the full data."""
    if op in (dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR):
        acc = xs[0].to(torch.int64)
        for x in xs[1:]:
            x = x.to(torch.int64)
            acc = acc & x if op == dist.ReduceOp.BAND else acc | x if op == dist.ReduceOp.BOR \
                else acc ^ x
        return acc
    s = torch.stack([x.to(torch.float64) for x in xs])
    if op == dist.ReduceOp.SUM:
        return s.sum(0)
    if op == dist.ReduceOp.AVG:
        return s.sum(0) / len(xs)
    if op == dist.ReduceOp.MIN:
        return s.min(0).values
    if op == dist.ReduceOp.MAX:
        return s.max(0).values
    return s.prod(0)


def tol(dtype):
    return {torch.float16: 3e-3, torch.bfloat16: 2e-2}.get(dtype, 1e-6)


def expect(got, want, what):
    want = want.trunc() if not got.dtype.is_floating_point and got.dtype != torch.bool else want
    close(got, want.to(got.dtype), what, atol=tol(got.dtype), rtol=tol(got.dtype))


def case_init_without_arguments():
    global R, N
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name, None)
    dist.init_process_group("lightcc")
    R, N = dist.get_rank(), dist.get_world_size()
    check(dist.get_backend() == "lightcc", f"backend {dist.get_backend()}")
    check(lightcc.is_initialized() and (lightcc.rank(), lightcc.size()) == (R, N), "lightcc")
    check(dist.group.WORLD.group_name and dist.group.WORLD.group_desc == "default_pg", "names")


def case_allreduce_ops_dtypes():
    for dtype in FLOATS + INTS:
        for op, label in OPS.items():
            if op == dist.ReduceOp.PRODUCT and dtype in (torch.uint8, torch.int8):
                continue          # overflows differently per dtype: covered by wider types
            xs = inputs((3, 4), dtype, 1)
            t = xs[R].clone()
            dist.all_reduce(t, op=op)
            expect(t, ref_reduce(xs, op), f"all_reduce {label} {dtype}")
    for dtype in INTS + [torch.bool]:
        for op in (dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR):
            xs = inputs((7,), dtype, 2)
            t = xs[R].clone()
            dist.all_reduce(t, op=op)
            close(t, ref_reduce(xs, op).to(dtype), f"all_reduce {op} {dtype}")
    b = torch.tensor([R == 0, False, True])
    dist.all_reduce(b)                                            # bool SUM is logical or
    close(b, torch.tensor([True, False, True]), "bool sum")
    t = torch.full((5,), float(R + 1))
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5))
    close(t, torch.full((5,), 0.5 * sum(range(1, N + 1))), "premul_sum")
    nc = rank_input(R, (4, 6), torch.float32, 3).t()
    check(not nc.is_contiguous(), "setup")
    dist.all_reduce(nc)
    close(nc, sum(inputs((4, 6), torch.float32, 3)).t(), "non-contiguous in place")
    z = torch.ones(0, 3)
    dist.all_reduce(z)
    check(z.shape == (0, 3), "zero-size")


def case_numpy_api_bitwise():
    x = np.array([R + 1, 6, 1 << R], dtype=np.int32)
    want = [np.bitwise_and.reduce, np.bitwise_or.reduce, np.bitwise_xor.reduce]
    alls = np.stack([np.array([r + 1, 6, 1 << r], dtype=np.int32) for r in range(N)])
    for op, fn in zip((lightcc.BitwiseAnd, lightcc.BitwiseOr, lightcc.BitwiseXor), want):
        got = lightcc.allreduce(x, op=op, name=f"np.{op}")
        check(np.array_equal(got, fn(alls, axis=0)), f"numpy {op}: {got}")
    raises(lightcc.UnsupportedDTypeError, lambda: lightcc.allreduce(np.ones(2), op="band"),
           "band on float", match="integer or bool")


def case_async_and_futures():
    xs = inputs((6,), torch.float32, 4)
    t = xs[R].clone()
    work = dist.all_reduce(t, async_op=True)
    fut = work.get_future()
    check(work.wait() is True and work.is_completed() and work.is_success(), "work state")
    val = fut.wait()
    check(isinstance(val, list) and val[0] is t, f"future value {val!r}")
    close(t, sum(xs), "async all_reduce")
    # then-callbacks run off the engine thread and may issue (and wait for) collectives
    t2 = xs[R].clone()
    chained = dist.all_reduce(t2, async_op=True).get_future().then(
        lambda f: dist.all_reduce(f.value()[0] * 2, async_op=True).get_future().wait()[0])
    close(chained.wait(), sum(xs) * 2 * N, "collective inside a then-callback")
    done = threading.Event()
    dist.barrier(async_op=True).get_future().add_done_callback(lambda f: done.set())
    check(done.wait(30), "add_done_callback ran")
    works = [dist.broadcast(torch.full((2,), float(R)), src=s, async_op=True) for s in range(N)]
    futs = torch.futures.collect_all([w.get_future() for w in works]).wait()
    for s, f in enumerate(futs):
        close(f.value()[0], torch.full((2,), float(s)), f"collect_all broadcast {s}")


def case_broadcast_reduce():
    for root in range(N):
        for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool):
            t = rank_input(R, (3, 2), dtype, 5)
            dist.broadcast(t, src=root)
            close(t, rank_input(root, (3, 2), dtype, 5), f"broadcast {dtype} from {root}")
        xs = inputs((4,), torch.float64, 6)
        t = xs[R].clone()
        dist.reduce(t, dst=root, op=dist.ReduceOp.MAX)
        close(t, ref_reduce(xs, dist.ReduceOp.MAX) if R == root else xs[R], f"reduce to {root}")


def case_gathers():
    for dtype in (torch.float32, torch.float16, torch.int32, torch.bool):
        xs = inputs((2, 3), dtype, 7)
        outs = [torch.empty(2, 3, dtype=dtype) for _ in range(N)]
        dist.all_gather(outs, xs[R])
        for r in range(N):
            close(outs[r], xs[r], f"all_gather {dtype} from {r}")
        big = torch.empty(2 * N, 3, dtype=dtype)
        dist.all_gather_into_tensor(big, xs[R])
        close(big, torch.cat(xs), f"all_gather_into_tensor {dtype}")
    uneven = [torch.full((r + 1,), float(r)) for r in range(N)]
    outs = [torch.empty(r + 1) for r in range(N)]
    dist.all_gather(outs, uneven[R])
    for r in range(N):
        close(outs[r], uneven[r], f"uneven all_gather {r}")
    xs = inputs((5,), torch.float32, 8)
    for root in range(N):
        gl = [torch.empty(5) for _ in range(N)] if R == root else None
        dist.gather(xs[R], gather_list=gl, dst=root)
        if R == root:
            for r in range(N):
                close(gl[r], xs[r], f"gather to {root} from {r}")
        out = torch.empty(5)
        dist.scatter(out, scatter_list=[xs[root] + d for d in range(N)] if R == root else None,
                     src=root)
        close(out, xs[root] + R, f"scatter from {root}")
    got = [None] * N
    dist.all_gather_object(got, {"rank": R, "tag": "x" * R})
    check(got == [{"rank": r, "tag": "x" * r} for r in range(N)], f"all_gather_object {got}")
    objs = [f"obj{R}", R] if R == 1 % N else [None, None]
    dist.broadcast_object_list(objs, src=1 % N)
    check(objs == [f"obj{1 % N}", 1 % N], f"broadcast_object_list {objs}")


def case_all_gather_coalesced():
    """torch's documented semantics: output_tensor_lists[r][j] is rank r's j-th input."""
    shapes = [(2, 3), (4,), (0,), (), (3, 1, 2)]
    for dtype in (torch.float32, torch.int64, torch.complex64):
        base = torch.float32 if dtype == torch.complex64 else dtype
        mine = [rank_input(R, s, base, 20 + j) for j, s in enumerate(shapes)]
        if dtype == torch.complex64:
            mine = [torch.complex(x, x + 1) for x in mine]
        outs = [[torch.full(s, -1, dtype=dtype) for s in shapes] for _ in range(N)]
        dist.all_gather_coalesced(outs, mine)
        for r in range(N):
            for j, s in enumerate(shapes):
                want = rank_input(r, s, base, 20 + j)
                if dtype == torch.complex64:
                    want = torch.complex(want, want + 1)
                check(torch.equal(outs[r][j], want),
                      f"all_gather_coalesced {dtype}: rank {r} tensor {j}: {outs[r][j]}")
    outs = [[torch.empty(2), torch.empty(1)] for _ in range(N)]
    fut = dist.all_gather_coalesced(outs, [torch.full((2,), float(R)), torch.ones(1) * R],
                                    async_op=True)
    fut.wait()
    for r in range(N):
        close(outs[r][0], torch.full((2,), float(r)), f"async all_gather_coalesced {r}")
        close(outs[r][1], torch.full((1,), float(r)), f"async all_gather_coalesced {r} 1")
    # misuse raises at once on every rank; different row lengths fail on every rank
    raises(lightcc.LightCCError, lambda: dist.all_gather_coalesced(
        [[torch.empty(2)]], [torch.ones(2)]), "one output list", match="one per rank")
    raises(lightcc.LightCCError, lambda: dist.all_gather_coalesced(
        [[torch.empty(3)] for _ in range(N)], [torch.ones(2)]), "output sizes",
        match="elements per tensor")
    k = 2 if R == 0 else 3
    raises(lightcc.LightCCError, lambda: dist.all_gather_coalesced(
        [[torch.empty(k)] for _ in range(N)], [torch.ones(k)]), "ranks differ", match="shape")


def case_reduce_scatter_alltoall():
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX):
        xs = inputs((N * 2, 3), torch.float32, 9)
        out = torch.empty(2, 3)
        dist.reduce_scatter_tensor(out, xs[R], op=op)
        close(out, ref_reduce(xs, op)[2 * R:2 * R + 2].float(), f"reduce_scatter_tensor {op}")
        lists = [list(x.chunk(N)) for x in xs]
        out = torch.empty(2, 3)
        dist.reduce_scatter(out, lists[R], op=op)
        close(out, ref_reduce(xs, op)[2 * R:2 * R + 2].float(), f"reduce_scatter {op}")
    x = torch.arange(2 * N, dtype=torch.float32) + 100 * R
    out = torch.empty(2 * N)
    dist.all_to_all_single(out, x)
    want = torch.cat([torch.arange(2 * R, 2 * R + 2, dtype=torch.float32) + 100 * r
                      for r in range(N)])
    close(out, want, "all_to_all_single even")
    send = [(R + d) % 3 for d in range(N)]                  # rows rank R sends to rank d
    recv = [(r + R) % 3 for r in range(N)]
    x = torch.arange(sum(send) * 2, dtype=torch.int64).reshape(-1, 2) + 1000 * R
    out = torch.empty(sum(recv), 2, dtype=torch.int64)
    dist.all_to_all_single(out, x, output_split_sizes=recv, input_split_sizes=send)
    parts = []
    for r in range(N):
        theirs = [(r + d) % 3 for d in range(N)]
        start = sum(theirs[:R])
        parts.append(torch.arange(sum(theirs) * 2, dtype=torch.int64).reshape(-1, 2)[
            start:start + theirs[R]] + 1000 * r)
    close(out, torch.cat(parts), "all_to_all_single uneven")
    outs = [torch.empty(r + 1) for r in range(N)]
    dist.all_to_all(outs, [torch.full((R + 1,), float(10 * R + d)) for d in range(N)])
    for r in range(N):
        close(outs[r], torch.full((r + 1,), float(10 * r + R)), f"all_to_all from {r}")


def case_subgroups():
    evens = dist.new_group([r for r in range(N) if r % 2 == 0])
    lasts = dist.new_group([N - 2, N - 1])
    if R % 2 == 0:
        members = [r for r in range(N) if r % 2 == 0]
        t = torch.full((3,), float(R + 1))
        dist.all_reduce(t, group=evens)
        close(t, torch.full((3,), float(sum(m + 1 for m in members))), "subgroup all_reduce")
        t = torch.full((2,), float(R))
        dist.broadcast(t, src=members[-1], group=evens)         # src is a global rank
        close(t, torch.full((2,), float(members[-1])), "subgroup broadcast")
        check(dist.get_rank(evens) == members.index(R), "group rank")
    else:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dist.all_reduce(torch.ones(1), group=evens)         # torch: warning, no-op
        check(any("does not belong" in str(w.message) for w in caught),
              f"non-member warning: {[str(w.message) for w in caught]}")
    if R >= N - 2:
        outs = [torch.empty(1) for _ in range(2)]
        dist.all_gather(outs, torch.full((1,), float(R)), group=lasts)
        close(torch.cat(outs), torch.tensor([N - 2.0, N - 1.0]), "second subgroup")
    dist.barrier()


def case_point_to_point_and_timeouts():
    nxt, prv = (R + 1) % N, (R - 1) % N
    got = torch.empty(4, dtype=torch.bfloat16)
    reqs = [dist.isend(torch.full((4,), float(R), dtype=torch.bfloat16), nxt, tag=3),
            dist.irecv(got, prv, tag=3)]
    for q in reqs:
        q.wait()
    close(got, torch.full((4,), float(prv), dtype=torch.bfloat16), "ring isend/irecv")
    if R == 0:
        srcs = set()
        for _ in range(N - 1):
            t = torch.empty(2)
            src = dist.recv(t, tag=9)                            # any source
            close(t, torch.full((2,), float(src)), f"recv_anysource from {src}")
            srcs.add(src)
        check(srcs == set(range(1, N)), f"recv_anysource sources {srcs}")
    else:
        dist.send(torch.full((2,), float(R)), 0, tag=9)
    ops = [dist.P2POp(dist.isend, torch.full((3,), float(R)), nxt),
           dist.P2POp(dist.irecv, got3 := torch.empty(3), prv)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    close(got3, torch.full((3,), float(prv)), "batch_isend_irecv")
    pg = dist.new_group(list(range(N)), timeout=timedelta(seconds=1))
    if R == 0:          # a recv whose sender never comes fails with the group's timeout
        raises(lightcc.LightCCError, lambda: dist.recv(torch.empty(1), 1, group=pg, tag=77),
               "recv timeout", match="did not complete within 1 s")
        raises(lightcc.LightCCError, lambda: dist.recv(torch.empty(1), 1, group=pg, tag=5),
               "message longer than the tensor", match="failed")
        raises(lightcc.LightCCError, lambda: dist.recv(torch.empty(3), 1, group=pg, tag=6),
               "message shorter than the tensor", match="sent 4 bytes")
    elif R == 1:
        dist.send(torch.ones(3), 0, group=pg, tag=5)
        dist.send(torch.ones(1), 0, group=pg, tag=6)
    dist.barrier()
    # a collective the other ranks never issue: wait() and the future both time out
    if R == 0:      # (pg's ordered stream is out of step on rank 0 afterwards: not used again)
        work = dist.all_reduce(torch.ones(1), group=pg, async_op=True)
        exc = raises(lightcc.LightCCError, work.wait, "work.wait timeout", match="within 1 s")
        # torch's own suite (test_barrier_timeout_*) recognizes a timeout by this pattern
        check(re.search(" (Timed out|closed|timeout) ", str(exc)), f"torch's pattern: {exc}")
        raises(lightcc.LightCCError, work.get_future().wait, "future timeout (watchdog)",
               match="within 1 s")
    dist.barrier()


def case_mismatch_errors_every_rank():
    shape = (3,) if R == 0 else (4,)
    raises(lightcc.LightCCError, lambda: dist.all_reduce(torch.ones(shape)),
           "shape mismatch", match="shape")
    dtype = torch.float32 if R == 0 else torch.float64
    raises(lightcc.LightCCError, lambda: dist.all_reduce(torch.ones(3, dtype=dtype)),
           "dtype mismatch", match="dtype")
    op = dist.ReduceOp.SUM if R == 0 else dist.ReduceOp.MAX
    raises(lightcc.LightCCError, lambda: dist.all_reduce(torch.ones(3), op=op),
           "op mismatch", match="op")
    raises(lightcc.LightCCError, lambda: dist.all_gather_into_tensor(
        torch.empty(N * (2 if R == 0 else 3)), torch.ones(2 if R == 0 else 3)),
        "all_gather_into_tensor shape mismatch", match="shape")
    # different collectives at the same position of the group's stream
    raises(lightcc.LightCCError, lambda: dist.all_reduce(torch.ones(2)) if R == 0
           else dist.broadcast(torch.ones(2), src=0), "collective type mismatch", match="")
    # local misuse raises at once on every rank, naming the collective and the option
    raises(lightcc.LightCCError, lambda: dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BAND),
           "BAND on float", match="BAND")
    raises(lightcc.LightCCError, lambda: dist.all_reduce(torch.ones(2, dtype=torch.uint32)),
           "unsupported dtype", match="uint32")
    c = torch.full((2,), complex(R, 1), dtype=torch.complex64)
    dist.all_reduce(c)                          # torch views complex as real pairs for SUM
    close(torch.view_as_real(c), torch.tensor([[sum(range(N)), N]] * 2, dtype=torch.float32),
          "complex sum")
    raises(lightcc.LightCCError, lambda: dist.broadcast(torch.ones(2), src=N + 3),
           "bad root", match="")
    raises(lightcc.LightCCError, lambda: dist.all_gather_into_tensor(torch.empty(1),
                                                                     torch.ones(2)),
           "bad output size", match="expected")
    t = torch.ones(4)
    dist.all_reduce(t)                          # the group still works after the errors
    close(t, torch.full((4,), float(N)), "after errors")


def case_destroy():
    sub = dist.new_group(list(range(N)))
    dist.destroy_process_group(sub)
    raises(lightcc.LightCCError, lambda: sub.allreduce([torch.ones(1)]), "destroyed subgroup",
           match="destroyed")
    world = dist.group.WORLD
    dist.destroy_process_group()
    raises(lightcc.LightCCError, lambda: world.allreduce([torch.ones(1)]), "destroyed world",
           match="destroyed")
    raises((ValueError, RuntimeError), lambda: dist.all_reduce(torch.ones(1)),
           "dist call after destroy")


run([case_init_without_arguments, case_allreduce_ops_dtypes, case_numpy_api_bitwise,
     case_async_and_futures, case_broadcast_reduce, case_gathers, case_all_gather_coalesced,
     case_reduce_scatter_alltoall,
     case_subgroups, case_point_to_point_and_timeouts, case_mismatch_errors_every_rank, case_destroy])
