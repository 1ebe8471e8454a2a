"""NT-Xent (SimCLR) loss over the global batch of all ranks."""

from __future__ import annotations

import torch
from torch import nn

from losses.inputs import batch_sizes, local_problem, require_global_batch
from losses.logsumexp import DENSE_MAX_BYTES, tiled_logsumexp
from losses.precision import autocast_off
from losses.views import check_temperature, normalized, views_and_keys


class NTXentLoss(nn.Module):
    """Normalised temperature-scaled cross entropy (NT-Xent), SimCLR (Chen et al., 2020).

    For the 2N L2-normalised embeddings of N pairs in the global batch, with
    ``s_ij = z_i . z_j / temperature`` and ``p(i)`` the other view of sample i::

        loss = 1/(2N) * sum_i [ -s_{i,p(i)} + log sum_{j != i} exp(s_ij) ]

    Each rank computes the rows of its own 2n samples against all 2N gathered
    columns, never the full 2N x 2N matrix, with one similarity matmul over both
    views. The gather is differentiable (``losses.gather``), and the local sum is
    scaled by ``world_size / (2N)`` so that DDP's gradient *average* equals the
    single-process gradient on the concatenated global batch, for uneven per-rank
    batch sizes too. The mean of the returned values over ranks is the loss above.
    (``Accelerator.gather`` in place of the gather would carry no gradient to the
    other ranks: each would optimise only the rows of its own samples.)

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
        super().__init__()
        check_temperature(type(self).__name__, temperature)
        if tile_rows is not None and tile_rows < 1:
            raise ValueError(f"{type(self).__name__}: tile_rows must be >= 1, got {tile_rows}")
        self.temperature = temperature
        self.gather_distributed = gather_distributed
        self.tile_rows = tile_rows
        self.dense_max_bytes = dense_max_bytes

    def forward(self, out0: torch.Tensor, out1: torch.Tensor) -> torch.Tensor:
        name = type(self).__name__
        rank, world_size, sizes = batch_sizes(
            name, out0, local_problem(out0, out1), self.gather_distributed
        )
        require_global_batch(name, sizes, 2, "so that every sample has a negative")
        with autocast_off(out0.device):
            z0, z1 = normalized(out0, out1)
            local, keys, offset = views_and_keys(z0, z1, rank, world_size, sizes)
            rows = torch.arange(len(local), device=local.device)
            own_column = (offset + rows)[:, None]
            log_denominator = tiled_logsumexp(
                local / self.temperature, keys, own_column, self.tile_rows, self.dense_max_bytes
            )
            positive = (z0 * z1).sum(dim=1) / self.temperature
            local_sum = log_denominator.sum() - 2 * positive.sum()
            return local_sum * (world_size / (2 * sum(sizes)))
