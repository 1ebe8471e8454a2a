"""Multiple-negatives ranking (sentence embeddings) over the global batch of all ranks."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from contrastive_accelerate import collectives
from losses.inputs import check_batch, require_global_batch
from losses.logsumexp import DENSE_MAX_BYTES, softplus, tiled_logsumexp
from losses.precision import autocast_off, compute_dtype


class MultipleNegativesRankingLoss(nn.Module):
    """Multiple-negatives ranking loss (Henderson et al., 2017; sentence-transformers' MNRL).

    For the global batch of N anchors ``a_i``, their positives ``p_i`` and K columns of
    hard negatives ``n^k_i`` (all L2-normalised inside), every anchor is scored against
    every gathered candidate ``C = [p_1..p_N, n^1_1..n^1_N, ..., n^K_1..n^K_N]`` with
    ``s_ij = scale * a_i . c_j``, its positive at global column i::

        loss = 1/N * sum_i [ log sum_j exp(s_ij) - s_ii ]
             = 1/N * sum_i softplus( log sum_{j != i} exp(s_ij) - s_ii )

    The second form is what is computed: never negative, exact near 0. With
    ``symmetric`` the loss is the mean of that term and its reverse, each positive
    scored against every gathered anchor (sentence-transformers'
    ``directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction"``).

    ``identities`` (``(columns, n)`` integers, equal for equal texts: ``data.pairs.
    text_identity``) mask false negatives across the global batch: a candidate whose
    text is anchor i's positive's, ``t(c_j) = t(p_i)``, leaves row i's sum, as does, in
    the reverse direction, an anchor whose text is a_i's. The identities travel in the
    candidates' own gather (their bits as extra columns), so masking adds no collective.

    On one process this is sentence-transformers' ``MultipleNegativesRankingLoss`` at the
    same ``scale`` (cosine similarity, hard negatives included). Each rank scores its
    own anchors against the gathered candidates through a differentiable gather, with
    positives at their global index: uneven batches and idle ranks included, where
    ``gather_across_devices=True`` assumes ``rank * n`` offsets.

    Example::

        criterion = MultipleNegativesRankingLoss(scale=20.0)  # tower: models.text.TextTower
        anchors, positives, negatives = (tower(ids, mask) for ids, mask in batch.columns)
        loss = criterion(anchors, positives, negatives)  # batch: data.pairs.PairBatch
        loss = criterion(anchors, positives, negatives, identities=batch.identities)
    """

    def __init__(
        self,
        scale: float = 20.0,
        *,
        symmetric: bool = False,
        gather_distributed: bool = True,
        tile_rows: int | None = None,
        dense_max_bytes: int = DENSE_MAX_BYTES,
    ) -> None:
        super().__init__()
        if not scale > 0:
            raise ValueError(f"MultipleNegativesRankingLoss: scale must be > 0, got {scale}")
        self.scale = scale
        self.symmetric = symmetric
        self.gather_distributed = gather_distributed
        self.tile_rows = tile_rows
        self.dense_max_bytes = dense_max_bytes

    def forward(
        self,
        anchors: torch.Tensor,
        positives: torch.Tensor,
        *negatives: torch.Tensor,
        sizes: list[int] | None = None,
        identities: torch.Tensor | None = None,
    ) -> torch.Tensor:
        name = type(self).__name__
        rank, world_size, sizes, (anchors, positives, _) = check_batch(
            name, anchors, positives, gather_distributed=self.gather_distributed, sizes=sizes
        )
        for column, negative in enumerate(negatives, start=2):
            if negative.shape[1:] != anchors.shape[1:] or len(negative) != len(anchors):
                raise ValueError(
                    f"{name}: column {column} has shape {tuple(negative.shape)}, the anchors "
                    f"{tuple(anchors.shape)}"
                )
        if not negatives:
            require_global_batch(name, sizes, 2, "so that every anchor has a negative")
        with autocast_off(anchors.device):
            dtype = compute_dtype(anchors, positives, *negatives)
            a, p, *n = (F.normalize(x.to(dtype), dim=1) for x in (anchors, positives, *negatives))

            def gathered(x: torch.Tensor, column: int) -> tuple[torch.Tensor, Any]:
                if identities is None:
                    return (collectives.gather(x, sizes=sizes) if world_size > 1 else x), None
                return _gathered_with_identities(x, identities[column], sizes, world_size)

            rows = torch.arange(len(a), device=a.device)
            own = (sum(sizes[:rank]) + rows)[:, None]  # each anchor's positive column
            columns = [gathered(x, column) for column, x in enumerate((p, *n), start=1)]
            candidates = torch.cat([every for every, _ in columns])
            positive = self.scale * (a * p).sum(dim=1)
            excluded = own
            if identities is not None:
                candidate_ids = torch.cat([ids for _, ids in columns])
                excluded = _false_negatives(identities[1], candidate_ids, own)
            negatives_lse = tiled_logsumexp(
                self.scale * a, candidates, excluded, self.tile_rows, self.dense_max_bytes
            )
            terms = softplus(negatives_lse - positive)
            if self.symmetric:
                every_anchor, anchor_ids = gathered(a, 0)
                if identities is not None:
                    excluded = _false_negatives(identities[0], anchor_ids, own)
                reverse = tiled_logsumexp(
                    self.scale * p, every_anchor, excluded, self.tile_rows, self.dense_max_bytes
                )
                terms = 0.5 * (terms + softplus(reverse - positive))
            return terms.sum() * (world_size / sum(sizes))


def _gathered_with_identities(
    x: torch.Tensor, identities: torch.Tensor, sizes: list[int], world_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's rows of ``x`` and their identities, in one gather: the int64 ids'
    bytes ride as extra columns of ``x``'s dtype (a gather copies bytes, and no gradient
    reaches them), and are read back as int64."""
    if world_size == 1:
        return x, identities
    width = x.shape[1]
    riders = identities.to(x.device, torch.int64).unsqueeze(1).view(x.dtype)
    every = collectives.gather(torch.cat([x, riders], dim=1), sizes=sizes)
    return every[:, :width], every[:, width:].detach().contiguous().view(torch.int64).squeeze(1)


def _false_negatives(
    row_ids: torch.Tensor, column_ids: torch.Tensor, own: torch.Tensor
) -> torch.Tensor:
    """``(rows, columns)``: True where a row leaves a column out, its own (``own``) and
    every column whose identity is the row's (``row_ids``), as ``tiled_logsumexp`` takes
    a mask (no host read of how many each row leaves out)."""
    same = row_ids.to(column_ids.device)[:, None] == column_ids[None, :]
    return same.scatter_(1, own, True)
