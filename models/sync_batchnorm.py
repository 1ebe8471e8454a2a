"""BatchNorm with statistics over the global batch of all ranks, on any backend.

``torch.nn.SyncBatchNorm`` refuses CPU tensors, so it cannot run on gloo; this one
uses only ``all_gather`` and runs on gloo and nccl alike.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from contrastive_accelerate.collectives import all_gather_rows, is_distributed
from contrastive_accelerate.compat import BatchNormBase


class SyncBatchNormFunction(torch.autograd.Function):
    """Batch normalisation with global statistics and the exact global gradient.

    forward: each rank computes its count ``m_r``, mean ``mu_r`` and centred sum of
    squares ``M2_r`` in two passes over the activations in their own dtype, the second
    on ``x - mean`` so that no large values cancel (a float64 copy cost more than the
    whole BatchNorm on a CPU; ``torch.var_mean``'s Welford is 7x slower and rounds the
    mean to float32, which costs 4e-4 in the variance at a mean of 1e4); one
    all-gather and Chan's merge in float64 give ``mu = sum m_r mu_r / M`` and
    ``M2 = sum M2_r + sum m_r (mu_r - mu)^2`` (no E[x^2] - E[x]^2 cancellation).
    ``y = w (x - mu) / sqrt(M2/M + eps) + b`` is the native eval-mode batch norm
    kernel with the global statistics.

    backward: with ``xhat = (x - mu) * invstd`` and sums over all ranks from one
    all-gather, ``dx = w invstd (dy - sum(dy)/M - xhat sum(dy xhat)/M)``. The local
    sums come from the native eval-mode BatchNorm backward (one fused pass, the weight's
    and bias's local gradients), ``dx`` from one native normalisation of ``x`` plus one
    ``addcmul``; the weight and bias receive their local sums, which DDP then combines.

    Mixed precision: half-precision input (bfloat16/float16, e.g. a convolution's
    output under autocast) is normalised in float32 and returned in its own dtype,
    as ``nn.BatchNorm`` does; gradients come back in the dtype of their tensor.

    No host-device synchronisation: the global count ``M`` stays on the device, and
    only a rank holding at most one value per channel reads it back (to refuse a
    global batch of one), so on a GPU the exchanges queue behind the kernels.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, eps: float, group):
        channels = x.shape[1]
        reduce_dims = [dim for dim in range(x.dim()) if dim != 1]
        local_count = x.numel() // channels if channels else 0
        dtype = _compute_dtype(x)
        with torch.autocast(x.device.type, enabled=False):
            x_c = x.to(dtype)  # a copy for half-precision input only
            local = x.new_zeros(1 + 2 * channels, dtype=torch.float64)
            if local_count:
                # No float64 copy of x (its allocation alone costs more than BatchNorm): a
                # mean in x's dtype, then sums of d = x - mean_c, which are small, so their
                # rounding is relative to the spread, not to the mean; mean_c + mean(d) carries
                # the mean beyond x's precision into Chan's merge.
                rounded_mean = x_c.mean(reduce_dims)
                centred = x_c - _expand(rounded_mean, x)
                sum_d = centred.sum(reduce_dims).double()
                sum_d2 = centred.mul_(centred).sum(reduce_dims)
                # [m_r, mu_r, M2_r], filled in place: a count written by a kernel, not copied
                # from the host, so that nothing here waits for the device.
                local[:1].fill_(local_count)
                torch.add(rounded_mean, sum_d, alpha=1 / local_count, out=local[1 : 1 + channels])
                torch.sub(sum_d2, sum_d**2, alpha=1 / local_count, out=local[1 + channels :])
            table = gather_statistics(local, group)
            counts, means, m2s = table[:, :1], table[:, 1 : 1 + channels], table[:, 1 + channels :]
            count = counts.sum()
            # Only a rank holding at most one value can be part of a global batch that small;
            # the others skip the check, which reads a device value and would wait for it.
            if local_count <= 1 and count <= 1:
                raise ValueError(
                    f"SyncBatchNorm: expected more than 1 value per channel in the global "
                    f"batch, got {int(count)}"
                )
            mean = (counts * means).sum(0) / count
            m2 = (m2s + counts * (means - mean).square()).sum(0)
            mean_c, var_c = mean.to(dtype), (m2 / count).to(dtype)
            weight_c = None if weight is None else weight.to(dtype)
            bias_c = None if bias is None else bias.to(dtype)
            output = F.batch_norm(x_c, mean_c, var_c, weight_c, bias_c, False, 0.0, eps)
        ctx.save_for_backward(x, weight_c, mean_c, var_c, count)
        ctx.group, ctx.eps = group, eps
        ctx.weight_dtype = None if weight is None else weight.dtype
        # For the running statistics: the mean and unbiased variance of the global batch,
        # in float64; the caller stores them in its buffers' dtype.
        unbiased_var = m2 / (count - 1)
        ctx.mark_non_differentiable(mean, unbiased_var)
        ctx.set_materialize_grads(False)  # no zero gradients for the statistics
        return output.to(x.dtype), mean, unbiased_var

    @staticmethod
    def backward(ctx, grad_output, _grad_mean, _grad_var):
        x, weight, mean, var, count = ctx.saved_tensors
        dtype = mean.dtype
        with torch.autocast(x.device.type, enabled=False):
            x_c, grad_output = x.to(dtype), grad_output.to(dtype).contiguous()
            # Eval-mode backward, weight and bias only: sum(dy * xhat) and sum(dy) per
            # channel, in one fused pass.
            if x.numel():
                _, local_sum_dy_xhat, local_sum_dy = torch.ops.aten.native_batch_norm_backward(
                    grad_output,
                    x_c,
                    weight,
                    mean,
                    var,
                    None,
                    None,
                    False,
                    ctx.eps,
                    [False, True, True],
                )
            else:  # a rank with no share of the batch (the native kernel divides by its size)
                local_sum_dy_xhat, local_sum_dy = torch.zeros_like(mean), torch.zeros_like(mean)
            # An all-gather of the local sums, added up here: one message round where a
            # ring all-reduce takes two (gloo: ~0.5 ms less per layer), and the same
            # summation order on every rank.
            local = torch.cat([local_sum_dy, local_sum_dy_xhat])
            sum_dy, sum_dy_xhat = gather_statistics(local, ctx.group).sum(0).chunk(2)
            invstd = torch.rsqrt(var + ctx.eps)
            scale = invstd if weight is None else invstd * weight
            # dx = scale dy + [xhat (-scale sum(dy xhat)/M) - scale sum(dy)/M]; the bracket is one
            # native normalisation of x (x - mu first: no cancellation at a large mean).
            minus_scale_over_count = scale / -count
            grad_input = F.batch_norm(
                x_c,
                mean,
                var,
                minus_scale_over_count * sum_dy_xhat,
                minus_scale_over_count * sum_dy,
                False,
                0.0,
                ctx.eps,
            )
            grad_input.addcmul_(grad_output, _expand(scale, x))
        grad_weight = grad_bias = None
        if weight is not None:
            grad_weight = local_sum_dy_xhat.to(ctx.weight_dtype)
            grad_bias = local_sum_dy.to(ctx.weight_dtype)
        return grad_input.to(x.dtype), grad_weight, grad_bias, None, None


def gather_statistics(local: torch.Tensor, group) -> torch.Tensor:
    """Every rank's 1-D ``local`` as the rows of a (world size, n) tensor: one message round
    (the layer's only exchange, forward and backward; ``benchmarks.sync_batchnorm`` times it)."""
    return all_gather_rows(local[None], group, sizes=[1] * dist.get_world_size(group))


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float32 for half-precision input, else the input's own dtype."""
    return torch.promote_types(x.dtype, torch.float32)


def _expand(per_channel: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return per_channel.view(1, -1, *([1] * (like.dim() - 2)))


class SyncBatchNorm(BatchNormBase):
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


def has_batch_statistics(module: nn.Module) -> bool:
    """Whether ``module`` normalises by batch statistics (a BatchNorm, synchronised or
    not): an idle rank must then run its no rows as they are, since one stand-in row
    would count in the global batch's statistics."""
    return any(isinstance(m, BatchNormBase) for m in module.modules())


def convert_sync_batchnorm(module: nn.Module, process_group=None) -> nn.Module:
    """Replace every BatchNorm{1,2,3}d in ``module`` by ``SyncBatchNorm``, keeping its state."""
    if isinstance(module, BatchNormBase) and not isinstance(module, SyncBatchNorm):
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
