"""``SyncBatchNorm``: batch normalisation with statistics over the whole global batch, on CPU or GPU.

Forward: each rank computes its count, mean and sum of squared deviations per channel; one allgather
brings every rank's three to every rank, which combines them (Chan et al.'s parallel variance: no
catastrophic cancellation from sum-of-squares). Backward: the two per-channel sums the input gradient
needs, ``sum(dy)`` and ``sum(dy * x_hat)``, are summed over ranks with one allreduce. Weight and bias get
this rank's part of their gradient, as any parameter does; ``DistributedOptimizer`` combines them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from hora.core.ops import Sum
from hora.core.process_sets import global_process_set
from hora.torch import mpi_ops

__all__ = ["SyncBatchNorm"]


def _channels_view(t: torch.Tensor, ndim: int) -> torch.Tensor:
    return t.view([1, -1] + [1] * (ndim - 2))


def _acc(x: torch.Tensor) -> torch.dtype:
    """Compute in float64 for float64 inputs, else in float32 (half types would lose the statistics)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, process_set):
        dims = [0] + list(range(2, x.dim()))
        acc = _acc(x)
        xf = x.to(acc)
        count = x.numel() // x.shape[1]
        mean = xf.mean(dims) if count else xf.new_zeros(x.shape[1])
        m2 = ((xf - _channels_view(mean, x.dim())) ** 2).sum(dims)
        local = torch.cat([mean.new_tensor([float(count)]), mean, m2]).double().view(1, -1)
        every = mpi_ops.allgather(local, process_set=process_set)
        counts, means, m2s = every[:, :1], every[:, 1:1 + x.shape[1]], every[:, 1 + x.shape[1]:]
        n = counts.sum()
        if n == 0:
            raise ValueError("SyncBatchNorm: the global batch is empty")
        gmean = (counts * means).sum(0) / n
        gm2 = (m2s + counts * (means - gmean) ** 2).sum(0)
        var = gm2 / n
        if running_mean is not None:
            unbiased = gm2 / (n - 1) if n > 1 else var
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_(gmean.to(running_mean.dtype), alpha=momentum)
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        mean_f, invstd = gmean.to(acc), torch.rsqrt(var + eps).to(acc)
        y = (xf - _channels_view(mean_f, x.dim())) * _channels_view(invstd, x.dim())
        if weight is not None:
            y = y * _channels_view(weight.to(acc), x.dim()) + _channels_view(bias.to(acc), x.dim())
        ctx.save_for_backward(x, weight, mean_f, invstd)
        ctx.n, ctx.process_set = float(n), process_set
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, invstd = ctx.saved_tensors
        dims, nd, c = [0] + list(range(2, x.dim())), x.dim(), x.shape[1]
        xhat = (x.to(mean.dtype) - _channels_view(mean, nd)) * _channels_view(invstd, nd)
        dyf = dy.to(mean.dtype)
        sum_dy, sum_dy_xhat = dyf.sum(dims), (dyf * xhat).sum(dims)
        dx = None
        if ctx.needs_input_grad[0]:  # the same on every rank: the model is the same
            total = mpi_ops.allreduce(torch.cat([sum_dy, sum_dy_xhat]), op=Sum, process_set=ctx.process_set)
            mean_dy, mean_dy_xhat = total[:c] / ctx.n, total[c:] / ctx.n
            scale = invstd if weight is None else invstd * weight.to(mean.dtype)
            dx = ((dyf - _channels_view(mean_dy, nd) - xhat * _channels_view(mean_dy_xhat, nd))
                  * _channels_view(scale, nd)).to(x.dtype)
        if weight is None:
            return dx, None, None, None, None, None, None, None
        return dx, sum_dy_xhat.to(weight.dtype), sum_dy.to(weight.dtype), None, None, None, None, None


_sync_batch_norm = None  # _SyncBatchNormFunction.apply behind torch.compiler.disable, made by the first __init__


def _eager_apply():
    """Collectives must run eagerly inside a compiled model (a graph break). Wrapping imports torch._dynamo
    (seconds), so it waits until someone builds a SyncBatchNorm, which happens before any compiling."""
    global _sync_batch_norm
    if _sync_batch_norm is None:
        _sync_batch_norm = torch.compiler.disable(_SyncBatchNormFunction.apply)


class SyncBatchNorm(_BatchNorm):
    """Drop-in for ``torch.nn.BatchNorm1d/2d/3d`` (any input ``(N, C, ...)``) whose training-mode statistics
    cover every rank's batch. Works on CPU (Horovod's needs a GPU). In eval mode it uses the running
    statistics, like BatchNorm. ``process_set`` (hora only) limits the statistics to those ranks.
    """

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True,
                 process_set=global_process_set):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set
        _eager_apply()

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm: expected an input of at least 2 dimensions (N, C, ...), got "
                             f"{input.dim()}D")

    def forward(self, input):
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                factor = 1.0 / float(self.num_batches_tracked)
        batch_stats = self.training or not self.track_running_stats
        if not batch_stats or self.process_set.size() == 1:
            running = not self.training or self.track_running_stats
            return F.batch_norm(input, self.running_mean if running else None,
                                self.running_var if running else None, self.weight, self.bias, batch_stats,
                                factor, self.eps)
        return _sync_batch_norm(input, self.weight, self.bias, self.running_mean, self.running_var, self.eps,
                                factor, self.process_set)
