"""Training methods: what the loop needs to know of one, and the SimCLR family.

The loop (``trainer.py``) knows nothing of towers, views or losses. A method is an
object with these members, and the loop calls nothing else of it:

- ``model``: every trained module (towers, heads, a learnable scale), built from the
  options; the loop prepares it with the optimizer (DDP).
- ``dataset``: dataset rows as items, keyed by ``(epoch, index)``; ``dataset.collate``
  makes the batch, whose ``split(k)`` gives the chunks of gradient caching and whose
  ``unreadable`` lists the images that could not be decoded.
- ``embed(model, chunk, step)``: one chunk as embeddings. It is the forward that
  ``cached_backward`` replays, so its randomness must be keyed by sample.
- ``loss(outputs, batch, sizes)``: this rank's share of the loss of the global batch, from
  the embeddings of all of this rank's chunks; ``sizes`` is every rank's number of samples
  when the loop knows it (the losses then exchange nothing: ``losses.inputs``), else None.
- ``after_step(step)``: called after each optimizer step (an EMA teacher's update).
- ``state_dict()`` / ``load_state_dict(state)``: tensors that persist across steps besides
  the model and the optimizer (a queue of past keys, a running center, a teacher's
  weights), saved with every checkpoint. They must be the same on every rank, which
  is what makes them resumable on another number of processes.

How the next methods plug in, without a change to the loop:

- Image-text or text-text pairs: a dataset whose items are a row's columns (an image
  and a tokenized caption, or an anchor, a positive and hard negatives), an ``embed``
  that runs each column through its own tower, and a two-tower loss (InfoNCE, SigLIP,
  multiple-negatives ranking) whose positives sit at their global index.
- Momentum teachers (MoCo, BYOL, DINO): the teacher lives outside ``model``, in float32;
  ``after_step`` moves it towards the student with a momentum that is a function of the
  step, and ``state_dict`` carries it with the queue or the center. Multi-crop is a
  dataset that returns several crops per sample, batched per resolution, and an
  ``embed`` that gives the teacher the global crops only.

The SimCLR family is one method: two augmented views of each image through one
encoder, scored by one of ``LOSSES``. Adding a loss to it is one row of that table,
its option fields on ``TrainConfig``, and its tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from contrastive_accelerate.data import TwoViewBatch, TwoViews, label_ids
from contrastive_accelerate.data.sources import ImageData
from contrastive_accelerate.grad_cache import has_batch_statistics
from contrastive_accelerate.launch import TrainerError
from losses import (
    BarlowTwinsLoss,
    DCLLoss,
    DCLWLoss,
    InfoNCELoss,
    NTXentLoss,
    SigLIPLoss,
    SupConLoss,
    VICRegLoss,
)
from models import (
    SimCLR,
    convert_sample_dropout,
    convert_sync_batchnorm,
    sample_keys,
    sample_randomness,
)

DTYPES = {"float32": torch.float32, "float64": torch.float64}


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


def _common(config) -> dict[str, Any]:
    return {"gather_distributed": config.gather}


def _tiles(config) -> dict[str, Any]:
    return {**_common(config), "tile_rows": config.loss_tile_rows}


SIMCLR_HEAD = (2, 512, 128)
#: The papers' 3-layer 8192-wide projectors, scaled down for small data.
REDUNDANCY_HEAD = (3, 1024, 1024)
# Barlow Twins and VICReg: their papers' LARS at 0.2 (measured on the digits, 4 epochs:
# kNN 92.2%, where SGD at lr 1e-4..3e-3 fell to 42-83%).
PAPERS_LARS = {"optimizer": "lars"}

LOSSES: dict[str, LossRow] = {
    "ntxent": LossRow(
        SIMCLR_HEAD, ("temperature",), lambda c: NTXentLoss(c.temperature, **_tiles(c)), _two_views
    ),
    "dcl": LossRow(
        SIMCLR_HEAD, ("temperature",), lambda c: DCLLoss(c.temperature, **_tiles(c)), _two_views
    ),
    "dclw": LossRow(
        SIMCLR_HEAD,
        ("temperature", "dclw_sigma"),
        lambda c: DCLWLoss(c.temperature, sigma=c.dclw_sigma, **_tiles(c)),
        _two_views,
    ),
    "supcon": LossRow(
        SIMCLR_HEAD,
        ("temperature", "supcon_rescale"),
        lambda c: SupConLoss(c.temperature, rescale=c.supcon_rescale, **_tiles(c)),
        _with_labels,
        labels=True,
    ),
    "infonce": LossRow(
        SIMCLR_HEAD,
        ("logit_scale_init",),
        lambda c: InfoNCELoss(**_tiles(c)),
        _clip_style,
        defaults={"logit_scale_init": 1 / 0.07},  # CLIP's
    ),
    "siglip": LossRow(
        SIMCLR_HEAD,
        ("logit_scale_init", "logit_bias_init"),
        lambda c: SigLIPLoss(tile_columns=c.loss_tile_rows, **_common(c)),
        _clip_style,
        defaults={"logit_scale_init": 10.0},  # SigLIP's
    ),
    "barlowtwins": LossRow(
        REDUNDANCY_HEAD,
        ("barlow_lambda",),
        lambda c: BarlowTwinsLoss(c.barlow_lambda, **_common(c)),
        _two_views,
        defaults=PAPERS_LARS,
    ),
    "vicreg": LossRow(
        REDUNDANCY_HEAD,
        ("vicreg_lambda", "vicreg_mu", "vicreg_nu"),
        lambda c: VICRegLoss(c.vicreg_lambda, c.vicreg_mu, c.vicreg_nu, **_common(c)),
        _two_views,
        defaults=PAPERS_LARS,
    ),
}


class SimCLRMethod:
    """Two augmented views of each image through one encoder and head, scored by
    ``LOSSES[config.loss]`` over the global batch (SimCLR: Chen et al., 2020).

    ``config`` is the run's resolved options (``TrainConfig.resolved()``); build it
    after seeding, so that every rank starts from the same weights. ``say`` prints
    notices once (``accelerator.print``).

    Example::

        method = SimCLRMethod(TrainConfig(model="mlp").resolved(), load_image_dataset(), 1, print)
        batch = method.dataset.collate([method.dataset[(0, index)] for index in range(8)])
        loss = method.loss([method.embed(method.model, batch, step=0)], batch, sizes=None)
    """

    def __init__(self, config, data: ImageData, world_size: int, say: Callable[[str], Any]):
        row = LOSSES[config.loss]
        self.seed, self.dtype = config.seed, DTYPES[config.dtype]
        self.dataset = TwoViews(
            data.train,
            data.image_column,
            config.image_size,
            config.seed,
            config.augment,
            per_sample_seed=config.augmentation_seeding == "per-sample",
            crop_min_scale=config.crop_min_scale,
        )
        layers, hidden, width = row.head
        model = SimCLR(
            backbone=config.model,
            image_size=config.image_size,
            projection_layers=layers,
            projection_hidden_dim=hidden,
            projection_dim=width,
            logit_scale=config.logit_scale_init if "logit_scale_init" in row.options else None,
            logit_bias=config.logit_bias_init if "logit_bias_init" in row.options else None,
            dropout=config.dropout,
        ).to(self.dtype)
        if world_size > 1 and config.sync_batchnorm:
            model = convert_sync_batchnorm(model)
        chunks = config.accumulation_chunks
        if config.dropout and config.dropout_masks == "per-sample":
            model = convert_sample_dropout(model)  # masks keyed by sample: see embed
        elif config.dropout and (world_size > 1 or chunks > 1):
            say(
                "warning: --dropout-masks per-process draws masks from each process's RNG: "
                "training is not world-size invariant, and the chunks' recompute draws new masks"
            )
        if chunks > 1 and has_batch_statistics(model):
            say(
                f"warning: with --accumulation-chunks {chunks} BatchNorm normalises each chunk "
                "with that chunk's statistics: the gradient is not that of the whole batch in "
                "one pass (a BatchNorm-free model, e.g. vit_tiny or mlp, makes it exact)"
            )
        self.model = model
        self.row, self.criterion = row, row.make(config)
        self.labels = None
        if row.labels:
            if data.label_column is None:
                raise TrainerError(
                    f"--loss {config.loss} needs labels, and the dataset has no label column "
                    "(label, labels, fine_label); pass --label-column"
                )
            self.labels = label_ids(data.train, data.label_column)

    def embed(self, model: nn.Module, chunk: TwoViewBatch, step: int) -> torch.Tensor:
        """The projections of one chunk's two views, in one forward (BatchNorm sees them
        together, as in SimCLR); dropout keyed by each sample's dataset index."""
        device = next(model.parameters()).device
        # Each view goes to the device as it comes from the loader (pinned on CUDA, so the
        # copies are asynchronous), then they are joined there: a join on the host would copy
        # them into unpinned memory first, whose upload makes the host wait.
        views = (chunk.view0, chunk.view1)
        images = torch.cat([view.to(device, self.dtype, non_blocking=True) for view in views])
        keys = torch.cat([sample_keys(self.seed, step, chunk.indices, view) for view in (0, 1)])
        # A few hundred int64s from unpinned memory: staged by the driver, no wait either.
        with sample_randomness(keys.to(device, non_blocking=True)):
            return model(images)

    def loss(
        self, outputs: list[torch.Tensor], batch: TwoViewBatch, sizes: list[int] | None
    ) -> torch.Tensor:
        """The loss of this rank's whole share, from every chunk's ``embed`` output."""
        z0 = torch.cat([output[: len(output) // 2] for output in outputs])
        z1 = torch.cat([output[len(output) // 2 :] for output in outputs])
        labels = None if self.labels is None else self.labels[batch.indices].to(z0.device)
        return self.row.call(self.criterion, self.model, z0, z1, labels, sizes)

    def after_step(self, step: int) -> None:
        """Nothing: SimCLR has no teacher."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if state:
            raise TrainerError(
                f"the checkpoint carries method state ({', '.join(sorted(state))}) that "
                "--method simclr does not have"
            )
