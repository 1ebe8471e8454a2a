"""The SimCLR family: two augmented views of each image through one encoder and head,
scored by one of ``LOSSES`` over the global batch (Chen et al., 2020).

Adding a loss to it is one row of ``LOSSES``, its option fields on ``TrainConfig``
(``contrastive_accelerate.options``) and its tests.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
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
    INITIAL_LOGIT_SCALE,
    SIMCLR_HEAD,
    Family,
    Method,
    MethodRow,
    Say,
    embed_two_views,
    image_data,
    image_model,
    load_queue,
    push_batch_keys,
    two_views_dataset,
    view_halves,
)
from losses import (
    BarlowTwinsLoss,
    DCLLoss,
    DCLWLoss,
    InfoNCELoss,
    MoCoLoss,
    NTXentLoss,
    SigLIPLoss,
    SupConLoss,
    VICRegLoss,
)
from models.momentum import KeyQueue


@dataclass(frozen=True)
class LossRow:
    """One ``--loss`` of the SimCLR family."""

    #: Projection head: layers, hidden width, output width.
    head: tuple[int, int, int]
    #: The options it reads (besides --loss-tile-rows and the --no-gather control).
    options: tuple[str, ...]
    #: The criterion, from the run's options.
    make: Callable[[Any], nn.Module]
    #: How it is called: ``call(criterion, model, z0, z1, labels, sizes)``.
    call: Callable[..., torch.Tensor]
    #: Its own defaults for options left at None, where they differ from the shared ones.
    defaults: dict[str, Any] = field(default_factory=dict)
    #: Whether it needs the dataset's labels.
    labels: bool = False


def _two_views(criterion, model, z0, z1, labels, sizes):
    return criterion(z0, z1, sizes=sizes)


def _with_labels(criterion, model, z0, z1, labels, sizes):
    return criterion(z0, z1, labels, sizes=sizes)


def _clip_style(criterion, model, z0, z1, labels, sizes):
    """Normalised features and the model's learnable scale (and bias), as in open_clip."""
    features0, features1 = F.normalize(z0, dim=1), F.normalize(z1, dim=1)
    scale = model.log_logit_scale.exp()
    if isinstance(criterion, SigLIPLoss):
        return criterion(features0, features1, scale, model.logit_bias, sizes=sizes)
    return criterion(features0, features1, scale, sizes=sizes)


def shared(config) -> dict[str, Any]:
    """The keywords every loss takes from the options: the --no-gather control."""
    return {"gather_distributed": config.gather}


def tiled(config) -> dict[str, Any]:
    """``shared``, and the rows a tiled loss computes at a time."""
    return {**shared(config), "tile_rows": config.loss_tile_rows}


#: The papers' 3-layer 8192-wide projectors, scaled down for small data.
REDUNDANCY_HEAD = (3, 1024, 1024)
# Barlow Twins and VICReg: their papers' LARS at 0.2 (measured on the digits, 4 epochs:
# kNN 92.2%, where SGD at lr 1e-4..3e-3 fell to 42-83%).
PAPERS_LARS = {"optimizer": "lars"}

LOSSES: dict[str, LossRow] = {
    "ntxent": LossRow(
        SIMCLR_HEAD, ("temperature",), lambda c: NTXentLoss(c.temperature, **tiled(c)), _two_views
    ),
    "dcl": LossRow(
        SIMCLR_HEAD, ("temperature",), lambda c: DCLLoss(c.temperature, **tiled(c)), _two_views
    ),
    "dclw": LossRow(
        SIMCLR_HEAD,
        ("temperature", "dclw_sigma"),
        lambda c: DCLWLoss(c.temperature, sigma=c.dclw_sigma, **tiled(c)),
        _two_views,
    ),
    "supcon": LossRow(
        SIMCLR_HEAD,
        ("temperature", "supcon_rescale"),
        lambda c: SupConLoss(c.temperature, rescale=c.supcon_rescale, **tiled(c)),
        _with_labels,
        labels=True,
    ),
    "infonce": LossRow(
        SIMCLR_HEAD,
        ("logit_scale_init",),
        lambda c: InfoNCELoss(**tiled(c)),
        _clip_style,
        defaults={"logit_scale_init": INITIAL_LOGIT_SCALE["infonce"]},
    ),
    "siglip": LossRow(
        SIMCLR_HEAD,
        ("logit_scale_init", "logit_bias_init"),
        lambda c: SigLIPLoss(tile_columns=c.loss_tile_rows, **shared(c)),
        _clip_style,
        defaults={"logit_scale_init": INITIAL_LOGIT_SCALE["siglip"]},
    ),
    "barlowtwins": LossRow(
        REDUNDANCY_HEAD,
        ("barlow_lambda",),
        lambda c: BarlowTwinsLoss(c.barlow_lambda, **shared(c)),
        _two_views,
        defaults=PAPERS_LARS,
    ),
    "vicreg": LossRow(
        REDUNDANCY_HEAD,
        ("vicreg_lambda", "vicreg_mu", "vicreg_nu"),
        lambda c: VICRegLoss(c.vicreg_lambda, c.vicreg_mu, c.vicreg_nu, **shared(c)),
        _two_views,
        defaults=PAPERS_LARS,
    ),
}


