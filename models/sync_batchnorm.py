"""BatchNorm with statistics over the global batch of all ranks, on any backend.

``torch.nn.SyncBatchNorm`` refuses CPU tensors, so it cannot run on gloo; this one
uses only ``all_gather`` and ``all_reduce`` and runs on gloo and nccl alike.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from torch import nn

from losses.distributed import all_gather_single, is_distributed


class SyncBatchNormFunction(torch.autograd.Function):
    """Batch normalisation with global statistics and the exact global gradient.

    forward: each rank computes its count ``m_r``, mean ``mu_r`` and centred sum of
    squares ``M2_r`` in two passes; one all-gather and Chan's merge give
    ``mu = sum m_r mu_r / M`` and ``M2 = sum M2_r + sum m_r (mu_r - mu)^2``
    (no E[x^2] - E[x]^2 cancellation), in float64. ``y = w (x - mu) / sqrt(M2/M + eps) + b``.

    backward: with ``xhat = (x - mu) * invstd`` and sums over all ranks from one
    all-reduce, ``dx = w invstd (dy - sum(dy)/M - xhat sum(dy xhat)/M)``; the
    weight and bias receive their local sums, which DDP then combines.

    Mixed precision: half-precision input (bfloat16/float16, e.g. a convolution's
    output under autocast) is normalised in float32 and returned in its own dtype,
    as ``nn.BatchNorm`` does; gradients come back in the dtype of their tensor.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, eps: float, group):
        channels = x.shape[1]
        reduce_dims = [dim for dim in range(x.dim()) if dim != 1]
        local_count = x.numel() // channels if channels else 0
        x64 = x.double()
        if local_count:
            local_mean = x64.mean(reduce_dims)
            local_m2 = ((x64 - _expand(local_mean, x)) ** 2).sum(reduce_dims)
        else:
            local_mean = local_m2 = x64.new_zeros(channels)
        local = torch.cat([x64.new_tensor([local_count]), local_mean, local_m2])
        world_size = dist.get_world_size(group)
        table = local.new_empty(world_size * local.numel())
        all_gather_single(table, local, group=group)
        table = table.view(world_size, -1)
        counts, means, m2s = table[:, :1], table[:, 1 : 1 + channels], table[:, 1 + channels :]
        count = counts.sum()
        if count <= 1:
            raise ValueError(
                f"SyncBatchNorm: expected more than 1 value per channel in the global batch, "
                f"got {int(count)}"
            )
        mean = (counts * means).sum(0) / count
        m2 = m2s.sum(0) + (counts * (means - mean) ** 2).sum(0)
        invstd = torch.rsqrt(m2 / count + eps)

        dtype = _compute_dtype(x)
        mean_c, invstd_c = mean.to(dtype), invstd.to(dtype)
        output = (x.to(dtype) - _expand(mean_c, x)) * _expand(invstd_c, x)
        if weight is not None:
            output = output * _expand(weight.to(dtype), x) + _expand(bias.to(dtype), x)
        ctx.save_for_backward(x, weight, mean_c, invstd_c)
        ctx.count, ctx.group, ctx.reduce_dims = count.item(), group, reduce_dims
        # For the running statistics: the mean and unbiased variance of the global batch,
        # in float64; the caller stores them in its buffers' dtype.
        unbiased_var = m2 / (count - 1)
        ctx.mark_non_differentiable(mean, unbiased_var)
        return output.to(x.dtype), mean, unbiased_var

    @staticmethod
    def backward(ctx, grad_output, _grad_mean, _grad_var):
        x, weight, mean, invstd = ctx.saved_tensors
        reduce_dims, dtype = ctx.reduce_dims, mean.dtype
        grad_output = grad_output.to(dtype)
        xhat = (x.to(dtype) - _expand(mean, x)) * _expand(invstd, x)
        local_sum_dy = grad_output.sum(reduce_dims)
        local_sum_dy_xhat = (grad_output * xhat).sum(reduce_dims)
        sums = torch.cat([local_sum_dy, local_sum_dy_xhat])
        dist.all_reduce(sums, group=ctx.group)
        sum_dy, sum_dy_xhat = sums.chunk(2)
        scale = invstd if weight is None else invstd * weight.to(dtype)
        grad_input = _expand(scale, x) * (
            grad_output
            - _expand(sum_dy / ctx.count, x)
            - xhat * _expand(sum_dy_xhat / ctx.count, x)
        )
        grad_weight = grad_bias = None
        if weight is not None:
            grad_weight = local_sum_dy_xhat.to(weight.dtype)
            grad_bias = local_sum_dy.to(weight.dtype)
        return grad_input.to(x.dtype), grad_weight, grad_bias, None, None


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float32 for half-precision input, else the input's own dtype."""
    return torch.promote_types(x.dtype, torch.float32)


def _expand(per_channel: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return per_channel.view(1, -1, *([1] * (like.dim() - 2)))


class SyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """Drop-in BatchNorm{1,2,3}d whose training statistics span all ranks of ``process_group``.

    Training mode, distributed: normalises with the mean and biased variance of the
    global batch and updates ``running_mean``/``running_var`` exactly as a
    single-process BatchNorm on the concatenated batch would (unbiased variance
    with the global count). Ranks may hold different batch sizes, including none.
    Eval mode, or no process group: plain ``F.batch_norm``. Under mixed precision the
    output has the input's dtype and the running statistics stay in the buffers'
    dtype (float32), as with ``nn.BatchNorm``.

    Example::

        model = convert_sync_batchnorm(model)
        model = accelerator.prepare(model)
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: dist.ProcessGroup | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm: expected at least 2-D input, got {input.dim()}-D")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        use_batch_stats = self.training or not self.track_running_stats
        if not (use_batch_stats and is_distributed(self.process_group)):
            return super().forward(input)
        momentum = self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if momentum is None:  # cumulative moving average, as nn.BatchNorm
                momentum = 1.0 / float(self.num_batches_tracked)
        output, mean, unbiased_var = SyncBatchNormFunction.apply(
            input, self.weight, self.bias, self.eps, self.process_group
        )
        if self.training and self.track_running_stats:
            with torch.no_grad():  # in the buffers' own dtype, as nn.BatchNorm keeps them
                self.running_mean.lerp_(mean.to(self.running_mean.dtype), momentum)
                self.running_var.lerp_(unbiased_var.to(self.running_var.dtype), momentum)
        return output


def convert_sync_batchnorm(module: nn.Module, process_group=None) -> nn.Module:
    """Replace every BatchNorm{1,2,3}d in ``module`` by ``SyncBatchNorm``, keeping its state."""
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(
        module, SyncBatchNorm
    ):
        reference = next(itertools.chain(module.parameters(), module.buffers()), None)
        placement = {}
        if reference is not None and reference.is_floating_point():
            placement = {"device": reference.device, "dtype": reference.dtype}
        converted = SyncBatchNorm(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
            process_group,
            **placement,
        )
        converted.load_state_dict(module.state_dict())
        converted.train(module.training)
        return converted
    for name, child in module.named_children():
        module.add_module(name, convert_sync_batchnorm(child, process_group))
    return module
