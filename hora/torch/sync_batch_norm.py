"""Batch normalisation with statistics computed over all ranks' batches."""

from __future__ import annotations

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from hora.core import runtime
from hora.core.ops import ReduceOp
from hora.core.runtime import global_process_set
from hora.torch import mpi_ops


def _sum_across(t: torch.Tensor, process_set) -> torch.Tensor:
    return mpi_ops.synchronize(mpi_ops.allreduce_async(t, op=ReduceOp.SUM, process_set=process_set))


class _SyncBatchNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, process_set):
        channels = x.shape[1]
        dims = [d for d in range(x.dim()) if d != 1]
        count = torch.tensor([x.numel() // channels], dtype=x.dtype, device=x.device)
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        stats = torch.cat([xf.sum(dims), (xf * xf).sum(dims), count.to(xf.dtype)])
        stats = _sum_across(stats, process_set)
        total = stats[-1]
        mean = stats[:channels] / total
        var = (stats[channels : 2 * channels] / total - mean * mean).clamp_min(0)
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None:
            with torch.no_grad():
                unbiased = var * total / (total - 1).clamp_min(1)
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        shape = [1, channels] + [1] * (x.dim() - 2)
        xhat = (xf - mean.view(shape)) * invstd.view(shape)
        y = xhat
        if weight is not None:
            y = y * weight.view(shape) + bias.view(shape)
        ctx.save_for_backward(xhat, weight, invstd, total)
        ctx.process_set = process_set
        ctx.dims = dims
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        xhat, weight, invstd, total = ctx.saved_tensors
        channels = xhat.shape[1]
        shape = [1, channels] + [1] * (xhat.dim() - 2)
        dyf = dy.to(xhat.dtype)
        sum_dy = dyf.sum(ctx.dims)
        sum_dy_xhat = (dyf * xhat).sum(ctx.dims)
        grad_weight = sum_dy_xhat if weight is not None else None
        grad_bias = sum_dy if weight is not None else None
        reduced = _sum_across(torch.cat([sum_dy, sum_dy_xhat]), ctx.process_set)
        g_dy, g_dy_xhat = reduced[:channels], reduced[channels:]
        scale = invstd if weight is None else invstd * weight.to(invstd.dtype)
        dx = (dyf - g_dy.view(shape) / total - xhat * (g_dy_xhat.view(shape) / total)) * scale.view(shape)
        return dx.to(dy.dtype), grad_weight, grad_bias, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """``BatchNorm*d`` whose batch statistics are reduced across the ranks of a process set.

    In training mode with more than one rank, mean and variance come from
    the union of every rank's batch; otherwise it behaves as ``BatchNorm``.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, process_set=global_process_set) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects at least 2-D input (N, C, ...), got {x.dim()}-D")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                momentum = 1.0 / float(self.num_batches_tracked)
        if not self.training or not runtime.is_initialized() or runtime.current().engine.size == 1:
            return torch.nn.functional.batch_norm(
                x, self.running_mean, self.running_var, self.weight, self.bias,
                self.training or not self.track_running_stats, momentum, self.eps,
            )
        return _SyncBatchNormFn.apply(x, self.weight, self.bias, self.running_mean, self.running_var, self.eps,
                                      momentum, self.process_set)