class SimCLRMethod(Method):
    """Two augmented views of each image through one encoder and head, scored by
    ``LOSSES[config.loss]`` over the global batch (SimCLR: Chen et al., 2020).

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
            row.head,
            logit_scale=config.logit_scale_init if "logit_scale_init" in row.options else None,
            logit_bias=config.logit_bias_init if "logit_bias_init" in row.options else None,
        )
        self.row, self.criterion = row, row.make(config)
        self.queue = None
        if config.queue_size:
            self.queue = KeyQueue(config.queue_size, row.head[2], DTYPES[config.dtype], device)
            self.criterion = MoCoLoss(config.temperature, batch_negatives=False, **tiled(config))
        self.global_queue = config.queue_keys == "global"
        self._new_keys: tuple[torch.Tensor, Sequence[int] | None] | None = None
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
        if self.queue is not None:
            self._new_keys = (F.normalize(z1.detach(), dim=1), sizes)
            return self.criterion(z0, z1, self.queue.keys(), sizes=sizes)
        labels = None if self.labels is None else self.labels[batch.indices].to(z0.device)
        return self.row.call(self.criterion, self.model, z0, z1, labels, sizes)

    def after_step(self, step: int) -> None:
        """This step's second views into the queue, if there is one."""
        if self._new_keys is not None:
            push_batch_keys(self.queue, *self._new_keys, global_keys=self.global_queue)
            self._new_keys = None

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.queue.state_dict() if self.queue is not None else {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        load_queue(self.queue, state)


def defaults(config) -> dict[str, Any]:
    """NT-Xent unless ``--loss`` says otherwise, and that loss's own defaults."""
    loss = config.loss or "ntxent"
    temperature = {"temperature": 0.5} if "temperature" in LOSSES[loss].options else {}
    return {"loss": loss, **temperature, **LOSSES[loss].defaults}


#: The options of the losses: each reads its own (``LossRow.options``).
LOSS_OPTIONS = tuple(dict.fromkeys(name for row in LOSSES.values() for name in row.options))


def reads(config) -> tuple[str, ...]:
    """The queue's options, and those of the loss (its row's; with a loss that is not
    the family's, all of them: ``check`` refuses it)."""
    row = LOSSES.get(config.loss or "ntxent")
    return ("loss", "queue_size", "queue_keys", *(row.options if row else LOSS_OPTIONS))


def check(config) -> None:
    if config.loss is not None and config.loss not in LOSSES:
        raise ConfigError(f"--loss {config.loss} does not apply to --method simclr")
    if config.queue_size and config.loss not in (None, "ntxent"):
        raise ConfigError(f"--queue-size applies to --loss ntxent, not {config.loss}")


def check_data(config, data: ImageData) -> None:
    if LOSSES[config.loss].labels and data.label_column is None:
        raise TrainerError(
            f"--loss {config.loss} needs labels, and the dataset has no label column "
            "(label, labels, fine_label); pass --label-column"
        )


SIMCLR = MethodRow(
    SimCLRMethod,
    image_data,
    options=("loss", "queue_size", "queue_keys", *LOSS_OPTIONS),
    reads=reads,
    defaults=defaults,
    check=check,
    check_data=check_data,
    families=(Family("--method simclr"),),
)
