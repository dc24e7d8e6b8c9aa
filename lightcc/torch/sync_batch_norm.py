"""``SyncBatchNorm``: batch normalization with statistics over the whole global batch.

Works on CPU and CUDA tensors (the statistics stay on the input's device). Forward allgathers
each rank's per-channel (count, mean, M2) and combines them with Chan's parallel-variance
formula (one collective, numerically stable, ranks may hold different batch sizes); backward
allreduces the two per-channel sums the input gradient needs. Weight and bias gradients stay
local: the DistributedOptimizer averages them like any other gradient.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd import Function
from torch.nn.modules.batchnorm import _BatchNorm

from ..common.api import Sum, global_process_set
from . import basics
from . import collectives as _ops
from .autograd import allgather


class SyncBatchNorm(_BatchNorm):
    """Drop-in for ``torch.nn.BatchNorm{1,2,3}d`` that normalizes over all ranks' samples.

    Arguments as in ``torch.nn.BatchNorm2d``: ``num_features`` (C of an (N, C, ...) input),
    ``eps`` (1e-5), ``momentum`` (0.1; None for a cumulative average), ``affine`` and
    ``track_running_stats``. ``process_set`` limits the statistics to a subset of ranks.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 process_set: Any = global_process_set) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        use_batch_stats = self.training or not self.track_running_stats
        if not use_batch_stats or basics.size() == 1:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight,
                                self.bias, use_batch_stats, factor, self.eps)
        return _SyncBatchNormFn.apply(input, self.weight, self.bias, self.running_mean,
                                      self.running_var, self.eps, factor, self.process_set)


def _channels_last_2d(x: torch.Tensor) -> torch.Tensor:
    """(N, C, *) -> (N * prod(*), C) view for per-channel reductions."""
    return x.transpose(0, 1).reshape(x.shape[1], -1).t()


class _SyncBatchNormFn(Function):
    @staticmethod
    def forward(ctx, input, weight, bias, running_mean, running_var, eps, momentum,
                process_set):
        x = input.detach()
        flat = _channels_last_2d(x).to(torch.float64)
        count = flat.shape[0]
        mean = flat.mean(0) if count else flat.new_zeros(flat.shape[1])
        m2 = ((flat - mean) ** 2).sum(0)
        stats = torch.cat([flat.new_tensor([float(count)]), mean, m2])
        gathered = allgather(stats.unsqueeze(0), name=None, process_set=process_set)
        c = x.shape[1]
        counts, means, m2s = gathered[:, 0], gathered[:, 1:1 + c], gathered[:, 1 + c:]
        total = counts.sum()
        if total <= 1:
            raise ValueError(f"SyncBatchNorm: expected more than 1 value per channel over all "
                             f"ranks when training, got {int(total)}")
        g_mean = (counts[:, None] * means).sum(0) / total
        g_m2 = (m2s + counts[:, None] * (means - g_mean) ** 2).sum(0)
        var = g_m2 / total
        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_(g_mean.to(running_mean.dtype) * momentum)
            unbiased = g_m2 / (total - 1)
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype) * momentum)
        shape = [1, c] + [1] * (x.dim() - 2)
        invstd = (var + eps).rsqrt()
        xhat = ((x.to(torch.float64) - g_mean.view(shape)) * invstd.view(shape))
        ctx.save_for_backward(xhat.to(x.dtype), weight, invstd.to(x.dtype))
        ctx.total, ctx.process_set = float(total), process_set
        out = xhat.to(x.dtype)
        if weight is not None:
            out = out * weight.view(shape) + bias.view(shape)
        return out

    @staticmethod
    def backward(ctx, grad_output):
        xhat, weight, invstd = ctx.saved_tensors
        g = grad_output.contiguous()
        c = g.shape[1]
        shape = [1, c] + [1] * (g.dim() - 2)
        g2 = _channels_last_2d(g)
        local_dy = g2.sum(0)
        local_dy_xhat = (g2 * _channels_last_2d(xhat)).sum(0)
        grad_weight = local_dy_xhat if weight is not None and ctx.needs_input_grad[1] else None
        grad_bias = local_dy if weight is not None and ctx.needs_input_grad[2] else None
        grad_input = None
        if ctx.needs_input_grad[0]:
            sums = _ops.synchronize(_ops._allreduce_submit(
                torch.cat([local_dy, local_dy_xhat]), False, None, Sum, 1.0, 1.0,
                ctx.process_set))
            mean_dy = (sums[:c] / ctx.total).view(shape)
            mean_dy_xhat = (sums[c:] / ctx.total).view(shape)
            scale = invstd.view(shape) * (weight.view(shape) if weight is not None else 1.0)
            grad_input = scale * (g - mean_dy - xhat * mean_dy_xhat)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None
