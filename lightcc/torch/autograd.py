"""Differentiable collectives: ``allreduce``, ``allgather``, ``broadcast``, ``alltoall``,
``reducescatter`` and their grouped forms.

Gradient semantics (:func:`set_gradient_semantics`):

- ``"horovod"`` (the default) gives exactly Horovod's gradients, which assume the loss is
  averaged over ranks: allgather's backward averages the incoming gradients over the set and
  keeps this rank's slice; broadcast's averages them and gives the result to the root (zeros
  elsewhere); reducescatter's allgathers the gradient times ``prescale * postscale`` (times
  the set size for Sum).
- ``"sum_of_losses"``: the gradient a rank receives is the gradient of the *sum of all ranks'
  losses*, the value one process holding every rank's data would compute (allgather and
  broadcast sum instead of averaging; reducescatter divides by the set size).

Both agree on allreduce Sum/Average and alltoall. Min/Max/Product allreduce always get their
exact gradient (Horovod re-applies the op to the gradients instead). Backward collectives use
generated names, so every rank must run backward through the same collectives in the same
order.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import torch
from torch.autograd import Function

from ..common import api as _api
from ..common.api import Adasum, Average, Max, Min, Product, Sum, global_process_set
from ..common.exceptions import InvalidArgumentError
from . import collectives as _ops
from .compression import spec_of

HOROVOD = "horovod"
SUM_OF_LOSSES = "sum_of_losses"
_semantics = HOROVOD


def set_gradient_semantics(mode: str) -> str:
    """Choose the gradients of allgather, broadcast and reducescatter; returns the previous mode.

    ``"horovod"`` (default): Horovod's (the loss is assumed averaged over ranks).
    ``"sum_of_losses"``: the gradient of the sum of all ranks' losses. The mode in force when
    a collective runs forward decides its backward.
    """
    global _semantics
    if mode not in (HOROVOD, SUM_OF_LOSSES):
        raise InvalidArgumentError(f"gradient semantics must be {HOROVOD!r} or "
                                   f"{SUM_OF_LOSSES!r}, got {mode!r}")
    previous, _semantics = _semantics, mode
    return previous


@contextlib.contextmanager
def gradient_semantics(mode: str) -> Iterator[None]:
    """``with gradient_semantics("sum_of_losses"): ...`` (see :func:`set_gradient_semantics`)."""
    previous = set_gradient_semantics(mode)
    try:
        yield
    finally:
        set_gradient_semantics(previous)


def _gather_reduce_op(mode: str) -> Any:
    """How allgather's and broadcast's backward combine the ranks' gradients."""
    return Average if mode == HOROVOD else Sum


def _scatter_grad_scale(op: Any, pre: float, post: float, n: int, mode: str) -> float:
    """The factor reducescatter's backward applies before allgathering the gradient."""
    if mode == HOROVOD:
        return pre * post * (n if op == Sum else 1)
    return pre * post / (n if op == Average else 1)


# ---- allreduce --------------------------------------------------------------------------------
class _Allreduce(Function):
    @staticmethod
    def forward(ctx, tensor, name, op, pre, post, process_set, compression):
        ctx.op, ctx.pre, ctx.post, ctx.process_set = op, pre, post, process_set
        result = _ops._allreduce_now(tensor, False, name, op, pre, post, process_set,
                                     compression)
        if op in (Min, Max, Product):
            ctx.save_for_backward(tensor, result)
        return result

    @staticmethod
    def backward(ctx, grad):
        return (_allreduce_grad(ctx, grad.contiguous()), None, None, None, None, None, None)


