"""Losses of momentum-teacher methods: MoCo's InfoNCE with a queue, BYOL's cosine loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from contrastive_accelerate import collectives
from losses.inputs import check_batch, require_global_batch
from losses.logsumexp import DENSE_MAX_BYTES, tiled_logsumexp
from losses.precision import autocast_off, compute_dtype


class MoCoLoss(nn.Module):
    """InfoNCE of queries against momentum keys, MoCo (He et al., 2020; v3: Chen et al., 2021).

    For the global batch of N query-key pairs, L2-normalised inside, the keys ``K`` of
    the global batch (``batch_negatives``, MoCo v3) and the rows ``Q`` of ``queue``
    (MoCo v2's past keys, used as given: normalised keys)::

        loss = 1/N * sum_i [ log( sum_j exp(q_i . k_j / t) + sum_m exp(q_i . Q_m / t) )
                             - q_i . k_i / t ]

    Without ``batch_negatives`` the first sum has only the positive ``j = i``: MoCo v2,
    and lightly's ``NTXentLoss(memory_bank_size=...)`` for a bank of the same rows (an
    empty queue then leaves no negatives and a loss of 0; MoCo and lightly start from
    random keys). Each
    rank scores its own queries against the gathered keys, with positives at their
    global index (uneven batches included; MoCo v3 assumes ``arange(n) + rank * n``),
    and the queue is the same on every rank. Keys take a gradient only if they have one
    (MoCo's come from a teacher under ``no_grad``). MoCo v3's loss is
    ``2 * t * (loss(q0, k1) + loss(q1, k0))``.

    Example::

        criterion = MoCoLoss(temperature=0.2)  # model: models.momentum.PredictorModel()
        loss = criterion(model(view0), teacher(view1), queue.keys())  # teacher: EMATeacher
        accelerator.backward(loss)
    """

    def __init__(
        self,
        temperature: float = 0.2,
        *,
        batch_negatives: bool = True,
        gather_distributed: bool = True,
        tile_rows: int | None = None,
        dense_max_bytes: int = DENSE_MAX_BYTES,
    ) -> None:
        super().__init__()
        if temperature <= 0:
            raise ValueError(f"MoCoLoss: temperature must be > 0, got {temperature}")
        self.temperature = temperature
        self.batch_negatives = batch_negatives
        self.gather_distributed = gather_distributed
        self.tile_rows = tile_rows
        self.dense_max_bytes = dense_max_bytes

    def forward(
        self,
        queries: torch.Tensor,
        keys: torch.Tensor,
        queue: torch.Tensor | None = None,
        *,
        sizes: list[int] | None = None,
    ) -> torch.Tensor:
        name = type(self).__name__
        rank, world_size, sizes, (queries, keys, _) = check_batch(
            name, queries, keys, gather_distributed=self.gather_distributed, sizes=sizes
        )
        has_queue = queue is not None and len(queue) > 0
        if self.batch_negatives and not has_queue:  # the batch is the only source of negatives
            require_global_batch(name, sizes, 2, "so that every sample has a negative")
        with autocast_off(queries.device):
            dtype = compute_dtype(queries, keys)
            q = F.normalize(queries.to(dtype), dim=1) / self.temperature
            k = F.normalize(keys.to(dtype), dim=1)
            positive = (q * k).sum(dim=1)
            columns = []
            if self.batch_negatives:
                columns.append(collectives.gather(k, sizes=sizes) if world_size > 1 else k)
            if has_queue:
                columns.append(queue.to(dtype))
            if self.batch_negatives:
                lse = tiled_logsumexp(
                    q, torch.cat(columns), None, self.tile_rows, self.dense_max_bytes
                )
            elif has_queue:
                negatives = tiled_logsumexp(
                    q, columns[0], None, self.tile_rows, self.dense_max_bytes
                )
                lse = torch.logaddexp(positive, negatives)
            else:  # no negatives yet (an empty queue): the loss is 0
                lse = positive
            return (lse - positive).sum() * (world_size / sum(sizes))


class NegativeCosineSimilarityLoss(nn.Module):
    """BYOL's loss (Grill et al., 2020) over the global batch: ``-1/N * sum_i cos(x0_i, x1_i)``.

    On one process this is lightly's ``NegativeCosineSimilarity``; the paper's
    ``2 - 2 cos`` differs by a constant and a factor. No negatives, so nothing is gathered,
    but the mean is over the *global* batch: each rank's sum is scaled by ``W / N``, which
    a per-rank mean matches only when every rank has the same number of samples.

    Example::

        criterion = NegativeCosineSimilarityLoss()  # model: models.momentum.PredictorModel()
        p0, p1, t0, t1 = model(view0), model(view1), teacher(view0), teacher(view1)
        loss = 0.5 * (criterion(p0, t1) + criterion(p1, t0))  # teacher: EMATeacher
        accelerator.backward(loss)
    """

    def __init__(self, eps: float = 1e-8, *, gather_distributed: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.gather_distributed = gather_distributed

    def forward(
        self, x0: torch.Tensor, x1: torch.Tensor, *, sizes: list[int] | None = None
    ) -> torch.Tensor:
        name = type(self).__name__
        rank, world_size, sizes, (x0, x1, _) = check_batch(
            name, x0, x1, gather_distributed=self.gather_distributed, sizes=sizes
        )
        require_global_batch(name, sizes, 1, "")
        with autocast_off(x0.device):
            dtype = compute_dtype(x0, x1)
            cosine = F.cosine_similarity(x0.to(dtype), x1.to(dtype), dim=1, eps=self.eps)
            return -cosine.sum() * (world_size / sum(sizes))
