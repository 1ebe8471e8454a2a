"""Decoupled contrastive learning (DCL, DCLW) over the global batch of all ranks."""

from __future__ import annotations

from collections.abc import Callable

import torch

from contrastive_accelerate import collectives
from losses.logsumexp import DENSE_MAX_BYTES
from losses.precision import autocast_off
from losses.views import GatheredViews, TwoViewLoss


class DCLLoss(TwoViewLoss):
    """Decoupled contrastive loss, DCL (Yeh et al., 2021, "Decoupled Contrastive Learning").

    NT-Xent with the positive pair removed from the denominator. For the 2N
    L2-normalised embeddings of N pairs, ``s_ij = z_i . z_j / temperature``,
    ``p(i)`` the other view of sample i and ``w_i`` the positive weight (1 unless
    ``weight_fn``)::

        loss = 1/(2N) * sum_i [ -w_i s_{i,p(i)} + log sum_{j != i, p(i)} exp(s_ij) ]

    one log-sum-exp over the negatives of both views (the paper's Eq. 6; lightly's
    ``DCLLoss`` on one process). Distributed as ``NTXentLoss`` is: local rows against
    all gathered columns, exact on any number of processes (see ``losses``).

    ``weight_fn(z0, z1) -> (n,)`` gets this rank's normalised embeddings, as in
    lightly; it is not differentiated. For weights over the global batch use
    ``DCLWLoss``.

    Example::

        criterion = DCLLoss(temperature=0.1)
        loss = criterion(model(view0), model(view1))
        accelerator.backward(loss)
    """

    def __init__(
        self,
        temperature: float = 0.1,
        *,
        weight_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        gather_distributed: bool = True,
        tile_rows: int | None = None,
        dense_max_bytes: int = DENSE_MAX_BYTES,
    ) -> None:
        super().__init__(temperature, gather_distributed, tile_rows, dense_max_bytes)
        self.weight_fn = weight_fn

    def forward(
        self, out0: torch.Tensor, out1: torch.Tensor, *, sizes: list[int] | None = None
    ) -> torch.Tensor:
        with autocast_off(out0.device):
            views = self._gathered(out0, out1, sizes=sizes)
            own = self._own_columns(views)
            n = len(views.z0)
            positive_column = own.roll(n, dims=0)  # row i's positive is row i + n, and back
            log_denominator = self._log_denominator(views, torch.cat([own, positive_column], 1))
            positive = (views.z0 * views.z1).sum(dim=1) / self.temperature
            weights0, weights1 = self._positive_weights(views)
            local_sum = log_denominator.sum() - ((weights0 + weights1) * positive).sum()
            return self._global_mean(local_sum, views)

    def _positive_weights(self, views: GatheredViews):
        if self.weight_fn is None:
            return 1.0, 1.0
        with torch.no_grad():
            return self.weight_fn(views.z0, views.z1), self.weight_fn(views.z1, views.z0)


class DCLWLoss(DCLLoss):
    """Weighted DCL (DCLW, Yeh et al., 2021): DCL whose positive terms carry the
    negative von Mises-Fisher weights of the *global* batch::

        w_i = 2 - N * softmax_i(z0_i . z1_i / sigma)      (softmax over all N pairs)

    (not differentiated). lightly computes the softmax and N over each rank's local
    batch, so its distributed loss is a different function from its single-process
    loss; here the N similarities are all-gathered first, so both are the same.

    Example::

        criterion = DCLWLoss(temperature=0.1, sigma=0.5)
        loss = criterion(model(view0), model(view1))
        accelerator.backward(loss)
    """

    def __init__(
        self,
        temperature: float = 0.1,
        *,
        sigma: float = 0.5,
        gather_distributed: bool = True,
        tile_rows: int | None = None,
        dense_max_bytes: int = DENSE_MAX_BYTES,
    ) -> None:
        super().__init__(
            temperature,
            gather_distributed=gather_distributed,
            tile_rows=tile_rows,
            dense_max_bytes=dense_max_bytes,
        )
        if not sigma > 0:
            raise ValueError(f"DCLWLoss: sigma must be positive, got {sigma}")
        self.sigma = sigma

    def _positive_weights(self, views: GatheredViews):
        with torch.no_grad():
            similarity = (views.z0 * views.z1).sum(dim=1) / self.sigma
            every = similarity
            if views.world_size > 1:
                every = collectives.gather(similarity, sizes=views.sizes)
            weights = 2 - sum(views.sizes) * torch.exp(similarity - torch.logsumexp(every, dim=0))
        return weights, weights