def _allreduce_grad(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
    ps, op = ctx.process_set, ctx.op
    if op in (Sum, Average):
        return _ops._allreduce_now(grad, False, None, op, ctx.pre, ctx.post, ps)
    x, y = ctx.saved_tensors
    total = _ops._allreduce_now(grad, False, None, Sum, 1.0, 1.0, ps)
    if op == Product:   # d y / d x_r = post * pre^n * prod_{k != r} x_k, exact with zeros
        gathered = allgather(x.detach().unsqueeze(0), process_set=ps)
        others = gathered.clone()
        others[_api.process_set_rank(ps)] = 1
        n = gathered.shape[0]
        return total * ctx.post * ctx.pre ** n * torch.prod(others, dim=0)
    # Min/Max: the rank(s) holding the extremum get the gradient; ties share it equally.
    hit = (x.detach() * ctx.pre * ctx.post == y).to(grad.dtype)
    ties = _ops._allreduce_now(hit, False, None, Sum, 1.0, 1.0, ps)
    return total * hit * ctx.pre * ctx.post / ties.clamp(min=1)


def allreduce(tensor: torch.Tensor, average: Any = None, name: str | None = None,
              compression: Any = None, op: Any = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0,
              process_set: Any = global_process_set) -> torch.Tensor:
    """Average (default) or reduce ``tensor`` over all ranks; differentiable.

    ``compression`` (e.g. ``Compression.fp16``) is applied by the engine to the wire format;
    with ``op=Adasum`` a cast (fp16, bf16) is applied to the tensor itself, as in Horovod: the
    Adasum combination runs in that dtype and the result is cast back.
    """
    op = _ops.handle_average_backwards_compatibility(op, average)
    spec = spec_of(compression)
    if op is Adasum and spec in ("fp16", "bf16"):
        spec = None     # Adasum combines what it is given: cast per tensor, as Horovod does
    if spec == "none" and not (tensor.requires_grad and torch.is_grad_enabled()):
        # nothing to differentiate (a metric, say): skip autograd.Function's ~40 us
        return _ops._allreduce_now(tensor, False, name, op, prescale_factor, postscale_factor,
                                   process_set)
    if spec is None:   # Horovod-style custom compressor: per tensor, as Horovod does
        compressed, cctx = compression.compress(tensor)
        out = _Allreduce.apply(compressed, name, op, prescale_factor, postscale_factor,
                               process_set, None)
        return compression.decompress(out, cctx)
    return _Allreduce.apply(tensor, name, op, prescale_factor, postscale_factor, process_set,
                            None if spec == "none" else compression)


class _GroupedAllreduce(Function):
    @staticmethod
    def forward(ctx, name, op, pre, post, process_set, compression, *tensors):
        ctx.op, ctx.pre, ctx.post, ctx.process_set = op, pre, post, process_set
        return tuple(_ops.synchronize(_ops._grouped_allreduce_submit(
            tensors, False, name, op, pre, post, process_set, compression)))

    @staticmethod
    def backward(ctx, *grads):
        reduced = _ops.synchronize(_ops._grouped_allreduce_submit(
            [g.contiguous() for g in grads], False, None, ctx.op, ctx.pre, ctx.post,
            ctx.process_set))
        return (None, None, None, None, None, None, *reduced)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: Any = None,
                      name: str | None = None, compression: Any = None, op: Any = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: Any = global_process_set) -> list[torch.Tensor]:
    """Reduce a list of tensors as one fused group; differentiable."""
    op = _ops.handle_average_backwards_compatibility(op, average)
    if not tensors:
        return []
    if op not in (Sum, Average) or spec_of(compression) is None:
        base = _ops._base_name("allreduce", name, process_set)
        return [allreduce(t, None, f"{base}.{i}", compression, op, prescale_factor,
                          postscale_factor, process_set) for i, t in enumerate(tensors)]
    comp = None if spec_of(compression) == "none" else compression
    return list(_GroupedAllreduce.apply(name, op, prescale_factor, postscale_factor,
                                        process_set, comp, *tensors))


# ---- allgather --------------------------------------------------------------------------------
def _allgather_grad(grad: torch.Tensor, dim0: int, process_set: Any,
                    mode: str) -> torch.Tensor:
    total = _ops._allreduce_now(grad.contiguous(), False, None, _gather_reduce_op(mode), 1.0,
                                1.0, process_set)
    dims = allgather(torch.tensor([dim0], dtype=torch.int64), process_set=process_set)
    offset = int(dims[:_api.process_set_rank(process_set)].sum())
    return total.narrow(0, offset, dim0)


class _Allgather(Function):
    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.dim0, ctx.process_set = tensor.shape[0] if tensor.dim() else 0, process_set
        ctx.mode = _semantics
        return _ops.synchronize(_ops.allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx, grad):
        return _allgather_grad(grad, ctx.dim0, ctx.process_set, ctx.mode), None, None


