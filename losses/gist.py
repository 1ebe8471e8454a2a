"""GISTEmbed: in-batch negatives vetted by a frozen guide model, over the global batch."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from contrastive_accelerate import collectives
from losses.inputs import check_batch, require_global_batch
from losses.logsumexp import DENSE_MAX_BYTES, tiled_logsumexp
from losses.precision import autocast_off, compute_dtype

MARGIN_STRATEGIES = ("absolute", "relative")


class GISTEmbedLoss(nn.Module):
    """GISTEmbed (Solatorio, 2024; sentence-transformers' ``GISTEmbedLoss``): the
    multiple-negatives ranking loss whose in-batch negatives a frozen guide model vets.

    For the global batch of N anchors ``a_i``, positives ``p_i`` and K columns of hard
    negatives ``n^k_i``, with ``s`` the cosine similarity of the trained embeddings and
    ``g`` that of the guide's embeddings of the same texts, row i scores ``s(a_i, p_j)``,
    ``s(a_i, a_j)`` (``contrast_anchors``), ``s(p_i, p_j)`` (``contrast_positives``) and
    ``s(a_i, n^k_j)`` over every j of the global batch, each divided by ``temperature``,
    and leaves out every candidate but its positive that the guide finds closer than
    the positive::

        g(x_i, c_j) > g(a_i, p_i) - margin                  margin_strategy="absolute"
        g(x_i, c_j) > g(a_i, p_i) - |g(a_i, p_i)| * margin  margin_strategy="relative"

        loss = 1/N * sum_i [ log sum_{kept j} exp(logit_ij) - s(a_i, p_i) / temperature ]

    On one process this is sentence-transformers' loss. Across processes every candidate
    is the global batch's, anchors included, each positive at its global index, so 1 and
    N processes optimise the same objective, uneven batches included (sentence-
    transformers' ``gather_across_devices=True`` contrasts each device's anchors only
    among its own). The guide's embeddings ride in the same gather as the trained ones.

    Example::

        criterion = GISTEmbedLoss(temperature=0.01)
        with torch.no_grad():
            guides = [guide(ids, mask) for ids, mask in batch.columns]
        columns = [tower(ids, mask) for ids, mask in batch.columns]
        loss = criterion(*columns, guides=guides)  # anchors, positives, negatives...
    """

    def __init__(
        self,
        temperature: float = 0.01,
        margin_strategy: str = "absolute",
        margin: float = 0.0,
        contrast_anchors: bool = True,
        contrast_positives: bool = True,
        *,
        gather_distributed: bool = True,
        tile_rows: int | None = None,
        dense_max_bytes: int = DENSE_MAX_BYTES,
    ) -> None:
        super().__init__()
        if not temperature > 0:
            raise ValueError(f"GISTEmbedLoss: temperature must be > 0, got {temperature}")
        if margin_strategy not in MARGIN_STRATEGIES:
            raise ValueError(
                f"GISTEmbedLoss: margin_strategy must be one of {MARGIN_STRATEGIES}, "
                f"got {margin_strategy!r}"
            )
        self.temperature, self.margin_strategy, self.margin = temperature, margin_strategy, margin
        self.contrast_anchors, self.contrast_positives = contrast_anchors, contrast_positives
        self.gather_distributed = gather_distributed
        self.tile_rows, self.dense_max_bytes = tile_rows, dense_max_bytes

    def forward(
        self,
        anchors: torch.Tensor,
        positives: torch.Tensor,
        *negatives: torch.Tensor,
        guides: Sequence[torch.Tensor],
        sizes: list[int] | None = None,
    ) -> torch.Tensor:
        name = type(self).__name__
        rank, world_size, sizes, (anchors, positives, _) = check_batch(
            name, anchors, positives, gather_distributed=self.gather_distributed, sizes=sizes
        )
        columns = (anchors, positives, *negatives)
        if not negatives:
            require_global_batch(name, sizes, 2, "so that every anchor has a negative")
        if len(guides) != len(columns):
            raise ValueError(f"{name}: {len(guides)} guide columns for {len(columns)} columns")
        for column, (x, guide) in enumerate(zip(columns, guides, strict=True)):
            if x.shape[1:] != anchors.shape[1:] or {len(x), len(guide)} != {len(anchors)}:
                raise ValueError(
                    f"{name}: column {column} has shape {tuple(x.shape)} and its guide's "
                    f"{tuple(guide.shape)}, the anchors {tuple(anchors.shape)}"
                )
        with autocast_off(anchors.device):
            dtype = compute_dtype(*columns)
            trained = [F.normalize(x.to(dtype), dim=1) for x in columns]
            guided = [F.normalize(g.detach().to(dtype), dim=1) for g in guides]

            def gathered(column: int) -> tuple[torch.Tensor, torch.Tensor]:
                """Every rank's rows of a column and of its guide's, in one gather."""
                x, g = trained[column], guided[column]
                if world_size == 1:
                    return x, g
                every = collectives.gather(torch.cat([x, g], dim=1), sizes=sizes)
                return every[:, : x.shape[1]], every[:, x.shape[1] :].detach()

            a, p = trained[:2]
            rows = torch.arange(len(a), device=a.device)
            own = sum(sizes[:rank]) + rows  # each anchor's positive among the candidates
            every_positive = gathered(1)
            by_anchors = [every_positive]  # (trained, guide) columns each anchor scores
            if self.contrast_anchors:
                by_anchors.append(gathered(0))
            by_anchors += [gathered(column) for column in range(2, len(columns))]
            threshold = (guided[0] * guided[1]).sum(dim=1, keepdim=True)  # g(a_i, p_i)
            if self.margin_strategy == "absolute":
                threshold = threshold - self.margin
            else:
                threshold = threshold - threshold.abs() * self.margin
            keys = torch.cat([x for x, _ in by_anchors])
            left_out = guided[0] @ torch.cat([g for _, g in by_anchors]).T > threshold
            left_out[rows, own] = False  # never the positive
            queries = a
            if self.contrast_positives:
                # Positives score positives in the same sum: queries [a_i, p_i] against
                # keys [k, 0] (the anchors' candidates) and [0, p_j].
                queries = torch.cat([a, p], dim=1)
                every_p, every_p_guided = every_positive
                keys = torch.cat([F.pad(keys, (0, every_p.shape[1])),
                                  F.pad(every_p, (a.shape[1], 0))])  # fmt: skip
                by_positives = guided[1] @ every_p_guided.T > threshold
                left_out = torch.cat([left_out, by_positives], dim=1)
            log_sums = tiled_logsumexp(
                queries / self.temperature, keys, left_out, self.tile_rows, self.dense_max_bytes
            )
            positive = (a * p).sum(dim=1) / self.temperature
            return (log_sums - positive).sum() * (world_size / sum(sizes))
