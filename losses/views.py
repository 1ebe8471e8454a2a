"""What the two-view softmax losses (NT-Xent, DCL, DCLW, SupCon) share.

A temperature, optional row tiles, and the same first steps: check the inputs on
every rank, L2-normalise both views in the loss's compute dtype, and gather every
rank's rows with gradients. Each loss then differs only in which columns it leaves
out of its log-sum-exp and in its positive term.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from contrastive_accelerate import collectives
from losses.inputs import check_batch, require_global_batch
from losses.logsumexp import DENSE_MAX_BYTES, tiled_logsumexp
from losses.precision import compute_dtype


class GatheredViews(NamedTuple):
    """This rank's normalised views, and every rank's, gathered in rank order."""

    z0: torch.Tensor  # (n, d) first views of this rank's samples
    z1: torch.Tensor  # (n, d) their second views
    local: torch.Tensor  # (2n, d) rows [z0; z1]
    keys: torch.Tensor  # (2N, d) every rank's rows: rank r's n_r first views, then its second
    offset: int  # the column of this rank's first row among the keys
    world_size: int
    sizes: list[int]  # every rank's n
    labels: torch.Tensor | None  # (n,) this rank's labels, if given


class TwoViewLoss(nn.Module):
    """Base of NT-Xent, DCL, DCLW and SupCon: their options and their common first steps."""

    def __init__(
        self,
        temperature: float,
        gather_distributed: bool,
        tile_rows: int | None,
        dense_max_bytes: int = DENSE_MAX_BYTES,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        if not (math.isfinite(temperature) and temperature > 0):
            raise ValueError(f"{name}: temperature must be positive, got {temperature}")
        if tile_rows is not None and tile_rows < 1:
            raise ValueError(f"{name}: tile_rows must be >= 1, got {tile_rows}")
        self.temperature = temperature
        self.gather_distributed = gather_distributed
        self.tile_rows = tile_rows
        self.dense_max_bytes = dense_max_bytes

    def _gathered(self, out0, out1, labels=None, sizes=None) -> GatheredViews:
        """Check, normalise and gather the two views (call with autocast off)."""
        name = type(self).__name__
        rank, world_size, sizes, (out0, out1, labels) = check_batch(
            name, out0, out1, labels, gather_distributed=self.gather_distributed, sizes=sizes
        )
        require_global_batch(name, sizes, 2, "so that every sample has a negative")
        dtype = compute_dtype(out0, out1)
        z0, z1 = F.normalize(out0.to(dtype), dim=1), F.normalize(out1.to(dtype), dim=1)
        local = torch.cat([z0, z1])
        keys = local
        if world_size > 1:
            keys = collectives.gather(local, sizes=[2 * size for size in sizes])
        offset = 2 * sum(sizes[:rank])
        return GatheredViews(z0, z1, local, keys, offset, world_size, sizes, labels)

    def _log_denominator(self, views: GatheredViews, excluded: torch.Tensor) -> torch.Tensor:
        """``log sum_j exp(z_i . k_j / t)`` for every local row, ``excluded`` columns left out."""
        return tiled_logsumexp(
            views.local / self.temperature, views.keys, excluded, self.tile_rows,
            self.dense_max_bytes,
        )  # fmt: skip

    @staticmethod
    def _own_columns(views: GatheredViews) -> torch.Tensor:
        """Each local row's own column among the keys, as a (2n, 1) index."""
        rows = torch.arange(len(views.local), device=views.local.device)
        return (views.offset + rows)[:, None]

    @staticmethod
    def _global_mean(local_sum: torch.Tensor, views: GatheredViews) -> torch.Tensor:
        """A sum over this rank's 2n anchors, scaled by ``W / 2N`` (see ``losses``)."""
        return local_sum * (views.world_size / (2 * sum(views.sizes)))