def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: Any = global_process_set) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along dimension 0; differentiable."""
    return _Allgather.apply(tensor, name, process_set)


class _GroupedAllgather(Function):
    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.dims, ctx.process_set = [t.shape[0] for t in tensors], process_set
        ctx.mode = _semantics
        return tuple(_ops.synchronize(_ops.grouped_allgather_async(tensors, name, process_set)))

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *[_allgather_grad(g, d, ctx.process_set, ctx.mode)
                              for g, d in zip(grads, ctx.dims)])


def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: Any = global_process_set) -> list[torch.Tensor]:
    if not tensors:
        return []
    return list(_GroupedAllgather.apply(name, process_set, *tensors))


# ---- broadcast --------------------------------------------------------------------------------
class _Broadcast(Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank, ctx.process_set, ctx.mode = root_rank, process_set, _semantics
        return _ops.synchronize(_ops.broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx, grad):
        total = _ops._allreduce_now(grad.contiguous(), False, None,
                                    _gather_reduce_op(ctx.mode), 1.0, 1.0, ctx.process_set)
        if _api.rank() != ctx.root_rank:
            total = torch.zeros_like(total)
        return total, None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: Any = global_process_set) -> torch.Tensor:
    """``root_rank``'s ``tensor`` on every rank (a new tensor); differentiable.

    ``root_rank`` is a global rank, also within a process set (as in Horovod).
    """
    return _Broadcast.apply(tensor, root_rank, name, process_set)


# ---- alltoall ---------------------------------------------------------------------------------
class _Alltoall(Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        out, received = _ops.synchronize(_ops.alltoall_async(tensor, splits, name, process_set))
        ctx.received, ctx.process_set = received, process_set
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad, _dead):
        back, _ = _ops.synchronize(_ops.alltoall_async(grad.contiguous(), ctx.received, None,
                                                       ctx.process_set))
        return back, None, None, None


def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
             process_set: Any = global_process_set) -> Any:
    """Send rows ``splits[r]`` of ``tensor`` to rank r; differentiable.

    Returns the received rows, plus ``received_splits`` when ``splits`` was given.
    """
    out, received = _Alltoall.apply(tensor, splits, name, process_set)
    return out if splits is None else (out, received)


# ---- reducescatter ----------------------------------------------------------------------------
class _Reducescatter(Function):
    @staticmethod
    def forward(ctx, tensor, name, op, process_set, pre, post):
        n = len(_api.process_set_ranks(process_set))
        ctx.scale = _scatter_grad_scale(op, pre, post, n, _semantics)
        ctx.process_set = process_set
        return _ops.synchronize(_ops.reducescatter_async(tensor, name, op, process_set, pre,
                                                         post))

    @staticmethod
    def backward(ctx, grad):
        g = grad.contiguous() * ctx.scale
        return allgather(g, process_set=ctx.process_set), None, None, None, None, None


def _cast_for(compression: Any) -> torch.dtype | None:
    spec = spec_of(compression)
    if spec in (None, "none"):
        return None
    if spec == "fp16":
        return torch.float16
    if spec == "bf16":
        return torch.bfloat16
    raise ValueError(f"reducescatter supports compression none, fp16 and bf16, got {spec!r}")


def reducescatter(tensor: torch.Tensor, name: str | None = None, compression: Any = None,
                  op: Any = Average, process_set: Any = global_process_set,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks (Average by default) and keep this rank's rows."""
    if spec_of(compression) is None:
        compressed, cctx = compression.compress(tensor)
        out = _Reducescatter.apply(compressed, name, op, process_set, prescale_factor,
                                   postscale_factor)
        return compression.decompress(out, cctx)
    cast = _cast_for(compression) if tensor.is_floating_point() else None
    src = tensor.to(cast) if cast is not None else tensor
    out = _Reducescatter.apply(src, name, op, process_set, prescale_factor, postscale_factor)
    return out.to(tensor.dtype) if cast is not None else out


class _GroupedReducescatter(Function):
    @staticmethod
    def forward(ctx, name, op, process_set, pre, post, *tensors):
        n = len(_api.process_set_ranks(process_set))
        ctx.scale = _scatter_grad_scale(op, pre, post, n, _semantics)
        ctx.process_set = process_set
        return tuple(_ops.synchronize(_ops.grouped_reducescatter_async(
            tensors, name, op, process_set, pre, post)))

    @staticmethod
    def backward(ctx, *grads):
        gathered = grouped_allgather([g.contiguous() * ctx.scale for g in grads],
                                     process_set=ctx.process_set)
        return (None, None, None, None, None, *gathered)


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: str | None = None,
                          compression: Any = None, op: Any = Average,
                          process_set: Any = global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """:func:`reducescatter` on a list of tensors submitted together (names ``name.i``)."""
    if not tensors:
        return []
    if spec_of(compression) is None:
        pairs = [compression.compress(t) for t in tensors]
        outs = _GroupedReducescatter.apply(name, op, process_set, prescale_factor,
                                           postscale_factor, *[p[0] for p in pairs])
        return [compression.decompress(o, p[1]) for o, p in zip(outs, pairs)]
    casts = [_cast_for(compression) if t.is_floating_point() else None for t in tensors]
    srcs = [t.to(c) if c is not None else t for t, c in zip(tensors, casts)]
    outs = _GroupedReducescatter.apply(name, op, process_set, prescale_factor,
                                       postscale_factor, *srcs)
    return [o.to(t.dtype) if c is not None else o for o, t, c in zip(outs, tensors, casts)]
