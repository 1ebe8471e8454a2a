"""The KoLeo regulariser over the global batch: each sample's nearest neighbour searched
among every rank's samples, not its own rank's only."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from contrastive_accelerate import collectives
from losses.inputs import check_batch, require_global_batch
from losses.precision import autocast_off, compute_dtype


class KoLeoLoss(nn.Module):
    """The Kozachenko-Leonenko entropy estimator as a loss (Sablayrolles et al., 2019,
    "Spreading vectors for similarity search"; DINOv2's regulariser): minus the mean log
    distance from each L2-normalised feature to its nearest neighbour::

        loss = -1/N * sum_i log(||z_i - z_nn(i)||_p + eps),   nn(i) = argmax_{j != i} z_i . z_j

    over the N samples of the global batch. DINOv2 and lightly search the neighbour among
    each rank's own samples, so their regulariser changes with the number of processes.
    Here every rank searches its samples' neighbours among every rank's, gathered with
    their gradients (a neighbour held by another rank gets its share there); ties go to
    the first in the global order. Each rank's sum is scaled by ``W / N``: exact on any
    number of processes. On one process it is lightly's ``KoLeoLoss(p, eps)``.

    Example::

        criterion = KoLeoLoss()
        loss = dino_loss + 0.1 * criterion(student_class_tokens)
    """

    def __init__(self, p: float = 2.0, eps: float = 1e-8, *, gather_distributed: bool = True):
        super().__init__()
        if not p > 0:
            raise ValueError(f"KoLeoLoss: p must be > 0, got {p}")
        self.p, self.eps, self.gather_distributed = p, eps, gather_distributed

    def forward(self, x: torch.Tensor, *, sizes: list[int] | None = None) -> torch.Tensor:
        name = type(self).__name__
        rank, world_size, sizes, (x, _, _) = check_batch(
            name, x, x, gather_distributed=self.gather_distributed, sizes=sizes
        )
        require_global_batch(name, sizes, 2, "so that every sample has a neighbour")
        with autocast_off(x.device):
            z = F.normalize(x.to(compute_dtype(x)), p=2, dim=-1, eps=self.eps)
            every = collectives.gather(z, sizes=sizes) if world_size > 1 else z
            offset = sum(sizes[:rank])
            with torch.no_grad():
                nearest = self.neighbours(z, every, offset)
            distances = F.pairwise_distance(z, every[nearest], p=self.p, eps=self.eps)
            total = -(distances + self.eps).log().sum()
            return total * (world_size / sum(sizes))

    def neighbours(self, z: torch.Tensor, every: torch.Tensor, offset: int) -> torch.Tensor:
        """Each row of ``z`` (``every``'s rows from ``offset`` on)'s most similar other row
        of ``every``: its index there, the first among equals."""
        own = torch.arange(len(z), device=z.device)
        if not len(z):  # an idle rank
            return own
        similarity = z @ every.T
        # Each row's own column, (i, i + offset): a diagonal, filled without the host
        # tensor that an indexed assignment of a Python number makes.
        similarity.diagonal(offset).fill_(-torch.inf)
        return similarity.argmax(dim=1)
