"""Supervised contrastive loss (SupCon) over the global batch of all ranks."""

from __future__ import annotations

import torch

from contrastive_accelerate import collectives
from losses.logsumexp import DENSE_MAX_BYTES
from losses.precision import autocast_off
from losses.views import GatheredViews, TwoViewLoss


class SupConLoss(TwoViewLoss):
    """Supervised contrastive loss (Khosla et al., 2020), the paper's L_out, "all" mode.

    Every one of the 2N L2-normalised views is an anchor; its positives P(i) are all
    other views with the same label, A(i) all other views, ``s_ij = z_i . z_j / t``::

        loss = 1/(2N) * sum_i [ log sum_{a in A(i)} exp(s_ia) - 1/|P(i)| sum_{p in P(i)} s_ip ]

    times ``temperature`` when ``rescale`` (as lightly's unreleased ``SupConLoss``
    does by default; its keyword arguments are accepted). ``labels=None`` makes the
    other view the only positive: NT-Xent. Labels are gathered with the embeddings,
    so positives are found across ranks; the positive term uses the sum of each
    class's gathered embeddings, never a 2N x 2N mask. Distributed as ``NTXentLoss``
    is, exact on any number of processes (see ``losses``).

    Example::

        criterion = SupConLoss(temperature=0.1)
        loss = criterion(model(view0), model(view1), labels)
        accelerator.backward(loss)
    """

    def __init__(
        self,
        temperature: float = 0.1,
        *,
        gather_distributed: bool = True,
        rescale: bool = False,
        tile_rows: int | None = None,
        dense_max_bytes: int = DENSE_MAX_BYTES,
    ) -> None:
        super().__init__(temperature, gather_distributed, tile_rows, dense_max_bytes)
        self.rescale = rescale

    def forward(
        self,
        out0: torch.Tensor,
        out1: torch.Tensor,
        labels: torch.Tensor | None = None,
        *,
        sizes: list[int] | None = None,
    ) -> torch.Tensor:
        with autocast_off(out0.device):
            views = self._gathered(out0, out1, labels, sizes)
            log_denominator = self._log_denominator(views, self._own_columns(views))
            if labels is None:
                positive = 2 * (views.z0 * views.z1).sum() / self.temperature
            else:
                positive = self._mean_positive_similarity(views, views.labels)
            loss = self._global_mean(log_denominator.sum() - positive, views)
            return loss * self.temperature if self.rescale else loss

    def _mean_positive_similarity(self, views: GatheredViews, labels) -> torch.Tensor:
        """``sum_i 1/|P(i)| sum_{p in P(i)} s_ip`` over this rank's anchors."""
        local, keys = views.local, views.keys
        labels = labels.to(local.device).long()
        every = labels
        if views.world_size > 1:
            every = collectives.gather(labels, sizes=views.sizes)
        # Key labels in the keys' order: each rank's first views, then its second views.
        key_labels = torch.cat([torch.cat([block, block]) for block in every.split(views.sizes)])
        # Classes numbered by sorting, not torch.unique: no shape depends on the data, so
        # nothing waits for the device. Up to len(keys) classes; the unused rows stay 0.
        ordered, order = key_labels.sort(stable=True)
        first_of_class = torch.ones_like(ordered, dtype=torch.bool)
        first_of_class[1:] = ordered[1:] != ordered[:-1]
        key_class = torch.empty_like(order).scatter_(0, order, first_of_class.cumsum(0) - 1)
        class_sums = keys.new_zeros(keys.shape).index_add(0, key_class, keys)
        ones = torch.ones_like(key_class)
        class_sizes = torch.zeros_like(key_class).index_add(0, key_class, ones)
        # This rank's anchors are keys[offset : offset + 2n], in the same order as local.
        anchor_class = key_class[views.offset : views.offset + len(local)]
        # Positives of anchor i: its class's views but itself (the other view is one).
        positive_sums = class_sums[anchor_class] - local
        counts = (class_sizes[anchor_class] - 1).to(local.dtype)
        similarity = (local * positive_sums).sum(dim=1) / self.temperature
        return (similarity / counts).sum()
