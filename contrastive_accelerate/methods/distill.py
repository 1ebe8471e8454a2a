"""Distillation from a frozen pretrained teacher into a trained student (lightly-train's
``distillation``; Hinton et al., 2015, on features): the usual way to a small
deployable backbone from a large one, on the user's own images."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from contrastive_accelerate.config import ConfigError, field_names, option
from contrastive_accelerate.data import MultiCropBatch
from contrastive_accelerate.data.sources import ImageData
from contrastive_accelerate.durable_files import content_digest
from contrastive_accelerate.launch import TrainerError
from contrastive_accelerate.methods.base import (
    DTYPES,
    EVERY_SOURCE,
    IMAGE_METHOD_TOWERS,
    Family,
    Method,
    MethodRow,
    Say,
    image_data,
    image_model,
)
from contrastive_accelerate.methods.multicrop import (
    MULTICROP_OPTIONS,
    MultiCropOptions,
    check_crops,
    crop_defaults,
    crop_outputs,
    embed_multicrop,
    multicrop_dataset,
)
from losses.distillation import DISTANCES, DistillationLoss
from models.distill import DistillStudent
from models.frozen_tower import FrozenTowerError, load_frozen_tower
from models.towers import scratch_tower


@dataclass
class DistillOptions:
    """What only distillation reads, a section of ``TrainConfig``
    (``contrastive_accelerate.options``)."""

    distill_teacher: str | None = option(
        None, "distill: the frozen teacher, a final/ of ours, a timm or transformers folder"
    )
    distill_loss: str = option(
        "cosine", "distill: 1 - cosine, or l2 (mean squared error, lightly-train v2's)",
        choices=DISTANCES,
    )  # fmt: skip


class DistillMethod(Method):
    """A frozen teacher (``models.frozen_tower``: eval mode, no gradient, not sharded)
    and a student (``--model``, ``--image-model`` or ``--timm-model`` under a linear
    projection to the teacher's width, ``models.distill.DistillStudent``), each crop of
    each image through both; ``DistillationLoss`` between them over the global batch.
    The teacher holds no state across steps: a resume loads it again from its folder and
    refuses another (its digest is one of the run's ``inputs``). ``final/`` is the
    student, and the kNN and the linear probe evaluate its encoder."""

    def __init__(
        self,
        config,
        data: ImageData,
        world_size: int,
        say: Say,
        *,
        total_steps: int,
        device: torch.device | str = "cpu",
    ):
        self.seed = config.seed
        try:
            teacher = load_frozen_tower(
                config.distill_teacher, DTYPES[config.dtype], "--distill-teacher"
            )
        except FrozenTowerError as error:
            raise TrainerError(str(error)) from None
        self.teacher = teacher.tower.to(device)
        sizes = [(config.image_size, "--image-size")]
        sizes += [(config.local_crop_size, "--local-crop-size")] if config.local_crops else []
        for size, named in sizes:
            probe_teacher(self.teacher, size, named, config.distill_teacher)
        self.dataset = multicrop_dataset(config, data)
        self.model = image_model(
            config, world_size, say, DistillStudent, teacher_dim=teacher.width,
            other_size=config.local_crop_size if config.local_crops else None,
        )  # fmt: skip
        digest = content_digest(self.teacher.state_dict(), teacher.config)
        self.inputs = {**self.model.inputs, "distill_teacher": {"weights": digest}}
        self.criterion = DistillationLoss(config.distill_loss, gather_distributed=config.gather)

    def embed(self, model: nn.Module, chunk: MultiCropBatch, step: int) -> torch.Tensor:
        return embed_multicrop(model, chunk, self.seed, step)

    def loss(
        self,
        outputs: list[torch.Tensor],
        batch: MultiCropBatch,
        sizes: Sequence[int] | None,
        step: int,
    ) -> torch.Tensor:
        student = crop_outputs(outputs, batch)
        with torch.no_grad():
            targets = embed_multicrop(self.teacher, batch, self.seed, step)
        teacher = targets.unflatten(0, (len(student), -1))
        losses = [self.criterion(s, t, sizes=sizes) for s, t in zip(student, teacher, strict=True)]
        return sum(losses) / len(losses)


def probe_teacher(teacher: nn.Module, size: int, named: str, path: str) -> None:
    """Two black crops of ``size`` through the teacher: one it cannot embed is one line
    here, not an error inside the first step."""
    parameter = next(teacher.parameters())
    images = torch.zeros(2, 3, size, size, dtype=parameter.dtype, device=parameter.device)
    try:
        with torch.no_grad():
            teacher(images)
    except (AssertionError, IndexError, RuntimeError, ValueError) as error:  # timm asserts
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0][:160]
        raise TrainerError(
            f"{named} {size}: --distill-teacher {path!r} cannot embed it ({first_line})"
        ) from None


def check(config) -> None:
    if not config.distill_teacher:
        raise ConfigError("--method distill needs --distill-teacher, the frozen teacher's folder")
    check_crops(config)


def defaults(config) -> dict[str, Any]:
    """Each crop through teacher and student: no local crops unless asked for, of
    multi-crop's size when they are. A ViT student from scratch trains with AdamW, as
    ViTs do (DeiT, DINO): on the digits SGD left ``vit_micro`` at its random init (kNN
    54.4% and 50.3% from 51.7% and 51.1%, seeds 0 and 1), AdamW took it to 74% in 400
    steps; and for 90 epochs there, as DINO's recipe, where 45 stopped it at 90% (seed 0:
    a 135-epoch schedule passed 95.8% at step 1200 and 98.1% at step 1800)."""
    tower = scratch_tower(config)
    vit = tower is not None and tower.patch_size is not None
    vit_defaults = {"optimizer": "adamw", **({"epochs": 90} if config.digits else {})}
    return {**crop_defaults(config), "local_crops": 0, **(vit_defaults if vit else {})}


#: What only distillation reads.
DISTILL_OPTIONS = field_names(DistillOptions)

DISTILL = MethodRow(
    DistillMethod,
    image_data,
    options=(*MULTICROP_OPTIONS, *DISTILL_OPTIONS),
    sections=(MultiCropOptions, DistillOptions),
    defaults=defaults,
    check=check,
    families=(Family("--method distill", EVERY_SOURCE, IMAGE_METHOD_TOWERS),),
)
