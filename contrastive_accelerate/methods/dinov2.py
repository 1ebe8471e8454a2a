"""DINOv2's objective (Oquab et al., 2024): DINO's loss on the global and local crops,
iBOT's masked-patch loss (Zhou et al., 2022) on the patch tokens of the global crops,
KoLeo and the Sinkhorn-Knopp centering (its defaults; DINO's options), on a ViT: ours,
or a pretrained transformers or timm one."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from contrastive_accelerate import collectives
from contrastive_accelerate.collectives import is_distributed
from contrastive_accelerate.config import ConfigError, field_names, option
from contrastive_accelerate.data import MultiCropBatch
from contrastive_accelerate.data.masks import PatchMasking
from contrastive_accelerate.launch import TrainerError
from contrastive_accelerate.methods import dino
from contrastive_accelerate.methods.base import EVERY_SOURCE, Family, MethodRow, image_data
from contrastive_accelerate.methods.dino import DINOMethod
from contrastive_accelerate.methods.multicrop import crop_outputs, embed_crops
from losses import IBOTPatchLoss
from losses.sinkhorn import sinkhorn_knopp
from models import DINOv2Model
from models.towers import IMAGE_TOWERS, scratch_tower


@dataclass
class DINOv2Options:
    """What only DINOv2 reads, a section of ``TrainConfig``
    (``contrastive_accelerate.options``); it reads DINO's too."""

    ibot_weight: float = option(
        1.0, "dinov2: weight of iBOT's masked-patch loss", resume="apply", at_least=0.0
    )
    separate_ibot_head: bool = option(False, "dinov2: iBOT's own head (DINOv2: DINO's)")
    mask_probability: float = option(
        0.5, "dinov2: chance that a global crop's patches are masked", at_least=0.0, at_most=1.0
    )
    mask_ratio_min: float = option(
        0.1, "dinov2: least share of a masked crop's patches", at_least=0.0, at_most=1.0
    )
    mask_ratio_max: float = option(
        0.5, "dinov2: largest share of a masked crop's patches", at_least=0.0, at_most=1.0
    )


