"""Sinkhorn-Knopp over the global batch: SwAV's online codes and DINOv2's teacher
centering, with every rank's share in the marginals whatever its size."""

from __future__ import annotations

import torch
import torch.distributed as dist

from contrastive_accelerate.collectives import is_distributed
from losses.precision import autocast_off, compute_dtype


def sinkhorn_knopp(
    scores: torch.Tensor,
    temperature: float = 0.05,
    iterations: int = 3,
    *,
    sizes: list[int] | None = None,
    gather_distributed: bool = True,
) -> torch.Tensor:
    """Soft assignments of the global batch's N samples to K prototypes (Cuturi, 2013;
    SwAV, Caron et al., 2020; DINOv2's ``sinkhorn_knopp_teacher``): from
    ``Q = exp(scores / temperature)`` (``scores``: this rank's (n, K) rows), alternately
    scaled so that every prototype holds 1/K of the mass and every sample 1/N::

        Q <- Q / sum(Q);  repeat: Q_k. <- Q_k. / (K sum_i Q_ki);  Q_.i <- Q_.i / (N sum_k Q_ki)

    and returned as N Q: each sample's row sums to 1. The sums over samples are
    all-reduced, and N is the sum of every rank's rows (``sizes``, or all-reduced on the
    device if not given): the peers' ``B = local rows * W`` is the global batch only for
    equal shares.
    The scores are shifted by their global maximum first, a factor that cancels, so that
    ``exp`` cannot overflow. Without gradient, in float32 at least.

    Example::

        with torch.no_grad():
            codes = sinkhorn_knopp(z @ prototypes.T, temperature=0.05)  # (n, K)
        loss = -(codes * F.log_softmax(z_other @ prototypes.T / 0.1, dim=1)).sum(1).mean()
    """
    if not temperature > 0 or iterations < 1:
        raise ValueError(
            f"sinkhorn_knopp: temperature > 0 and iterations >= 1, got {temperature}, {iterations}"
        )
    distributed = gather_distributed and is_distributed()

    def summed(tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        if distributed:
            dist.all_reduce(tensor, op=op)
        return tensor

    with torch.no_grad(), autocast_off(scores.device):
        scores = scores.to(compute_dtype(scores))
        top = scores.max() if len(scores) else scores.new_full((), -torch.inf)
        logits = (scores - summed(top, dist.ReduceOp.MAX)) / temperature
        q = logits.exp().T  # (K, n)
        q /= summed(q.sum())
        prototypes = q.shape[0]
        # N: every rank's rows, counted on the device where the caller does not know them,
        # so the host reads nothing.
        samples = sum(sizes) if sizes is not None else summed(scores.new_full((), len(scores)))
        for _ in range(iterations):
            q /= summed(q.sum(dim=1, keepdim=True)) * prototypes
            q /= q.sum(dim=0, keepdim=True) * samples
        return (q * samples).T
