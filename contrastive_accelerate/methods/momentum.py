"""MoCo v3 (Chen et al., 2021) and BYOL (Grill et al., 2020): a student with a predictor
and an EMA teacher that gives each view's target."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from contrastive_accelerate.config import field_names, option
from contrastive_accelerate.data import TwoViewBatch
from contrastive_accelerate.data.sources import ImageData
from contrastive_accelerate.methods.base import (
    EVERY_SOURCE,
    IMAGE_METHOD_TOWERS,
    SIMCLR_HEAD,
    Family,
    Method,
    MethodRow,
    PastKeys,
    Say,
    embed_two_views,
    head_shape,
    image_data,
    image_model,
    load_teacher,
    shard_model,
    teacher_state,
    two_views_dataset,
    view_halves,
)
from losses import MoCoLoss, NegativeCosineSimilarityLoss
from models.momentum import EMATeacher, PredictorModel, cosine_momentum


@dataclass
class TeacherOptions:
    """What the methods with an EMA teacher read. Declared once here, each a ``--flag``
    and a config-file key of ``TrainConfig`` (``contrastive_accelerate.options``), which
    holds this section."""

    teacher_momentum: float | None = option(
        None, "moco, byol, dino: EMA momentum at step 0, cosine to 1; none: the method's",
        resume="apply", at_least=0.0, at_most=1.0,
    )  # fmt: skip
    eval_teacher: bool = option(
        False, "moco, byol, dino: evaluate the teacher's encoder, as the papers do", resume="free"
    )


@dataclass
class QueueOptions:
    """The queue of past keys (MoCo, SwAV; SimCLR with NT-Xent), a section of ``TrainConfig``."""

    queue_size: int = option(
        0, "moco, swav, simclr with ntxent: a queue of past keys; 0: none", at_least=0
    )
    queue_keys: str = option(
        "global", "per-rank: lightly's default, each rank queues its own keys",
        choices=("global", "per-rank"),
    )  # fmt: skip


#: What every method with an EMA teacher reads.
TEACHER_OPTIONS = field_names(TeacherOptions)
#: What the methods with a queue of past keys read.
QUEUE_OPTIONS = field_names(QueueOptions)


class TeacherMethod(Method):
    """A method with an EMA teacher (``self.teacher``), which ``--eval-teacher``
    evaluates instead of the student, as MoCo, BYOL and DINO report."""

    teacher: EMATeacher
    eval_teacher: bool = False

    def evaluated_encoder(self) -> nn.Module:
        return self.teacher.network if self.eval_teacher else self.model

    def shard(self, mixed_precision: str) -> None:
        """The student, and the teacher sharded like it: the EMA update is row-wise."""
        shard_model(self.model, mixed_precision)
        shard_model(self.teacher.network, mixed_precision, trained=False)


class MomentumMethod(TeacherMethod):
    """MoCo v3 or BYOL: a student with a predictor, and an EMA teacher
    (``models.momentum``) that gives each view's target.

    - ``moco``: ``2 t (MoCoLoss(q0, k1) + MoCoLoss(q1, k0))`` over the keys of the global
      batch, and with ``--queue-size`` MoCo v2's queue of past keys as extra negatives:
      the global batch's normalised keys of both views, pushed after each step.
    - ``byol``: ``(NegCos(p0, t1) + NegCos(p1, t0)) / 2``, lightly's form of BYOL.

    The teacher sees both views in one forward in training mode (its BatchNorm takes
    batch statistics, global with SyncBatchNorm), once per step, whatever the number of
    chunks; its dropout is keyed by views 2 and 3. After each optimizer step it moves
    towards the student with ``cosine_momentum(step + 1, ...)``, which is where MoCo v3
    and lightly update it: before the next step's keys. Its weights and the queue are
    the method's state: every checkpoint and ``final/method.safetensors`` carry them.
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
        self.name, self.seed, self.total_steps = config.method, config.seed, total_steps
        self.base_momentum, self.eval_teacher = config.teacher_momentum, config.eval_teacher
        self.dataset = two_views_dataset(config, data)
        self.model = image_model(
            config, world_size, say, PredictorModel, **head_shape(SIMCLR_HEAD),
            prediction_hidden_dim=SIMCLR_HEAD[1],
        )  # fmt: skip
        self.inputs = self.model.inputs
        self.teacher = EMATeacher(self.model, without=("predictor",)).to(device)
        if config.method == "moco":
            self.temperature = config.temperature
            self.criterion = MoCoLoss(
                config.temperature,
                gather_distributed=config.gather,
                tile_rows=config.loss_tile_rows,
            )
        else:
            self.criterion = NegativeCosineSimilarityLoss(gather_distributed=config.gather)
        self.past_keys = PastKeys(config, SIMCLR_HEAD[2], self.teacher.dtype, device)

    def embed(self, model: nn.Module, chunk: TwoViewBatch, step: int) -> torch.Tensor:
        """The student's predictions of one chunk's two views (``embed_two_views``)."""
        return embed_two_views(model, chunk, self.seed, step)

    def loss(
        self,
        outputs: list[torch.Tensor],
        batch: TwoViewBatch,
        sizes: Sequence[int] | None,
        step: int,
    ) -> torch.Tensor:
        p0, p1 = view_halves(outputs)
        with torch.no_grad():
            targets = embed_two_views(self.teacher, batch, self.seed, step, views=(2, 3))
        t0, t1 = targets[: len(targets) // 2], targets[len(targets) // 2 :]
        if self.name == "byol":
            return 0.5 * (self.criterion(p0, t1, sizes=sizes) + self.criterion(p1, t0, sizes=sizes))
        k0, k1 = F.normalize(t0, dim=1), F.normalize(t1, dim=1)
        queue = None
        if self.past_keys.queue is not None:
            queue = self.past_keys.queue.keys()
            # Both views' keys in one gather after the step (``after_step``).
            self.past_keys.hold(torch.cat([k0, k1], dim=1), sizes)
        loss = self.criterion(p0, k1, queue, sizes=sizes) + self.criterion(
            p1, k0, queue, sizes=sizes
        )
        return 2 * self.temperature * loss

    def after_step(self, step: int) -> None:
        """The teacher's EMA update, and this step's keys into the queue."""
        self.teacher.update(
            self.model, cosine_momentum(step + 1, self.total_steps, self.base_momentum)
        )
        self.past_keys.push()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return teacher_state(self.teacher) | self.past_keys.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.past_keys.load_state_dict(load_teacher(self.teacher, state, self.name))


def momentum_defaults(paper_momentum: float, **paper: Any) -> Callable[[Any], dict[str, Any]]:
    """A momentum method's defaults row: the paper's values; on the digits the recipe
    measured there (docs/methods.md), a faster teacher, SGD at 0.1 and 75 epochs. The
    papers' momentum is set for hundreds of epochs: within SimCLR's budget on the digits
    BYOL's encoder ended below its random init and MoCo's less than 3 kNN points above."""

    def defaults(config) -> dict[str, Any]:
        if not config.digits:
            return {**paper, "teacher_momentum": paper_momentum}
        sgd = {"lr": 0.1} if config.optimizer in (None, "sgd") else {}
        return {**paper, "teacher_momentum": 0.95, "epochs": 75, **sgd}

    return defaults


MOCO = MethodRow(
    MomentumMethod,
    image_data,
    options=(*TEACHER_OPTIONS, *QUEUE_OPTIONS, "temperature"),
    sections=(TeacherOptions, QueueOptions),
    defaults=momentum_defaults(0.99, temperature=0.2),  # MoCo v3's
    families=(Family("--method moco", EVERY_SOURCE, IMAGE_METHOD_TOWERS),),
)
BYOL = MethodRow(
    MomentumMethod,
    image_data,
    options=TEACHER_OPTIONS,
    sections=(TeacherOptions,),
    defaults=momentum_defaults(0.996),
    families=(Family("--method byol", EVERY_SOURCE, IMAGE_METHOD_TOWERS),),
)
