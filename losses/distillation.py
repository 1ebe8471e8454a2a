"""Feature distillation: a student's projected features against a frozen teacher's,
averaged over the global batch."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from losses.inputs import check_batch, require_global_batch
from losses.precision import autocast_off, compute_dtype

#: ``DistillationLoss``'s distances.
DISTANCES = ("cosine", "l2")


class DistillationLoss(nn.Module):
    """The distance between the student's outputs ``s_i`` (projected to the teacher's
    width) and the frozen teacher's features ``t_i``, over the N samples of the global
    batch (lightly-train's ``distillation``, Hinton et al., 2015, on features)::

        cosine: loss = 1/N sum_i (1 - s_i . t_i / (|s_i| |t_i|))
        l2:     loss = 1/N sum_i 1/D |s_i - t_i|^2     (lightly-train v2's MSE)

    The teacher's side takes no gradient. Each rank's sum is scaled by ``W / N``: exact
    on any number of processes and any split of the batch.

    Example::

        criterion = DistillationLoss("cosine")
        with torch.no_grad():
            targets = teacher(images)                  # (n, D), a frozen tower
        loss = criterion(student(images), targets)     # student: encoder + Linear(., D)
    """

    def __init__(self, distance: str = "cosine", *, gather_distributed: bool = True):
        super().__init__()
        if distance not in DISTANCES:
            raise ValueError(f"DistillationLoss: distance is one of {DISTANCES}, got {distance!r}")
        self.distance = distance
        self.gather_distributed = gather_distributed

    def forward(
        self, student: torch.Tensor, teacher: torch.Tensor, *, sizes: list[int] | None = None
    ) -> torch.Tensor:
        name = type(self).__name__
        _, world_size, sizes, (student, teacher, _) = check_batch(
            name, student, teacher, gather_distributed=self.gather_distributed, sizes=sizes
        )
        require_global_batch(name, sizes, 1, "")
        with autocast_off(student.device):
            dtype = compute_dtype(student, teacher)
            student, teacher = student.to(dtype), teacher.detach().to(dtype)
            if self.distance == "cosine":
                per_sample = 1 - F.cosine_similarity(student, teacher, dim=1)
            else:
                per_sample = (student - teacher).pow(2).mean(dim=1)
            return per_sample.sum() * (world_size / sum(sizes))
