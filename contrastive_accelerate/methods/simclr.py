"""The SimCLR family: two augmented views of each image through one encoder and head,
scored by one of ``LOSSES`` over the global batch (Chen et al., 2020).

Adding a loss to it is one row of ``methods.loss_table.LOSSES`` (its checklist is
there) and its name in ``SIMCLR_FAMILY.losses``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from contrastive_accelerate.config import ConfigError
from contrastive_accelerate.data import TwoViewBatch, label_ids
from contrastive_accelerate.data.sources import ImageData
from contrastive_accelerate.launch import TrainerError
from contrastive_accelerate.methods.base import (
    DTYPES,
    EVERY_SOURCE,
    IMAGE_METHOD_TOWERS,
    Family,
    Method,
    MethodRow,
    PastKeys,
    Say,
    embed_two_views,
    head_shape,
    image_data,
    image_model,
    two_views_dataset,
    view_halves,
)
from contrastive_accelerate.methods.loss_table import LOSSES, LossRow, options_of, tiled
from contrastive_accelerate.methods.momentum import QUEUE_OPTIONS, QueueOptions
from losses import MoCoLoss
from models import SimCLR

#: SimCLR's family: two views on any source, from scratch, and the losses it takes (the
#: first its default).
SIMCLR_FAMILY = Family(
    "--method simclr",
    sources=EVERY_SOURCE,
    towers=IMAGE_METHOD_TOWERS,
    losses=("ntxent", "dcl", "dclw", "supcon", "infonce", "siglip", "barlowtwins", "vicreg"),
)
#: The rows of its losses.
SIMCLR_LOSSES: dict[str, LossRow] = {name: LOSSES[name] for name in SIMCLR_FAMILY.losses}


class SimCLRMethod(Method):
    """Two augmented views of each image through one encoder and head, scored by
    ``LOSSES[config.loss]`` (``methods.loss_table``) over the global batch (SimCLR: Chen
    et al., 2020).

    With ``--queue-size`` (NT-Xent only) the negatives are a queue of past second-view
    embeddings instead of the batch, as lightly's ``NTXentLoss(memory_bank_size=...)``:
    ``MoCoLoss(temperature, batch_negatives=False)(z0, z1, queue)``, the queue a global
    FIFO of the normalised ``z1`` of every step (``models.momentum.KeyQueue``).

    Example::

        method = SimCLRMethod(TrainConfig(model="mlp").resolved(), load_image_dataset(), 1, print)
        batch = method.dataset.collate([method.dataset[(0, index)] for index in range(8)])
        loss = method.loss([method.embed(method.model, batch, 0)], batch, sizes=None, step=0)
    """

    def __init__(
        self,
        config,
        data: ImageData,
        world_size: int,
        say: Say,
        *,
        total_steps: int | None = None,
        device: torch.device | str = "cpu",
    ):
        row = LOSSES[config.loss]
        self.seed = config.seed
        self.dataset = two_views_dataset(config, data)
        self.model = image_model(
            config,
            world_size,
            say,
            SimCLR,
            **head_shape(row.head),
            logit_scale=config.logit_scale_init if "logit_scale_init" in row.options else None,
            logit_bias=config.logit_bias_init if "logit_bias_init" in row.options else None,
        )
        self.inputs = self.model.inputs
        self.row, self.criterion = row, row.make(config)
        self.past_keys = PastKeys(config, row.head[2], DTYPES[config.dtype], device)
        if self.past_keys.queue is not None:
            self.criterion = MoCoLoss(config.temperature, batch_negatives=False, **tiled(config))
        self.labels = label_ids(data.train, data.label_column) if row.labels else None

    def embed(self, model: nn.Module, chunk: TwoViewBatch, step: int) -> torch.Tensor:
        """The projections of one chunk's two views (``embed_two_views``)."""
        return embed_two_views(model, chunk, self.seed, step)

    def loss(
        self,
        outputs: list[torch.Tensor],
        batch: TwoViewBatch,
        sizes: Sequence[int] | None,
        step: int,
    ) -> torch.Tensor:
        z0, z1 = view_halves(outputs)
        if self.past_keys.queue is not None:
            self.past_keys.hold(F.normalize(z1.detach(), dim=1), sizes)
            return self.criterion(z0, z1, self.past_keys.queue.keys(), sizes=sizes)
        labels = None if self.labels is None else self.labels[batch.indices].to(z0.device)
        return self.row.call(self.criterion, self.model, [z0, z1], labels, sizes)

    def after_step(self, step: int) -> None:
        """This step's second views into the queue, if there is one."""
        self.past_keys.push()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.past_keys.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.past_keys.load_state_dict(state)


def defaults(config) -> dict[str, Any]:
    """NT-Xent unless ``--loss`` says otherwise, and that loss's own defaults."""
    loss = config.loss or SIMCLR_FAMILY.losses[0]
    temperature = {"temperature": 0.5} if "temperature" in LOSSES[loss].options else {}
    return {"loss": loss, **temperature, **LOSSES[loss].defaults}


#: The options of its losses: each reads its own (``LossRow.options``).
SIMCLR_LOSS_OPTIONS = options_of(SIMCLR_FAMILY.losses)


def reads(config) -> tuple[str, ...]:
    """The queue's options, and those of the loss (its row's; with a loss that is not
    the family's, all of them: ``check`` refuses it)."""
    row = SIMCLR_LOSSES.get(config.loss or SIMCLR_FAMILY.losses[0])
    return ("loss", *QUEUE_OPTIONS, *(row.options if row else SIMCLR_LOSS_OPTIONS))


def check(config) -> None:
    if config.loss is not None and config.loss not in SIMCLR_FAMILY.losses:
        raise ConfigError(f"--loss {config.loss} does not apply to --method simclr")
    if config.queue_size and config.loss not in (None, "ntxent"):
        raise ConfigError(f"--queue-size applies to --loss ntxent, not {config.loss}")


def check_data(config, data: ImageData) -> None:
    if LOSSES[config.loss].labels and (config.streaming or config.mixed):
        raise TrainerError(
            f"--loss {config.loss} needs labels, which a stream or a mixture does not read yet"
        )
    if LOSSES[config.loss].labels and data.label_column is None:
        raise TrainerError(
            f"--loss {config.loss} needs labels, and the dataset has no label column "
            "(label, labels, fine_label); pass --label-column"
        )


SIMCLR = MethodRow(
    SimCLRMethod,
    image_data,
    options=("loss", *QUEUE_OPTIONS, *SIMCLR_LOSS_OPTIONS),
    sections=(QueueOptions,),
    reads=reads,
    defaults=defaults,
    check=check,
    check_data=check_data,
    families=(SIMCLR_FAMILY,),
)
