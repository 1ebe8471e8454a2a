"""SwAV's swapped prediction over the global batch: codes from a distributed
Sinkhorn-Knopp, each rank's share of the cross-entropy scaled by the global batch."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from losses.inputs import check_batch, require_global_batch
from losses.precision import autocast_off, compute_dtype
from losses.sinkhorn import sinkhorn_knopp


class SwAVLoss(nn.Module):
    """Swapped assignments between views (Caron et al., 2020, "Unsupervised Learning of
    Visual Features by Contrasting Cluster Assignments"). For the scores ``s_v = z_v P^T``
    of every crop v (C crops, the first G high-resolution) against the K prototypes P,
    over the N samples of the global batch::

        q_a = SinkhornKnopp([s_a ; queue_a], epsilon, iterations)   (the batch's rows)
        loss = 1/G sum_{a<G} 1/(C-1) sum_{v != a} 1/N sum_i -q_ai . log_softmax(s_vi / T)

    The codes ``q_a`` (no gradient) spread the global batch and the queue evenly over the
    prototypes: ``losses.sinkhorn_knopp`` all-reduces its sums and counts every rank's
    rows, where SwAV's code and lightly's take ``local rows * W`` as the batch. Each
    rank's sum is scaled by ``W / N``: exact on any number of processes. On one process
    it is lightly's ``SwaVLoss``. ``queue_outputs`` are this rank's rows of the queue's
    scores, one tensor per high-resolution crop (a queue held whole on every rank is
    split among them by the caller: ``queue_sizes`` says how, else it is exchanged).

    Example::

        criterion = SwAVLoss(temperature=0.1, sinkhorn_epsilon=0.05)
        scores = [model(crop) for crop in crops]       # z @ prototypes.T, (n, K) each
        loss = criterion(scores[:2], scores[2:])
    """

    def __init__(
        self,
        temperature: float = 0.1,
        sinkhorn_iterations: int = 3,
        sinkhorn_epsilon: float = 0.05,
        sinkhorn_gather_distributed: bool = True,
    ):
        super().__init__()
        if not temperature > 0 or not sinkhorn_epsilon > 0 or sinkhorn_iterations < 1:
            raise ValueError(
                "SwAVLoss: temperature > 0, sinkhorn_epsilon > 0 and sinkhorn_iterations >= 1, "
                f"got {temperature}, {sinkhorn_epsilon}, {sinkhorn_iterations}"
            )
        self.temperature = temperature
        self.sinkhorn_iterations = sinkhorn_iterations
        self.sinkhorn_epsilon = sinkhorn_epsilon
        self.gather_distributed = sinkhorn_gather_distributed

    def forward(
        self,
        high_resolution_outputs: Sequence[torch.Tensor],
        low_resolution_outputs: Sequence[torch.Tensor] = (),
        queue_outputs: Sequence[torch.Tensor] | None = None,
        *,
        sizes: list[int] | None = None,
        queue_sizes: Sequence[int] | None = None,
    ) -> torch.Tensor:
        name = type(self).__name__
        crops = len(high_resolution_outputs) + len(low_resolution_outputs)
        if crops < 2 or not high_resolution_outputs:
            raise ValueError(f"{name}: at least one high-resolution crop and one other crop")
        if queue_outputs is not None and len(queue_outputs) != len(high_resolution_outputs):
            raise ValueError(f"{name}: one queue per high-resolution crop")
        first = high_resolution_outputs[0]
        _, world_size, sizes, _ = check_batch(
            name, first, first, gather_distributed=self.gather_distributed, sizes=sizes
        )
        require_global_batch(name, sizes, 1, "")
        if queue_outputs is not None and queue_sizes is None:
            queue_sizes = check_batch(
                name, queue_outputs[0], queue_outputs[0],
                gather_distributed=self.gather_distributed,
            ).sizes  # fmt: skip
        with autocast_off(first.device):
            dtype = compute_dtype(*high_resolution_outputs, *low_resolution_outputs)
            scores = [s.to(dtype) for s in (*high_resolution_outputs, *low_resolution_outputs)]
            log_probabilities = [F.log_softmax(s / self.temperature, dim=1) for s in scores]
            total = first.new_zeros((), dtype=dtype)
            for a, assigned in enumerate(scores[: len(high_resolution_outputs)]):
                queue = None if queue_outputs is None else queue_outputs[a]
                codes = self.codes(assigned, queue, sizes, queue_sizes)
                for v, log_probability in enumerate(log_probabilities):
                    if v != a:
                        total = total - (codes.to(dtype) * log_probability).sum() / (crops - 1)
            return total * (world_size / (len(high_resolution_outputs) * sum(sizes)))

    def codes(
        self,
        scores: torch.Tensor,
        queue: torch.Tensor | None,
        sizes: list[int],
        queue_sizes: Sequence[int] | None,
    ) -> torch.Tensor:
        """Sinkhorn-Knopp's codes of this rank's rows, the queue's rows in the marginals."""
        rows = len(scores)
        scores = scores.detach()
        if queue is not None:
            scores = torch.cat([scores, queue.detach().to(scores.dtype)])
            sizes = [size + extra for size, extra in zip(sizes, queue_sizes, strict=True)]
        codes = sinkhorn_knopp(
            scores, self.sinkhorn_epsilon, self.sinkhorn_iterations, sizes=sizes,
            gather_distributed=self.gather_distributed,
        )  # fmt: skip
        return codes[:rows]
