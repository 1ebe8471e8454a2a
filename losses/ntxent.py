"""NT-Xent (SimCLR) loss over the global batch of all ranks."""

from __future__ import annotations

import torch

from losses.logsumexp import DENSE_MAX_BYTES, softplus
from losses.precision import autocast_off
from losses.views import TwoViewLoss


class NTXentLoss(TwoViewLoss):
    """Normalised temperature-scaled cross entropy (NT-Xent), SimCLR (Chen et al., 2020).

    For the 2N L2-normalised embeddings of N pairs in the global batch, with
    ``s_ij = z_i . z_j / temperature`` and ``p(i)`` the other view of sample i::

        loss = 1/(2N) * sum_i [ -s_{i,p(i)} + log sum_{j != i} exp(s_ij) ]
             = 1/(2N) * sum_i softplus( log sum_{j != i, p(i)} exp(s_ij) - s_{i,p(i)} )

    The second form is what is computed: each term is never negative and stays exact
    near 0, where the first form subtracts two nearly equal log-sum-exps (a well-trained
    encoder's loss would read slightly negative in float32).

    Each rank computes the rows of its own 2n samples against all 2N gathered
    columns, never the full 2N x 2N matrix, with one similarity matmul over both
    views. The gather is differentiable (``contrastive_accelerate.collectives.gather``)
    and the local sum is scaled by ``world_size / (2N)``: exact on any number of
    processes (see ``losses``). ``Accelerator.gather`` in place of the gather would
    carry no gradient to the other ranks: each would optimise only its own rows.

    Inputs of any floating dtype, inside or outside autocast: the similarities,
    log-sum-exp and the loss are computed in float32 (float64 stays float64), and
    the gradient is returned in the input's dtype. Rows are processed in tiles of
    ``tile_rows`` (see ``losses.logsumexp``); None picks one tile while the logits
    take at most ``dense_max_bytes``. Arguments after ``temperature`` are keyword-only
    (lightly's second positional argument is ``memory_bank_size``).

    Example::

        criterion = NTXentLoss(temperature=0.5)
        loss = criterion(model(view0), model(view1))
        accelerator.backward(loss)
    """

    def __init__(
        self,
        temperature: float = 0.5,
        *,
        gather_distributed: bool = True,
        tile_rows: int | None = None,
        dense_max_bytes: int = DENSE_MAX_BYTES,
    ) -> None:
        super().__init__(temperature, gather_distributed, tile_rows, dense_max_bytes)

    def forward(
        self, out0: torch.Tensor, out1: torch.Tensor, *, sizes: list[int] | None = None
    ) -> torch.Tensor:
        with autocast_off(out0.device):
            views = self._gathered(out0, out1, sizes=sizes)
            own = self._own_columns(views)
            positive_column = own.roll(len(views.z0), dims=0)  # row i + n, and back
            negatives = self._log_denominator(views, torch.cat([own, positive_column], 1))
            positive = (views.z0 * views.z1).sum(dim=1) / self.temperature
            terms = softplus(negatives - torch.cat([positive, positive]))
            return self._global_mean(terms.sum(), views)
