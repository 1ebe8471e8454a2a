"""Redundancy-reduction losses (Barlow Twins, VICReg) on statistics of the global batch.

Both need per-dimension means and (co)variances of the whole global batch. Each
rank sums its rows and the sums are all-reduced with a gradient
(``contrastive_accelerate.collectives.all_reduce``), so every rank computes the same
global loss with the exact gradient (see ``losses``). The
statistics are exchanged, not the embeddings: d or d x d numbers per rank instead of
n x d, and each rank does 1/W of the d x d work. Uneven and empty ranks are fine.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from contrastive_accelerate import collectives
from losses.inputs import check_batch, require_global_batch
from losses.precision import autocast_off, compute_dtype, matmul


def _summed(distributed: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """The sum over ranks, with gradients (``collectives.all_reduce``), or this rank's value."""
    return collectives.all_reduce if distributed else (lambda x: x)


def _centred(z: torch.Tensor, count: int, summed) -> torch.Tensor:
    """``z`` minus the mean of the global batch (differentiable through every rank's rows)."""
    return z - summed(z.sum(dim=0)) / count


def _variance(centred: torch.Tensor, count: int, unbiased: bool, summed) -> torch.Tensor:
    return summed((centred * centred).sum(dim=0)) / (count - 1 if unbiased else count)


