"""DINO (Caron et al., 2021): a student and an EMA teacher with DINO's head, the
teacher's global crops centred and sharpened as the student's targets, multi-crop."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from contrastive_accelerate.config import ConfigError, field_names, is_set, option
from contrastive_accelerate.data import MultiCropBatch
from contrastive_accelerate.data.masks import PatchMasking
from contrastive_accelerate.data.sources import ImageData
from contrastive_accelerate.launch import TrainerError
from contrastive_accelerate.methods.base import (
    EVERY_SOURCE,
    IMAGE_METHOD_TOWERS,
    SIMCLR_HEAD,
    Family,
    MethodRow,
    Say,
    image_data,
    image_model,
    load_teacher,
    teacher_state,
)
from contrastive_accelerate.methods.momentum import TEACHER_OPTIONS, TeacherMethod, TeacherOptions
from contrastive_accelerate.methods.multicrop import (
    MULTICROP_OPTIONS,
    MultiCropOptions,
    check_crops,
    crop_defaults,
    crop_outputs,
    embed_crops,
    embed_multicrop,
    multicrop_dataset,
)
from losses import DINOLoss, KoLeoLoss
from losses.dino import CENTERINGS, batch_center
from losses.sinkhorn import sinkhorn_knopp
from models.dino import DINOModel
from models.momentum import EMATeacher, cosine_momentum


@dataclass
class DINOOptions:
    """What only DINO reads. Declared once here, each a ``--flag`` and a config-file key
    of ``TrainConfig`` (``contrastive_accelerate.options``), which holds this section."""

    dino_out_dim: int | None = option(
        None, "dino: outputs of DINO's head; none: 1024 (digits: 256)", at_least=1
    )
    center_momentum: float = option(
        0.9, "dino: EMA momentum of the teacher's center", resume="apply", at_least=0.0, at_most=1.0
    )
    teacher_temperature: float | None = option(
        None, "dino: teacher temperature after the warm-up; none: 0.04 (digits: 0.01)",
        resume="apply", above=0.0,
    )  # fmt: skip
    teacher_temperature_warmup_steps: int = option(
        0, "dino: steps of the teacher temperature's warm-up from 0.04", resume="apply", at_least=0
    )
    freeze_last_layer: int | None = option(
        None, "dino: epochs the head's last layer stays frozen; none: 1 (DINO's), 0 on a stream",
        resume="apply", at_least=0,
    )  # fmt: skip
    freeze_last_layer_steps: int = option(
        0, "dino: steps the head's last layer stays frozen (a stream has no epochs)",
        resume="apply", at_least=0,
    )  # fmt: skip
    koleo_weight: float | None = option(
        None, "dino: KoLeo on the student's global-crop features; none: 0 (dinov2: 0.1)",
        resume="apply", at_least=0.0,
    )  # fmt: skip
    dino_center: str | None = option(
        None, "dino: global, dino (sum / (rows x W)), sinkhorn; none: global (dinov2: sinkhorn)",
        choices=CENTERINGS,
    )  # fmt: skip


#: DINO's ``warmup_teacher_temp``.
DINO_WARMUP_TEACHER_TEMPERATURE = 0.04


class DINOMethod(TeacherMethod):
    """DINO: a student and an EMA teacher with DINO's head, multi-crop.

    The dataset is ``MultiCrop``; ``embed`` runs one forward per resolution (the global
    crops, then the local ones), and the teacher sees the global crops only, once per
    step. The center is the mean teacher output over the *global* batch
    (``losses.dino.batch_center``: sums and counts all-reduced), an EMA across steps
    updated after each step with the teacher, as DINO does; the teacher temperature
    warms up linearly from 0.04 to ``--teacher-temperature``. The teacher's weights and
    the center are the method's state.
    """

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
        self.seed, self.total_steps = config.seed, total_steps
        self.base_momentum, self.center_momentum = config.teacher_momentum, config.center_momentum
        self.eval_teacher = config.eval_teacher
        self.teacher_temperature = config.teacher_temperature
        self.warmup_steps = config.teacher_temperature_warmup_steps
        self.center_formula, self.gather = config.dino_center, config.gather
        self.freeze_last_layer = config.freeze_last_layer
        self.freeze_last_layer_steps = config.freeze_last_layer_steps
        _, hidden, bottleneck = SIMCLR_HEAD
        self.koleo_weight = config.koleo_weight
        self.model = image_model(
            config, world_size, say, self.model_class, projection_hidden_dim=hidden,
            projection_dim=bottleneck, dino_out_dim=config.dino_out_dim,
            other_size=config.local_crop_size if config.local_crops else None,
            class_features=config.koleo_weight > 0, **self.heads(config),
        )  # fmt: skip
        self.dataset = multicrop_dataset(config, data, self.patch_masking(config))
        # What precedes the logits in the model's outputs: its class features, or nothing.
        self.features = self.model.feature_dim if config.koleo_weight else 0
        self.koleo = KoLeoLoss(gather_distributed=config.gather)
        self.inputs = self.model.inputs
        self.teacher = EMATeacher(self.model).to(device)
        self.center = torch.zeros(1, config.dino_out_dim, dtype=self.teacher.dtype, device=device)
        self.criterion = DINOLoss(config.temperature, gather_distributed=config.gather)
        self._teacher_crops: tuple[list[torch.Tensor], Sequence[int] | None] | None = None

    #: The model of student and teacher; ``heads(config)``: its arguments besides DINO's.
    model_class: type[DINOModel] = DINOModel

    def heads(self, config) -> dict[str, Any]:
        return {}

    def patch_masking(self, config) -> PatchMasking | None:
        """How the loader masks the global crops' patches (``self.model``'s); None: it
        does not."""
        return None

    def embed(self, model: nn.Module, chunk: MultiCropBatch, step: int) -> torch.Tensor:
        return embed_multicrop(model, chunk, self.seed, step)

    def loss(
        self,
        outputs: list[torch.Tensor],
        batch: MultiCropBatch,
        sizes: Sequence[int] | None,
        step: int,
    ) -> torch.Tensor:
        with torch.no_grad():
            # Views 64 + crop: the teacher's dropout masks are not the student's.
            targets = embed_crops(
                self.teacher, batch.global_crops, batch.indices, self.seed, step, 64
            )
        return self.image_loss(crop_outputs(outputs, batch), targets, batch, sizes, step)

    def image_loss(
        self,
        student_crops: list[torch.Tensor],
        teacher_outputs: torch.Tensor,
        batch: MultiCropBatch,
        sizes: Sequence[int] | None,
        step: int,
    ) -> torch.Tensor:
        """DINO's loss and DINOv2's KoLeo, from the student's outputs of each crop and the
        teacher's of the global crops, crop-major (class features first where KoLeo
        reads them)."""
        crops = len(batch.global_crops)
        features, student = zip(
            *(crop.split([self.features, crop.shape[1] - self.features], dim=1)
              for crop in student_crops), strict=True,
        )  # fmt: skip
        targets = teacher_outputs[:, self.features :]
        loss = self.dino_loss(list(student), targets, crops, sizes, step)
        # DINOv2's KoLeo, summed over the global crops; a global batch of one sample has no
        # neighbour, and that step goes without it.
        if self.koleo_weight and (sizes is None or sum(sizes) > 1):
            koleo = sum(self.koleo(crop, sizes=sizes) for crop in features[:crops])
            loss = loss + self.koleo_weight * koleo
        return loss

    def dino_loss(
        self,
        student: list[torch.Tensor],
        targets: torch.Tensor,
        crops: int,
        sizes: Sequence[int] | None,
        step: int,
    ) -> torch.Tensor:
        """DINO's loss of the student's crops against the teacher's ``crops`` global ones,
        centred by the EMA center or by DINOv2's Sinkhorn-Knopp."""
        teacher, temperature = list(targets.unflatten(0, (crops, -1))), self.temperature_at(step)
        self._teacher_crops = (teacher, sizes)
        if self.center_formula == "sinkhorn":  # DINOv2's: every global crop's rows in one
            codes = sinkhorn_knopp(
                targets, temperature, sizes=None if sizes is None else
                [crops * size for size in sizes], gather_distributed=self.gather,
            )  # fmt: skip
            teacher = list(codes.unflatten(0, (crops, -1)))
            return self.criterion(student, teacher, temperature, None, sizes=sizes)
        return self.criterion(student, teacher, temperature, self.center, sizes=sizes)

    def temperature_at(self, step: int) -> float:
        """DINO's teacher temperature: linear from 0.04 over the warm-up, then constant."""
        if step >= self.warmup_steps:
            return self.teacher_temperature
        start = DINO_WARMUP_TEACHER_TEMPERATURE
        return start + (self.teacher_temperature - start) * step / self.warmup_steps

    def before_optimizer_step(self, epoch: int, step: int) -> None:
        """DINO's ``cancel_gradients_last_layer``: during the first ``--freeze-last-layer``
        epochs and ``--freeze-last-layer-steps`` steps the head's last layer has no
        gradient, so the optimizer leaves it and its momentum alone (a zero gradient
        would still apply weight decay and momentum)."""
        if epoch < self.freeze_last_layer or step < self.freeze_last_layer_steps:
            self.model.projection_head.last_layer.grad = None

    def after_step(self, step: int) -> None:
        """The teacher's EMA update, then the center's, from this step's teacher outputs."""
        momentum = cosine_momentum(step + 1, self.total_steps, self.base_momentum)
        self.teacher.update(self.model, momentum)
        teacher, sizes = self._teacher_crops
        if self.center_formula != "sinkhorn":  # the Sinkhorn-Knopp needs no center: it stays
            center = batch_center(teacher, sizes, formula=self.center_formula)
            self.center.mul_(self.center_momentum).add_(
                center.to(self.center.dtype), alpha=1 - self.center_momentum
            )
        self._teacher_crops = None

    def state_dict(self) -> dict[str, torch.Tensor]:
        return teacher_state(self.teacher) | {"center": self.center}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        rest = load_teacher(self.teacher, state, "dino")
        if set(rest) != {"center"} or rest["center"].shape != self.center.shape:
            raise TrainerError(
                f"the checkpoint has no DINO center of shape {tuple(self.center.shape)} "
                "(--dino-out-dim)"
            )
        self.center.copy_(rest["center"])