class DINOv2Method(DINOMethod):
    """DINO's method (``dino.DINOMethod``: multi-crop, the EMA teacher, its center or
    the Sinkhorn-Knopp, KoLeo) plus iBOT's loss. Each global crop of a sample has a mask
    drawn from (seed, epoch, index, crop) alone (``data.masks.patch_masks``), the same on
    any number of processes, where DINOv2 draws a batch's masks from each rank's
    ``random``; the loader draws and counts them (``data.MultiCrop``'s ``masking``). The
    student sees the masked patches as the mask token, the teacher sees the crop whole;
    the student's iBOT head on each masked patch is trained towards the teacher's,
    centred by the Sinkhorn-Knopp over every rank's masked patches (DINOv2's default) or
    by an EMA of their mean (``--dino-center global``) and sharpened, each image's
    patches averaged, then the global batch's images (``losses.IBOTPatchLoss``). With
    ``--augmentation-seeding per-process`` the masks are drawn from the process's RNG,
    seed + rank (the control).
    """

    model_class = DINOv2Model

    def __init__(self, config, data, world_size: int, say, **kwargs: Any):
        super().__init__(config, data, world_size, say, **kwargs)
        self.ibot_weight = config.ibot_weight
        self.patch_center = torch.zeros_like(self.center)
        self.ibot = IBOTPatchLoss(config.temperature, gather_distributed=config.gather)
        self._teacher_patches: torch.Tensor | None = None

    def heads(self, config) -> dict[str, Any]:
        return {"separate_ibot_head": config.separate_ibot_head}

    def patch_masking(self, config) -> PatchMasking:
        grid = self.model.patch_grid(config.image_size)
        return PatchMasking(
            (grid, grid), config.mask_probability, (config.mask_ratio_min, config.mask_ratio_max)
        )

    def embed(self, model: nn.Module, chunk: MultiCropBatch, step: int) -> torch.Tensor:
        """The global crops' outputs with their masked patches' iBOT logits, then the local
        crops' outputs, flattened into one tensor (gradient caching's one output)."""
        device = next(model.parameters()).device
        classes, patches = embed_crops(
            model, chunk.global_crops, chunk.indices, self.seed, step, 0,
            masks=chunk.masks.flatten(0, 1).to(device, non_blocking=True),
            masked=sum(map(sum, chunk.masked)),
        )  # fmt: skip
        local = chunk.local_crops
        local_outputs = (
            [embed_crops(model, local, chunk.indices, self.seed, step, len(chunk.global_crops))]
            if len(local) else []
        )  # fmt: skip
        return torch.cat([output.flatten() for output in (classes, *local_outputs, patches)])

    def loss(
        self,
        outputs: list[torch.Tensor],
        batch: MultiCropBatch,
        sizes: Sequence[int] | None,
        step: int,
    ) -> torch.Tensor:
        crops = len(batch.global_crops)
        classes, patches = self.unflatten(outputs, batch)
        masks = batch.masks.flatten(0, 1).to(self.center.device, non_blocking=True)
        with torch.no_grad():
            targets, teacher_patches = embed_crops(
                self.teacher, batch.global_crops, batch.indices, self.seed, step, 64,
                masks=masks, masked=len(patches), mask_input=False,
            )  # fmt: skip
        loss = self.image_loss(crop_outputs(classes, batch), targets, batch, sizes, step)
        self._teacher_patches = teacher_patches
        if not self.ibot_weight:
            return loss
        temperature = self.temperature_at(step)
        images = None if sizes is None else [crops * size for size in sizes]
        if self.center_formula == "sinkhorn":  # DINOv2's: every rank's masked patches in one
            codes = sinkhorn_knopp(teacher_patches, temperature, gather_distributed=self.gather)
            ibot = self.ibot(patches, codes, masks, temperature, None, sizes=images)
        else:
            ibot = self.ibot(patches, teacher_patches, masks, temperature, self.patch_center,
                             sizes=images)  # fmt: skip
        return loss + self.ibot_weight * ibot

    def unflatten(
        self, outputs: list[torch.Tensor], batch: MultiCropBatch
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """``embed``'s chunks as DINO's outputs of each chunk, and the student's iBOT
        logits of every masked patch in ``batch.masks``' order: crop by crop, each crop's
        samples in the batch's order (the counts are the loader's host integers)."""
        crops, width = len(batch.global_crops), self.center.shape[1]
        classes, patches = [], [[] for _ in range(crops)]
        for chunk, output in zip(batch.split(len(outputs)), outputs, strict=True):
            rows = (crops + len(chunk.local_crops)) * len(chunk.indices)
            class_part = rows * (self.features + width)
            classes.append(output[:class_part].view(rows, self.features + width))
            counts = [sum(per_sample) for per_sample in chunk.masked]
            for crop, part in enumerate(output[class_part:].view(-1, width).split(counts)):
                patches[crop].append(part)
        return classes, torch.cat([part for crop in patches for part in crop])

    def before_optimizer_step(self, epoch: int, step: int) -> None:
        """DINO's frozen last layer, for iBOT's own head too (DINOv2 freezes both)."""
        super().before_optimizer_step(epoch, step)
        frozen = epoch < self.freeze_last_layer or step < self.freeze_last_layer_steps
        if frozen and self.model.ibot_head is not None:
            self.model.ibot_head.last_layer.grad = None

    def after_step(self, step: int) -> None:
        """DINO's updates, then the patch center's: the EMA of the mean teacher output over
        every rank's masked patches, left as it is by a step without any."""
        super().after_step(step)
        patches, self._teacher_patches = self._teacher_patches, None
        if self.center_formula == "sinkhorn":
            return
        with torch.no_grad():  # in the center's float32 (or float64), whatever autocast gave
            patches = patches.to(self.patch_center.dtype)
            summed = torch.cat([patches.sum(dim=0), patches.new_full((1,), len(patches))])
            if is_distributed():
                summed = collectives.all_reduce(summed)
            total, count = summed[:-1], summed[-1]
            momentum = self.center_momentum
            updated = momentum * self.patch_center + (1 - momentum) * total / count.clamp(min=1)
            self.patch_center.copy_(torch.where(count > 0, updated, self.patch_center))

    def state_dict(self) -> dict[str, torch.Tensor]:
        return super().state_dict() | {"patch_center": self.patch_center}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        state = dict(state)
        patch_center = state.pop("patch_center", None)
        if patch_center is None or patch_center.shape != self.patch_center.shape:
            raise TrainerError(
                f"the checkpoint has no iBOT patch center of shape "
                f"{tuple(self.patch_center.shape)} (--method dinov2, --dino-out-dim)"
            )
        super().load_state_dict(state)
        self.patch_center.copy_(patch_center)


#: DINOv2's centering of the teacher: the Sinkhorn-Knopp over the global batch.
CENTERING = "sinkhorn"


def defaults(config) -> dict[str, Any]:
    """DINO's, with DINOv2's KoLeo (0.1), Sinkhorn-Knopp centering and AdamW; on the
    digits DINO's recipe there but DINO's teacher temperature (0.04) and 45 epochs, where
    ``vit_micro`` learns (docs/methods.md)."""
    digits = config.digits
    return {
        **dino.defaults(config),
        "koleo_weight": 0.1,
        "dino_center": CENTERING,
        "optimizer": "adamw",
        **({"teacher_temperature": 0.04, "epochs": 45} if digits else {}),
    }


def check(config) -> None:
    dino.check(config, CENTERING)
    tower = scratch_tower(config)
    if tower is not None and tower.patch_size is None:
        vits = [name for name, row in IMAGE_TOWERS.items() if row.patch_size is not None]
        raise ConfigError(
            f"--method dinov2 masks the patches of a ViT: --model {', '.join(vits)}, "
            f"not {config.model}"
        )
    if config.mask_ratio_min > config.mask_ratio_max:
        raise ConfigError(
            f"--mask-ratio-min {config.mask_ratio_min} is above --mask-ratio-max "
            f"{config.mask_ratio_max}"
        )


#: What only DINOv2 reads.
DINOV2_OPTIONS = field_names(DINOv2Options)

DINOV2 = MethodRow(
    DINOv2Method,
    image_data,
    options=(*dino.DINO.options, *DINOV2_OPTIONS),
    sections=(DINOv2Options,),
    defaults=defaults,
    check=check,
    families=(Family("--method dinov2", EVERY_SOURCE, ("scratch", "transformers", "timm")),),
)
