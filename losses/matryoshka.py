"""Matryoshka representation learning over any loss of embeddings."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn


def matryoshka(
    loss: Callable[..., torch.Tensor],
    embeddings: Sequence[torch.Tensor],
    dims: Sequence[int],
    weights: Sequence[float] | None = None,
) -> torch.Tensor:
    """``sum_d w_d * loss([x[:, :d] for x in embeddings])`` over ``dims`` (``weights``
    none: 1 each). Each prefix is a row's own, so a loss exact over the global batch
    stays exact; the prefixes are views, so one backward reaches every embedding once."""
    weights = [1.0] * len(dims) if weights is None else list(weights)
    if len(weights) != len(dims):
        raise ValueError(f"matryoshka: {len(dims)} dims but {len(weights)} weights")
    width = embeddings[0].shape[-1]
    if not dims or any(not 0 < d <= width for d in dims):
        raise ValueError(
            f"matryoshka dims {','.join(map(str, dims))}: each must be in 1..{width}, the "
            "embeddings' width"
        )
    terms = [w * loss([x[..., :d] for x in embeddings]) for d, w in zip(dims, weights, strict=True)]
    return torch.stack(terms).sum()


class MatryoshkaLoss(nn.Module):
    """Matryoshka representation learning (Kusupati et al., 2022, "Matryoshka
    Representation Learning"; sentence-transformers' ``MatryoshkaLoss``): the wrapped
    loss on the first d dimensions of every embedding, for each d of
    ``matryoshka_dims``, weighted::

        loss = sum_d w_d * loss(x_1[:, :d], x_2[:, :d], ...)

    so that each prefix of an embedding is itself an embedding, to be truncated at use.
    The wrapped loss must normalise inside (cosine similarity: MNRL, NT-Xent), as a
    prefix of a unit vector is not one. Every dimension is trained at every step
    (sentence-transformers' ``n_dims_per_step=-1``, its default).

    Exact on any number of processes whenever the wrapped loss is: truncation is per row,
    and each term is that loss over the global batch (``sizes=`` is passed through).

    Example::

        criterion = MatryoshkaLoss(MultipleNegativesRankingLoss(20.0), [768, 256, 64])
        loss = criterion(anchors, positives)
    """

    def __init__(
        self,
        loss: nn.Module,
        matryoshka_dims: Sequence[int],
        matryoshka_weights: Sequence[float] | None = None,
    ) -> None:
        super().__init__()
        self.loss, self.matryoshka_dims = loss, tuple(matryoshka_dims)
        self.matryoshka_weights = None if matryoshka_weights is None else tuple(matryoshka_weights)

    def forward(self, *embeddings: torch.Tensor, **kwargs) -> torch.Tensor:
        return matryoshka(
            lambda prefixes: self.loss(*prefixes, **kwargs),
            embeddings,
            self.matryoshka_dims,
            self.matryoshka_weights,
        )