class _GlobalStandardise(torch.autograd.Function):
    """Per-dimension standardisation over the global batch of M rows (BatchNorm without
    affine parameters or running statistics, synchronised).

    forward:  ``y = (x - mu) * invstd``, ``mu`` and the biased variance ``v`` over all
              ranks' rows (two passes, no E[x^2] - E[x]^2 cancellation),
              ``invstd = 1 / sqrt(v + eps)``
    backward: ``dx = invstd * (dy - sum(dy) / M - y * sum(dy * y) / M)``, sums over all
              ranks (one all-reduce)

    Only ``y`` (which the cross-correlation keeps anyway) and ``invstd`` are saved.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, count: int, eps: float, distributed: bool):
        summed = _summed(distributed)
        y = x - summed(x.sum(dim=0)) / count
        invstd = torch.rsqrt(summed((y * y).sum(dim=0)) / count + eps)
        y.mul_(invstd)
        ctx.count, ctx.distributed = count, distributed
        ctx.save_for_backward(y, invstd)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        y, invstd = ctx.saved_tensors
        with autocast_off(grad.device):  # backward may run inside the caller's autocast
            sums = torch.cat([grad.sum(dim=0), (grad * y).sum(dim=0)])
            sums = _summed(ctx.distributed)(sums)
            sum_grad, sum_grad_y = sums.chunk(2)
            grad_x = (grad - sum_grad / ctx.count - y * (sum_grad_y / ctx.count)) * invstd
        return grad_x, None, None, None


def _off_diagonal(matrix: torch.Tensor) -> torch.Tensor:
    return matrix.flatten()[1:].view(matrix.shape[0] - 1, matrix.shape[0] + 1)[:, :-1]


class BarlowTwinsLoss(nn.Module):
    """Barlow Twins (Zbontar et al., 2021, "Self-Supervised Learning via Redundancy Reduction").

    Each embedding dimension is standardised over the **global** batch of N pairs
    (mean and biased variance, eps 1e-5, as ``F.batch_norm``), and with
    ``C = z0_std.T @ z1_std / N``, the cross-correlation of the global batch::

        loss = sum_i (1 - C_ii)^2 + lambda_param * sum_{i != j} C_ij^2

    The standardisation is synchronised with gradients, as SyncBatchNorm does. lightly
    standardises with each rank's local statistics before it all-reduces C, so its
    distributed loss differs from its single-process loss; and a plain all-reduce
    (lightly issues #1920, #1977) would shrink every gradient by 1/W. Embeddings are
    taken as they are (raw projector outputs). Every rank returns the global loss.

    Example::

        criterion = BarlowTwinsLoss(lambda_param=5e-3)
        loss = criterion(model(view0), model(view1))
        accelerator.backward(loss)
    """

    def __init__(
        self, lambda_param: float = 5e-3, *, gather_distributed: bool = True, eps: float = 1e-5
    ) -> None:
        super().__init__()
        self.lambda_param = lambda_param
        self.gather_distributed = gather_distributed
        self.eps = eps

    def forward(
        self, z_a: torch.Tensor, z_b: torch.Tensor, *, sizes: list[int] | None = None
    ) -> torch.Tensor:
        name = type(self).__name__
        _, _, sizes, (z_a, z_b, _) = check_batch(
            name, z_a, z_b, gather_distributed=self.gather_distributed, sizes=sizes
        )
        require_global_batch(name, sizes, 2, "for a standard deviation")
        distributed = self.gather_distributed and collectives.is_distributed()
        count = sum(sizes)
        with autocast_off(z_a.device):
            dtype = compute_dtype(z_a, z_b)
            z_a, z_b = z_a.to(dtype), z_b.to(dtype)
            a = self._standardised(z_a, count, distributed)
            b = self._standardised(z_b, count, distributed)
            correlation = _summed(distributed)(matmul(a.T, b)) / count
            on_diagonal = (1 - torch.diagonal(correlation)).pow(2).sum()
            off_diagonal = _off_diagonal(correlation).pow(2).sum()
            return on_diagonal + self.lambda_param * off_diagonal

    def _standardised(self, z: torch.Tensor, count: int, distributed: bool) -> torch.Tensor:
        """Zero mean and unit (biased) variance per dimension over the global batch."""
        if not distributed:  # the same function, in PyTorch's fused BatchNorm kernels
            return F.batch_norm(z, None, None, training=True, eps=self.eps)
        return _GlobalStandardise.apply(z, count, self.eps, distributed)


class VICRegLoss(nn.Module):
    """VICReg (Bardes et al., 2022, "Variance-Invariance-Covariance Regularization").

    For the global batch of N pairs of d-dimensional embeddings (taken as they are),
    with statistics over the global batch (unbiased variance and covariance)::

        invariance = 1/(N d) * sum ||z_a - z_b||^2
        variance   = 1/2 * sum_{z in a, b} mean_k relu(1 - sqrt(Var(z)_k + eps))
        covariance = sum_{z in a, b} 1/d * sum_{k != l} Cov(z)_kl^2
        loss = lambda_param * invariance + mu_param * variance + nu_param * covariance

    as in the authors' code and lightly. Distributed, the sums and the d x d
    covariance are all-reduced with gradients, so every rank returns the global loss
    (lightly gathers the embeddings for the last two terms and takes the invariance
    term per rank, which equals the global one only for equal batch sizes).

    Example::

        criterion = VICRegLoss()
        loss = criterion(model(view0), model(view1))
        accelerator.backward(loss)
    """

    def __init__(
        self,
        lambda_param: float = 25.0,
        mu_param: float = 25.0,
        nu_param: float = 1.0,
        *,
        gather_distributed: bool = True,
        eps: float = 1e-4,
    ) -> None:
        super().__init__()
        self.lambda_param, self.mu_param, self.nu_param = lambda_param, mu_param, nu_param
        self.gather_distributed = gather_distributed
        self.eps = eps

    def forward(
        self, z_a: torch.Tensor, z_b: torch.Tensor, *, sizes: list[int] | None = None
    ) -> torch.Tensor:
        name = type(self).__name__
        _, _, sizes, (z_a, z_b, _) = check_batch(
            name, z_a, z_b, gather_distributed=self.gather_distributed, sizes=sizes
        )
        require_global_batch(name, sizes, 2, "for a variance")
        distributed = self.gather_distributed and collectives.is_distributed()
        count, summed = sum(sizes), _summed(distributed)
        with autocast_off(z_a.device):
            dtype = compute_dtype(z_a, z_b)
            z_a, z_b = z_a.to(dtype), z_b.to(dtype)
            dim = z_a.shape[1]
            invariance = summed(F.mse_loss(z_a, z_b, reduction="sum")) / (count * dim)
            variance = covariance = 0.0
            for z in (z_a, z_b):
                centred = _centred(z, count, summed)
                std = torch.sqrt(_variance(centred, count, True, summed) + self.eps)
                variance = variance + 0.5 * torch.relu(1 - std).mean()
                matrix = summed(matmul(centred.T, centred)) / (count - 1)
                covariance = covariance + _off_diagonal(matrix).pow(2).sum() / dim
            return (
                self.lambda_param * invariance
                + self.mu_param * variance
                + self.nu_param * covariance
            )