def defaults(config) -> dict[str, Any]:
    """DINO's temperatures and momentum, our 1024 outputs, six local crops of half the
    size (none for the mlp, which takes one input size); on the digits their own recipe
    (docs/methods.md), where DINO's collapses to uniform outputs within the budget: a
    sharper teacher (0.01) and a faster one (0.99), 256 outputs, no local crops (a 4-px
    crop of a digit is a few pixels of stroke) and 90 epochs, which fits twice SimCLR's
    time without the local crops' forwards."""
    digits = config.digits
    return {
        "koleo_weight": 0.0,
        "dino_center": "global",
        "temperature": 0.1,
        "teacher_momentum": 0.99 if digits else 0.996,
        "teacher_temperature": 0.01 if digits else 0.04,
        "dino_out_dim": 256 if digits else 1024,
        **crop_defaults(config),
        # A stream or a mixture has no epochs: its one pass would freeze the whole run.
        "freeze_last_layer": 0 if config.streaming or config.mixed else 1,
        **({"epochs": 90} if digits else {}),
    }


def check(config, default_center: str = "global") -> None:
    """DINO's refusals; ``default_center``: ``--dino-center`` left at None (DINOv2's)."""
    if config.freeze_last_layer and (config.streaming or config.mixed):
        raise ConfigError(
            "--freeze-last-layer counts epochs, which a stream or a mixture has not: "
            "--freeze-last-layer-steps counts steps"
        )
    center = config.dino_center or default_center
    if center == "sinkhorn" and is_set(config, "center_momentum"):
        raise ConfigError(
            "--center-momentum does not apply to --dino-center sinkhorn, which keeps no center"
        )
    check_crops(config)


#: What only DINO reads.
DINO_OPTIONS = field_names(DINOOptions)

DINO = MethodRow(
    DINOMethod,
    image_data,
    options=(*TEACHER_OPTIONS, *MULTICROP_OPTIONS, *DINO_OPTIONS, "temperature"),
    sections=(TeacherOptions, MultiCropOptions, DINOOptions),
    defaults=defaults,
    check=check,
    families=(Family("--method dino", EVERY_SOURCE, IMAGE_METHOD_TOWERS),),
)
