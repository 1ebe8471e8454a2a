"""DINO's self-distillation loss and its teacher center, over the global batch."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from contrastive_accelerate import collectives
from contrastive_accelerate.collectives import is_distributed
from losses.inputs import check_batch, require_global_batch
from losses.precision import autocast_off, compute_dtype

#: ``batch_center``'s formulas: ours, and the control that reproduces DINO's.
CENTER_FORMULAS = ("global", "dino")
#: How DINO's teacher is centred: an EMA center by one of ``CENTER_FORMULAS``, or
#: DINOv2's Sinkhorn-Knopp over the global batch (``losses.sinkhorn_knopp``).
CENTERINGS = (*CENTER_FORMULAS, "sinkhorn")


class DINOLoss(nn.Module):
    """Cross-entropy of the student's crops against the teacher's centred, sharpened
    global crops (Caron et al., 2021, "Emerging Properties in Self-Supervised ViTs").

    For teacher crops ``t_a`` (the global ones), student crops ``s_v`` (global and local),
    the center ``c``, temperatures ``T_t`` and ``T_s``, over the N samples of the global
    batch and the P pairs ``(a, v)`` with ``a != v`` (the same global crop is not its
    own target)::

        loss = 1/(P N) * sum_{a != v} sum_i -softmax((t_ai - c) / T_t) . log_softmax(s_vi / T_s)

    On one process this is lightly's ``DINOLoss`` given the same center. The center is
    the caller's state: ``batch_center`` gives the global batch's mean for its EMA.
    ``center=None`` takes ``teacher_crops`` as the targets themselves, distributions
    over the outputs (DINOv2's Sinkhorn-Knopp codes, ``losses.sinkhorn_knopp``). Each
    rank's sum is scaled by ``W / N``, exact on any number of processes.

    Example::

        criterion = DINOLoss(student_temperature=0.1)  # model: DINOModel(dino_out_dim=1024)
        loss = criterion([model(c) for c in crops], [teacher(c) for c in crops[:2]], 0.04, center)
        center = 0.9 * center + 0.1 * batch_center([teacher(c) for c in crops[:2]])
    """

    def __init__(self, student_temperature: float = 0.1, *, gather_distributed: bool = True):
        super().__init__()
        if student_temperature <= 0:
            raise ValueError(
                f"DINOLoss: student_temperature must be > 0, got {student_temperature}"
            )
        self.student_temperature = student_temperature
        self.gather_distributed = gather_distributed

    def forward(
        self,
        student_crops: Sequence[torch.Tensor],
        teacher_crops: Sequence[torch.Tensor],
        teacher_temperature: float,
        center: torch.Tensor | None,
        *,
        sizes: list[int] | None = None,
    ) -> torch.Tensor:
        name = type(self).__name__
        pairs = len(teacher_crops) * len(student_crops) - min(
            len(teacher_crops), len(student_crops)
        )
        if pairs == 0:
            raise ValueError(f"{name}: no pair of different crops to compare")
        first_student, first_teacher = student_crops[0], teacher_crops[0]
        rank, world_size, sizes, _ = check_batch(
            name, first_student, first_teacher, gather_distributed=self.gather_distributed,
            sizes=sizes,
        )  # fmt: skip
        require_global_batch(name, sizes, 1, "")
        with autocast_off(first_student.device):
            dtype = compute_dtype(*student_crops, *teacher_crops)
            targets = [
                t.to(dtype)
                if center is None
                else F.softmax((t.to(dtype) - center.to(dtype)) / teacher_temperature, dim=-1)
                for t in teacher_crops
            ]
            total = first_student.new_zeros((), dtype=dtype)
            for v, student in enumerate(student_crops):
                log_probabilities = F.log_softmax(student.to(dtype) / self.student_temperature, -1)
                for a, target in enumerate(targets):
                    if a != v:
                        total = total - (target * log_probabilities).sum()
            return total * (world_size / (pairs * sum(sizes)))


def batch_center(
    teacher_crops: Sequence[torch.Tensor],
    sizes: list[int] | None = None,
    *,
    formula: str = "global",
) -> torch.Tensor:
    """The mean teacher output over every crop of the global batch: sums and row counts
    all-reduced, whatever each rank's share. ``formula="dino"`` is the control:
    DINO's ``all_reduce(sum) / (local rows * W)``, the global mean only for equal shares."""
    if formula not in CENTER_FORMULAS:
        raise ValueError(f"formula must be one of {CENTER_FORMULAS}, got {formula!r}")
    with torch.no_grad():
        stacked = torch.cat(list(teacher_crops))
        total = stacked.sum(dim=0, keepdim=True)
        world_size = torch.distributed.get_world_size() if is_distributed() else 1
        if world_size > 1:
            total = collectives.all_reduce(total)
        if formula == "dino":
            return total / (len(stacked) * world_size)
        global_rows = sum(sizes) if sizes is not None else None
        if global_rows is None:
            count = stacked.new_tensor([float(len(stacked))])
            global_rows = collectives.all_reduce(count) if world_size > 1 else count
            return total / global_rows
        return total / (global_rows * len(teacher_crops))
