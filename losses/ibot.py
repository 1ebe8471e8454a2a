"""iBOT's masked-patch loss over the global batch: each image's masked patches averaged,
then the images averaged over every rank's, whatever each rank's share."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from losses.inputs import check_batch, require_global_batch
from losses.precision import autocast_off, compute_dtype


class IBOTPatchLoss(nn.Module):
    """The masked-image-modelling loss of iBOT (Zhou et al., 2022, "iBOT: Image BERT
    Pre-Training with Online Tokenizer"), as DINOv2 uses it: for the N images of the
    global batch, image i's masked patches ``M_i``, the student's outputs ``s_ip`` on
    them (the masked input) and the teacher's ``t_ip`` (the unmasked input), the center
    ``c`` and the temperatures ``T_t`` and ``T_s``::

        loss = 1/N * sum_i 1/max(|M_i|, 1) * sum_{p in M_i} -q_ip . log_softmax(s_ip / T_s),
        q_ip = softmax((t_ip - c) / T_t)

    An image without masked patches counts in N with nothing to add. DINOv2 and lightly
    divide by each rank's own number of images, the global mean only for equal shares;
    here each rank's sum is scaled by ``W / N``: exact on any number of processes, with
    no collective but the sizes' exchange. On one process it is lightly's
    ``IBOTPatchLoss`` given the same center; the center is the caller's state
    (``losses.dino.batch_center`` of the teacher's patch outputs gives its update).
    ``center=None`` takes ``teacher_patches`` as the targets ``q`` themselves (DINOv2's
    Sinkhorn-Knopp codes, ``losses.sinkhorn_knopp``), as ``DINOLoss`` does.

    Example::

        masks = patch_masks(seed, epoch, indices, grid=(14, 14))          # (n, 14, 14)
        student = head(vit(images, masks=masks)[:, 1:][masks.flatten(1)])  # (masked, K)
        teacher = head(teacher_vit(images)[:, 1:][masks.flatten(1)])
        loss = IBOTPatchLoss()(student, teacher, masks, teacher_temperature=0.04, center=c)
    """

    def __init__(self, student_temperature: float = 0.1, *, gather_distributed: bool = True):
        super().__init__()
        if not student_temperature > 0:
            raise ValueError(
                f"IBOTPatchLoss: student_temperature must be > 0, got {student_temperature}"
            )
        self.student_temperature = student_temperature
        self.gather_distributed = gather_distributed

    def forward(
        self,
        student_patches: torch.Tensor,
        teacher_patches: torch.Tensor,
        masks: torch.Tensor,
        teacher_temperature: float,
        center: torch.Tensor | None,
        *,
        sizes: list[int] | None = None,
    ) -> torch.Tensor:
        """``student_patches`` and ``teacher_patches``: ``(masked, K)``, the masked patches
        of this rank's images in ``masks``' order (``masks``: ``(n, ...)`` boolean, one
        mask per image)."""
        name = type(self).__name__
        per_image = masks.flatten(1).sum(dim=1)
        if student_patches.shape != teacher_patches.shape or student_patches.dim() != 2:
            raise ValueError(
                f"{name}: student and teacher patches must be (masked, K) alike, got "
                f"{tuple(student_patches.shape)} and {tuple(teacher_patches.shape)}"
            )
        # Checked on the device, which the host does not wait for (an error on CUDA at
        # the next read): one patch row for each masked patch.
        torch._assert_async(
            per_image.sum() == len(student_patches),
            f"{name}: the patch rows are not one for each masked patch of masks",
        )
        flat = masks.flatten(1).to(student_patches.dtype)
        rank, world_size, sizes, _ = check_batch(
            name, flat, flat, gather_distributed=self.gather_distributed, sizes=sizes
        )
        require_global_batch(name, sizes, 1, "")
        with autocast_off(student_patches.device):
            dtype = compute_dtype(student_patches, teacher_patches)
            targets = (
                teacher_patches.to(dtype)
                if center is None
                else F.softmax(
                    (teacher_patches.to(dtype) - center.to(dtype)) / teacher_temperature, dim=-1
                )
            )
            log_probabilities = F.log_softmax(
                student_patches.to(dtype) / self.student_temperature, dim=-1
            )
            cross_entropy = -(targets * log_probabilities).sum(dim=-1)
            # 1 / |M_i| at each masked patch of image i, in the rows' order.
            weights = (flat.to(dtype) / per_image.clamp(min=1).to(dtype)[:, None]).flatten()
            weights = weights[masked_rows(masks, len(student_patches))]
            return (cross_entropy * weights.to(cross_entropy.device)).sum() * (
                world_size / sum(sizes)
            )


def masked_rows(masks: torch.Tensor, masked: int | None = None) -> torch.Tensor:
    """The flat positions of ``masks``' True entries in order, as ``nonzero`` gives them,
    without a read of the device when their number ``masked`` is given: a stable sort puts
    them first."""
    flat = masks.flatten()
    if masked is None:
        masked = int(flat.sum())
    return torch.argsort(flat.logical_not().to(torch.uint8), stable=True)[:masked]
