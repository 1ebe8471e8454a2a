"""Training methods: what the loop needs to know of one; SimCLR, MoCo, BYOL, DINO, text pairs.

The loop (``trainer.py``) knows nothing of towers, views or losses. A method is an
object with these members, and the loop calls nothing else of it:

- ``model``: every trained module (towers, heads, a learnable scale), built from the
  options; the loop prepares it with the optimizer (DDP).
- ``dataset``: dataset rows as items, keyed by ``(epoch, index)``; ``dataset.collate``
  makes the batch, whose ``split(k)`` gives the chunks of gradient caching and whose
  ``unreadable`` lists the images that could not be decoded.
- ``embed(model, chunk, step)``: one chunk as embeddings. It is the forward that
  ``cached_backward`` replays, so its randomness must be keyed by sample.
- ``loss(outputs, batch, sizes, step)``: this rank's share of the loss of the global
  batch, from the embeddings of all of this rank's chunks; called once per step.
  ``sizes`` is every rank's number of samples when the loop knows it (the losses then
  exchange nothing: ``losses.inputs``), else None.
- ``before_optimizer_step(epoch)``: called between the backward and the optimizer step
  (DINO's last layer, frozen during the first epochs, loses its gradient there).
- ``after_step(step)``: called after each optimizer step (an EMA teacher's update).
- ``evaluate(knn)``: the method's own figures at the end, beside the loop's kNN and
  linear probe (image-text's zero-shot accuracy), from the held-out images ``knn``.
- ``state_dict()`` / ``load_state_dict(state)``: tensors that persist across steps besides
  the model and the optimizer (a queue of past keys, a running center, a teacher's
  weights), saved with every checkpoint and the final model. They must be the same on
  every rank, which is what makes them resumable on another number of processes.

``METHODS`` has one row per ``--method``: how it is built, its own defaults, and the
options only some methods read (set for another method, they are refused).

Pairs (``--columns``) are the two last rows' shape: a dataset whose items are a row's
columns (texts, or an image and a caption), an ``embed`` that runs each column through
its tower in one forward, and a two-tower loss whose positives sit at their global index.

The SimCLR family is one method: two augmented views of each image through one
encoder, scored by one of ``LOSSES``. Adding a loss to it is one row of that table,
its option fields on ``TrainConfig``, and its tests.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from contrastive_accelerate import collectives
from contrastive_accelerate.collectives import is_distributed
from contrastive_accelerate.config import flag
from contrastive_accelerate.data import (
    MultiCrop,
    MultiCropBatch,
    TwoViewBatch,
    TwoViews,
    evaluation_images,
    label_ids,
)
from contrastive_accelerate.data.pairs import (
    ImageCaptions,
    ImageTextBatch,
    PairBatch,
    PairData,
    TextColumns,
    count_truncated,
    load_pair_dataset,
)
from contrastive_accelerate.data.sources import ImageData, load_image_dataset
from contrastive_accelerate.grad_cache import has_batch_statistics
from contrastive_accelerate.knn import KnnData, zero_shot_top1
from contrastive_accelerate.launch import TrainerError
from contrastive_accelerate.retrieval import paired_retrieval
from losses import (
    BarlowTwinsLoss,
    DCLLoss,
    DCLWLoss,
    DINOLoss,
    InfoNCELoss,
    MoCoLoss,
    MultipleNegativesRankingLoss,
    NegativeCosineSimilarityLoss,
    NTXentLoss,
    SigLIPLoss,
    SupConLoss,
    VICRegLoss,
)
from losses.dino import batch_center
from models import (
    SimCLR,
    convert_sample_dropout,
    convert_sync_batchnorm,
    sample_keys,
    sample_randomness,
)
from models.momentum import EMATeacher, KeyQueue, cosine_momentum

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


def two_views_dataset(config, data: ImageData) -> TwoViews:
    """Two augmented views of each image, drawn from (seed, epoch, index, view)."""
    return TwoViews(
        data.train,
        data.image_column,
        config.image_size,
        config.seed,
        config.augment,
        per_sample_seed=config.augmentation_seeding == "per-sample",
        crop_min_scale=config.crop_min_scale,
        horizontal_flip=config.horizontal_flip,
    )


def image_model(
    config, world_size: int, say: Callable[[str], Any], head: tuple[int, int, int], **heads
) -> SimCLR:
    """The encoder and its head (``heads``: a learnable scale, a predictor), with global
    BatchNorm statistics and dropout keyed by sample where the options ask for them."""
    layers, hidden, width = head
    model = SimCLR(
        backbone=config.model,
        image_size=config.image_size,
        projection_layers=layers,
        projection_hidden_dim=hidden,
        projection_dim=width,
        dropout=config.dropout,
        drop_path=config.drop_path,
        **heads,
    ).to(DTYPES[config.dtype])
    if world_size > 1 and config.sync_batchnorm:
        model = convert_sync_batchnorm(model)
    chunks = config.accumulation_chunks
    random = config.dropout or config.drop_path
    if random and config.dropout_masks == "per-sample":
        model = convert_sample_dropout(model)  # masks keyed by sample: see embed_two_views
    elif random and (world_size > 1 or chunks > 1):
        say(
            "warning: --dropout-masks per-process draws dropout and drop-path masks from each "
            "process's RNG: training is not world-size invariant, and the chunks' recompute "
            "draws new masks"
        )
    if chunks > 1 and has_batch_statistics(model):
        say(
            f"warning: with --accumulation-chunks {chunks} BatchNorm normalises each chunk "
            "with that chunk's statistics: the gradient is not that of the whole batch in "
            "one pass (a BatchNorm-free model, e.g. vit_tiny or mlp, makes it exact)"
        )
    return model


def embed_two_views(
    model: nn.Module, chunk: TwoViewBatch, seed: int, step: int, views: tuple[int, int] = (0, 1)
) -> torch.Tensor:
    """Both views of a chunk in one forward (BatchNorm sees them together, as in SimCLR),
    view 0's rows first; dropout keyed by (seed, step, each sample's index, ``views``)."""
    parameter = next(model.parameters())
    # Each view goes to the device as it comes from the loader (pinned on CUDA, so the
    # copies are asynchronous), then they are joined there: a join on the host would copy
    # them into unpinned memory first, whose upload makes the host wait.
    images = torch.cat(
        [
            view.to(parameter.device, parameter.dtype, non_blocking=True)
            for view in (chunk.view0, chunk.view1)
        ]
    )
    keys = torch.cat([sample_keys(seed, step, chunk.indices, view) for view in views])
    # A few hundred int64s from unpinned memory: staged by the driver, no wait either.
    with sample_randomness(keys.to(parameter.device, non_blocking=True)):
        return model(images)


def _view_halves(outputs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every chunk's view-0 rows, then every chunk's view-1 rows."""
    if len(outputs) == 1:  # no copy
        return outputs[0].tensor_split(2)
    z0 = torch.cat([output[: len(output) // 2] for output in outputs])
    z1 = torch.cat([output[len(output) // 2 :] for output in outputs])
    return z0, z1


class SimCLRMethod:
    """Two augmented views of each image through one encoder and head, scored by
    ``LOSSES[config.loss]`` over the global batch (SimCLR: Chen et al., 2020).

    With ``--queue-size`` (NT-Xent only) the negatives are a queue of past second-view
    embeddings instead of the batch, as lightly's ``NTXentLoss(memory_bank_size=...)``:
    ``MoCoLoss(temperature, batch_negatives=False)(z0, z1, queue)``, the queue a global
    FIFO of the normalised ``z1`` of every step (``models.momentum.KeyQueue``).

    ``config`` is the run's resolved options (``TrainConfig.resolved()``); build it
    after seeding, so that every rank starts from the same weights. ``say`` prints
    notices once (``accelerator.print``).

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
        say: Callable[[str], Any],
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
            self.criterion = MoCoLoss(config.temperature, batch_negatives=False, **_tiles(config))
        self.global_queue = config.queue_keys == "global"
        self._new_keys: tuple[torch.Tensor, list[int] | None] | None = None
        self.labels = None
        if row.labels:
            if data.label_column is None:
                raise TrainerError(
                    f"--loss {config.loss} needs labels, and the dataset has no label column "
                    "(label, labels, fine_label); pass --label-column"
                )
            self.labels = label_ids(data.train, data.label_column)

    def embed(self, model: nn.Module, chunk: TwoViewBatch, step: int) -> torch.Tensor:
        """The projections of one chunk's two views (``embed_two_views``)."""
        return embed_two_views(model, chunk, self.seed, step)

    def loss(
        self,
        outputs: list[torch.Tensor],
        batch: TwoViewBatch,
        sizes: list[int] | None,
        step: int,
    ) -> torch.Tensor:
        """The loss of this rank's whole share, from every chunk's ``embed`` output."""
        z0, z1 = _view_halves(outputs)
        if self.queue is not None:
            self._new_keys = (F.normalize(z1.detach(), dim=1), sizes)
            return self.criterion(z0, z1, self.queue.keys(), sizes=sizes)
        labels = None if self.labels is None else self.labels[batch.indices].to(z0.device)
        return self.row.call(self.criterion, self.model, z0, z1, labels, sizes)

    def before_optimizer_step(self, epoch: int) -> None:
        """Nothing: every parameter takes its gradient."""

    def after_step(self, step: int) -> None:
        """This step's second views into the queue, if there is one; SimCLR has no teacher."""
        if self._new_keys is not None:
            push_batch_keys(self.queue, *self._new_keys, global_keys=self.global_queue)
            self._new_keys = None

    def evaluate(self, knn: KnnData) -> dict[str, float]:
        """Nothing besides the loop's kNN and linear probe."""
        return {}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.queue.state_dict() if self.queue is not None else {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        load_queue(self.queue, state)


def push_batch_keys(
    queue: KeyQueue, keys: torch.Tensor, sizes: list[int] | None, *, global_keys: bool = True
) -> None:
    """A step's keys into ``queue``: ``keys`` are this rank's rows, each row the keys of
    its views side by side; gathered into the global batch (unless ``global_keys`` is
    off: the per-rank control), then queued view by view in global sample order."""
    if global_keys and is_distributed():
        keys = collectives.gather(keys, sizes=sizes)
    views = keys.shape[1] // queue.buffer.shape[1]
    queue.push(torch.cat(keys.chunk(views, dim=1)))


def load_queue(queue: KeyQueue | None, state: dict[str, torch.Tensor]) -> None:
    """Load a checkpoint's queue, refusing one this run has no room for, and the reverse."""
    if set(state) - {"queue"}:
        raise TrainerError(
            f"the checkpoint carries method state ({', '.join(sorted(set(state) - {'queue'}))}) "
            "that this run's --method does not have"
        )
    if (queue is None) != ("queue" not in state):
        has = "has a queue" if "queue" in state else "has no queue"
        size = queue.size if queue is not None else 0
        raise TrainerError(f"the checkpoint {has}, and this run's --queue-size is {size}")
    if queue is not None:
        queue.load_state_dict(state)


class MomentumMethod:
    """MoCo v3 (Chen et al., 2021) or BYOL (Grill et al., 2020): a student with a
    predictor, and an EMA teacher (``models.momentum``) that gives each view's target.

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
        say: Callable[[str], Any],
        *,
        total_steps: int,
        device: torch.device | str = "cpu",
    ):
        self.name, self.seed, self.total_steps = config.method, config.seed, total_steps
        self.base_momentum = config.teacher_momentum
        self.dataset = two_views_dataset(config, data)
        self.model = image_model(
            config, world_size, say, SIMCLR_HEAD, prediction_hidden_dim=SIMCLR_HEAD[1]
        )
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
        self.queue = (
            KeyQueue(config.queue_size, SIMCLR_HEAD[2], self.teacher.dtype, device)
            if config.queue_size
            else None
        )
        self.global_queue = config.queue_keys == "global"
        self._new_keys: tuple[torch.Tensor, list[int] | None] | None = None

    def embed(self, model: nn.Module, chunk: TwoViewBatch, step: int) -> torch.Tensor:
        """The student's predictions of one chunk's two views (``embed_two_views``)."""
        return embed_two_views(model, chunk, self.seed, step)

    def loss(
        self,
        outputs: list[torch.Tensor],
        batch: TwoViewBatch,
        sizes: list[int] | None,
        step: int,
    ) -> torch.Tensor:
        p0, p1 = _view_halves(outputs)
        with torch.no_grad():
            targets = embed_two_views(self.teacher, batch, self.seed, step, views=(2, 3))
        t0, t1 = targets[: len(targets) // 2], targets[len(targets) // 2 :]
        if self.name == "byol":
            return 0.5 * (self.criterion(p0, t1, sizes=sizes) + self.criterion(p1, t0, sizes=sizes))
        k0, k1 = F.normalize(t0, dim=1), F.normalize(t1, dim=1)
        queue = None
        if self.queue is not None:
            queue = self.queue.keys()
            # Both views' keys in one gather after the step (``after_step``).
            self._new_keys = (torch.cat([k0, k1], dim=1), sizes)
        loss = self.criterion(p0, k1, queue, sizes=sizes) + self.criterion(
            p1, k0, queue, sizes=sizes
        )
        return 2 * self.temperature * loss

    def before_optimizer_step(self, epoch: int) -> None:
        """Nothing: every parameter takes its gradient."""

    def after_step(self, step: int) -> None:
        """The teacher's EMA update, and this step's keys into the queue."""
        self.teacher.update(
            self.model, cosine_momentum(step + 1, self.total_steps, self.base_momentum)
        )
        if self._new_keys is not None:
            push_batch_keys(self.queue, *self._new_keys, global_keys=self.global_queue)
            self._new_keys = None

    def evaluate(self, knn: KnnData) -> dict[str, float]:
        """Nothing besides the loop's kNN and linear probe."""
        return {}

    def state_dict(self) -> dict[str, torch.Tensor]:
        queue = self.queue.state_dict() if self.queue is not None else {}
        return teacher_state(self.teacher) | queue

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        load_queue(self.queue, load_teacher(self.teacher, state, self.name))


def teacher_state(teacher: EMATeacher) -> dict[str, torch.Tensor]:
    """The teacher's weights and buffers, under ``teacher.``."""
    return {f"teacher.{name}": value for name, value in teacher.network.state_dict().items()}


def load_teacher(teacher: EMATeacher, state: dict[str, torch.Tensor], method: str) -> dict:
    """Load ``teacher_state``'s entries of ``state``; returns the other entries."""
    prefix = "teacher."
    weights = {name[len(prefix) :]: v for name, v in state.items() if name.startswith(prefix)}
    if set(weights) != set(teacher.network.state_dict()):
        problem = (
            "has no teacher weights" if not weights else "has teacher weights that do not match"
        )
        raise TrainerError(f"the checkpoint {problem} for this run's --method {method} and model")
    teacher.network.load_state_dict(weights)
    return {name: v for name, v in state.items() if not name.startswith(prefix)}


class DINOMethod:
    """DINO (Caron et al., 2021): a student and an EMA teacher with DINO's head, the
    teacher's global crops centred and sharpened as the student's targets, multi-crop.

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
        say: Callable[[str], Any],
        *,
        total_steps: int,
        device: torch.device | str = "cpu",
    ):
        self.seed, self.total_steps = config.seed, total_steps
        self.base_momentum, self.center_momentum = config.teacher_momentum, config.center_momentum
        self.teacher_temperature = config.teacher_temperature
        self.warmup_steps = config.teacher_temperature_warmup_steps
        self.center_formula = config.dino_center
        self.freeze_last_layer = config.freeze_last_layer
        self.dataset = MultiCrop(
            data.train,
            data.image_column,
            config.image_size,
            config.seed,
            config.global_crops,
            config.local_crops,
            config.local_crop_size,
            per_sample_seed=config.augmentation_seeding == "per-sample",
            crop_min_scale=config.crop_min_scale,
            horizontal_flip=config.horizontal_flip,
        )
        self.model = image_model(
            config, world_size, say, SIMCLR_HEAD, dino_out_dim=config.dino_out_dim
        )
        self.teacher = EMATeacher(self.model).to(device)
        self.center = torch.zeros(1, config.dino_out_dim, dtype=self.teacher.dtype, device=device)
        self.criterion = DINOLoss(config.temperature, gather_distributed=config.gather)
        self._teacher_crops: tuple[list[torch.Tensor], list[int] | None] | None = None

    def embed(self, model: nn.Module, chunk: MultiCropBatch, step: int) -> torch.Tensor:
        """Every crop of one chunk, crop by crop: one forward per resolution."""
        first_local = len(chunk.global_crops)
        return torch.cat(
            [
                embed_crops(model, crops, chunk.indices, self.seed, step, first_view)
                for crops, first_view in ((chunk.global_crops, 0), (chunk.local_crops, first_local))
                if len(crops)
            ]
        )

    def loss(
        self,
        outputs: list[torch.Tensor],
        batch: MultiCropBatch,
        sizes: list[int] | None,
        step: int,
    ) -> torch.Tensor:
        crops = len(batch.global_crops) + len(batch.local_crops)
        per_crop = [output.unflatten(0, (crops, len(output) // crops)) for output in outputs]
        student = [torch.cat([output[crop] for output in per_crop]) for crop in range(crops)]
        with torch.no_grad():
            # Views 64 + crop: the teacher's dropout masks are not the student's.
            targets = embed_crops(
                self.teacher, batch.global_crops, batch.indices, self.seed, step, 64
            )
        teacher = list(targets.unflatten(0, (len(batch.global_crops), -1)))
        self._teacher_crops = (teacher, sizes)
        return self.criterion(student, teacher, self.temperature_at(step), self.center, sizes=sizes)

    def temperature_at(self, step: int) -> float:
        """DINO's teacher temperature: linear from 0.04 over the warm-up, then constant."""
        if step >= self.warmup_steps:
            return self.teacher_temperature
        start = DINO_WARMUP_TEACHER_TEMPERATURE
        return start + (self.teacher_temperature - start) * step / self.warmup_steps

    def before_optimizer_step(self, epoch: int) -> None:
        """DINO's ``cancel_gradients_last_layer``: during the first ``--freeze-last-layer``
        epochs the head's last layer has no gradient, so the optimizer leaves it and its
        momentum alone (a zero gradient would still apply weight decay and momentum)."""
        if epoch < self.freeze_last_layer:
            self.model.projection_head.last_layer.grad = None

    def after_step(self, step: int) -> None:
        """The teacher's EMA update, then the center's, from this step's teacher outputs."""
        momentum = cosine_momentum(step + 1, self.total_steps, self.base_momentum)
        self.teacher.update(self.model, momentum)
        teacher, sizes = self._teacher_crops
        center = batch_center(teacher, sizes, formula=self.center_formula).to(self.center.dtype)
        self.center.mul_(self.center_momentum).add_(center, alpha=1 - self.center_momentum)
        self._teacher_crops = None

    def evaluate(self, knn: KnnData) -> dict[str, float]:
        """Nothing besides the loop's kNN and linear probe."""
        return {}

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


#: DINO's ``warmup_teacher_temp``.
DINO_WARMUP_TEACHER_TEMPERATURE = 0.04


def embed_crops(
    model: nn.Module,
    crops: torch.Tensor,
    indices: torch.Tensor,
    seed: int,
    step: int,
    first_view: int,
) -> torch.Tensor:
    """``(crops, n, C, H, W)`` of one resolution in one forward, crop-major rows;
    dropout keyed by (seed, step, each sample's index, ``first_view`` + crop)."""
    parameter = next(model.parameters())
    images = crops.to(parameter.device, parameter.dtype, non_blocking=True).flatten(0, 1)
    views = range(first_view, first_view + len(crops))
    keys = torch.cat([sample_keys(seed, step, indices, view) for view in views])
    with sample_randomness(keys.to(parameter.device, non_blocking=True)):
        return model(images)


class TextPairsMethod:
    """Text-text pairs, sentence-transformers' convention (``--columns anchor,positive[,
    negative...]``): each column through a ``transformers`` tower (one shared, or with
    ``--two-towers`` one for the anchors and one for the rest), scored by
    ``MultipleNegativesRankingLoss`` over the global batch, every hard negative of
    every rank a candidate.

    Tokenization happens in the loader's workers; each rank pads to its own longest
    text, and the attention masks keep that out of the result. Dropout inside the towers
    is keyed by (seed, step, row index, column); dropout that a kernel draws (attention
    dropout under SDPA) cannot be, and is switched off with a notice
    (``models.text.switch_off_kernel_dropout``).
    """

    def __init__(
        self,
        config,
        data: PairData,
        world_size: int,
        say: Callable[[str], Any],
        *,
        total_steps: int | None = None,
        device: torch.device | str = "cpu",
    ):
        from models.text import TextPairModel, TextTower

        if (config.loss or "mnrl") != "mnrl":
            raise TrainerError(f"--loss {config.loss}: text pairs train with mnrl")
        refuse_image_options(config)
        self.seed = config.seed
        dtype = DTYPES[config.dtype]
        encoder, tokenizer = text_encoder(config, data, data.columns)
        tower = TextTower(
            encoder,
            config.text_pooling,
            config.projection_dim or None,
            use_attention_mask=config.attention_mask,
        ).to(dtype)
        towers = [text_dropout(tower, tokenizer, config, world_size, say)]
        if config.two_towers:  # the query and document towers start as one
            towers.append(copy.deepcopy(towers[0]))
        tokenizers = [tokenizer] * len(towers)
        self.model = TextPairModel(towers, tokenizers, max_length=config.max_length)
        say_truncated(data, data.columns, tokenizer, config.max_length, say)
        self.dataset = TextColumns(
            data.train, data.columns, tokenizers[0], config.max_length, config.seed
        )
        self.evaluation, self.columns = data.evaluation, data.columns
        self.tokenizer, self.max_length = tokenizers[0], config.max_length
        self.criterion = MultipleNegativesRankingLoss(
            config.mnrl_scale,
            symmetric=config.mnrl_symmetric,
            gather_distributed=config.gather,
            tile_rows=config.loss_tile_rows,
        )

    def embed(self, model: nn.Module, chunk: PairBatch, step: int) -> torch.Tensor:
        """Every column of one chunk, column after column; column c's dropout keyed by
        (seed, step, row index, c)."""
        device = next(model.parameters()).device
        columns = [
            (ids.to(device, non_blocking=True), mask.to(device, non_blocking=True))
            for ids, mask in chunk.columns
        ]
        keys = [
            sample_keys(self.seed, step, chunk.indices, column).to(device, non_blocking=True)
            for column in range(len(columns))
        ]
        return model(columns, keys)

    def loss(
        self,
        outputs: list[torch.Tensor],
        batch: PairBatch,
        sizes: list[int] | None,
        step: int,
    ) -> torch.Tensor:
        count = len(batch.columns)
        per_chunk = [output.unflatten(0, (count, -1)) for output in outputs]
        columns = [torch.cat([output[column] for output in per_chunk]) for column in range(count)]
        return self.criterion(*columns, sizes=sizes)

    def before_optimizer_step(self, epoch: int) -> None:
        """Nothing: every parameter takes its gradient."""

    def after_step(self, step: int) -> None:
        """Nothing: no teacher, no queue."""

    def evaluate(self, knn: KnnData | None) -> dict[str, float]:
        """Retrieval on the held-out pairs: each anchor's positive among all of theirs
        (``retrieval_mrr@10``, ``retrieval_recall@k``), sharded across ranks."""
        if self.evaluation is None:
            return {}
        anchors, positives = (first_texts(self.evaluation[c]) for c in self.columns[:2])
        model, device = self.model, next(self.model.parameters()).device
        model.eval()
        try:
            with torch.no_grad():
                figures = paired_retrieval(
                    lambda rows: embed_texts(model.tower(0), self.tokenizer,
                                             [anchors[i] for i in rows], self.max_length),
                    lambda rows: embed_texts(model.tower(1), self.tokenizer,
                                             [positives[i] for i in rows], self.max_length),
                    len(anchors), device,
                )  # fmt: skip
        finally:
            model.train()
        return {f"retrieval_{name}": value for name, value in figures.items()}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        load_queue(None, state)


#: The ``--loss`` of ``--method pairs``: text-text pairs take mnrl, image-text ones
#: infonce (CLIP) or siglip (``ImageTextMethod``).
PAIR_LOSSES = ("mnrl", "infonce", "siglip")


class ImageTextMethod:
    """Image-text pairs, CLIP's or SigLIP's two towers (``--columns image,caption``): the
    image through ``--model`` and its projection head, the caption (one of a row's list,
    drawn from (seed, epoch, index)) through a ``transformers`` tower and a projection,
    scored by ``InfoNCELoss`` (``--loss infonce``, CLIP, the default) or ``SigLIPLoss``
    over the global batch with the model's learnable scale, which ``after_step`` clamps
    at 100 as CLIP does, and SigLIP's bias.

    With ``--zero-shot-template`` ("a photo of a {}") and labels, ``evaluate`` gives CLIP's
    zero-shot top-1 on the held-out images: each class name in the template, embedded
    by the text tower, is a classifier row.
    """

    def __init__(
        self,
        config,
        data: PairData,
        world_size: int,
        say: Callable[[str], Any],
        *,
        total_steps: int | None = None,
        device: torch.device | str = "cpu",
    ):
        from models.text import ImageTextModel, TextTower

        self.seed, self.loss_name = config.seed, config.loss or "infonce"
        if self.loss_name not in ("infonce", "siglip"):
            raise TrainerError(
                f"--loss {self.loss_name}: image-text pairs train with infonce or siglip"
            )
        (caption_column,) = data.text_columns
        encoder, self.tokenizer = text_encoder(config, data, [caption_column])
        width = config.projection_dim or SIMCLR_HEAD[2]
        image = image_model(config, world_size, say, (*SIMCLR_HEAD[:2], width))
        text = TextTower(  # in the run's dtype already for text_dropout's probe forward
            encoder, config.text_pooling, width, use_attention_mask=config.attention_mask
        ).to(DTYPES[config.dtype])
        siglip = self.loss_name == "siglip"
        scale = config.logit_scale_init or (10.0 if siglip else 1 / 0.07)  # SigLIP's, CLIP's
        self.model = ImageTextModel(
            image,
            text_dropout(text, self.tokenizer, config, world_size, say),
            self.tokenizer,
            logit_scale=scale,
            logit_bias=config.logit_bias_init if siglip else None,
            max_length=config.max_length,
        ).to(DTYPES[config.dtype])
        say_truncated(data, [caption_column], self.tokenizer, config.max_length, say)
        self.dataset = ImageCaptions(
            data.train,
            data.image_column,
            caption_column,
            self.tokenizer,
            config.max_length,
            config.image_size,
            config.seed,
            config.augment,
            per_sample_seed=config.augmentation_seeding == "per-sample",
            crop_min_scale=config.crop_min_scale,
            horizontal_flip=config.horizontal_flip,
        )
        tiles = _tiles(config)
        self.criterion = (
            SigLIPLoss(tile_columns=tiles.pop("tile_rows"), **tiles)
            if siglip
            else InfoNCELoss(**tiles)
        )
        self.template = config.zero_shot_template
        self.class_names = class_names(data) if self.template else None
        self.evaluation, self.caption_column = data.evaluation, caption_column
        self.image_column, self.image_size = data.image_column, config.image_size

    def embed(self, model: nn.Module, chunk: ImageTextBatch, step: int) -> torch.Tensor:
        """The images' projections, then the captions'; dropout keyed by (seed, step, row
        index, 0) in the image tower and (..., 1) in the text tower."""
        parameter = next(model.parameters())
        device = parameter.device
        images = chunk.images.to(device, parameter.dtype, non_blocking=True)
        columns = [(ids.to(device, non_blocking=True), mask.to(device, non_blocking=True))
                   for ids, mask in chunk.columns]  # fmt: skip
        keys = tuple(
            sample_keys(self.seed, step, chunk.indices, view).to(device) for view in (0, 1)
        )
        return model(images, columns, keys)

    def loss(
        self,
        outputs: list[torch.Tensor],
        batch: ImageTextBatch,
        sizes: list[int] | None,
        step: int,
    ) -> torch.Tensor:
        images, texts = _view_halves(outputs)
        images, texts = F.normalize(images, dim=1), F.normalize(texts, dim=1)
        scale = self.model.log_logit_scale.exp()
        if self.loss_name == "siglip":
            return self.criterion(images, texts, scale, self.model.logit_bias, sizes=sizes)
        return self.criterion(images, texts, scale, sizes=sizes)

    def before_optimizer_step(self, epoch: int) -> None:
        """Nothing: every parameter takes its gradient."""

    def after_step(self, step: int) -> None:
        """CLIP's clamp of the learnable scale at 100, in place, the same on every rank."""
        with torch.no_grad():
            self.model.log_logit_scale.clamp_(max=math.log(MAX_LOGIT_SCALE))

    def evaluate(self, knn: KnnData | None) -> dict[str, float]:
        """On the held-out images: retrieval in both directions (each image's caption among
        all of theirs, and the reverse: ``image_to_text_recall@k``, ``text_to_image_...``),
        and CLIP's zero-shot top-1 with ``--zero-shot-template``."""
        if self.evaluation is None:
            return {}
        model = self.model
        parameter = next(model.parameters())
        captions = first_texts(self.evaluation[self.caption_column])

        def images(rows):
            pixels, _ = evaluation_images(self.evaluation, self.image_column, self.image_size,
                                          indices=list(rows))  # fmt: skip
            return model.image(pixels.to(parameter.device, parameter.dtype))

        def texts(rows):
            return embed_texts(model.text, self.tokenizer, [captions[i] for i in rows],
                               model.max_length)  # fmt: skip

        figures = {}
        model.eval()
        try:
            with torch.no_grad():
                for name, (queries, documents) in {
                    "image_to_text": (images, texts), "text_to_image": (texts, images)
                }.items():  # fmt: skip
                    found = paired_retrieval(queries, documents, len(captions), parameter.device)
                    figures |= {f"{name}_{k}": v for k, v in found.items() if k != "mrr@10"}
                if self.template is not None and knn is not None:
                    prompts = [self.template.format(name) for name in self.class_names]
                    classes = embed_texts(model.text, self.tokenizer, prompts, model.max_length)
                    figures["zero_shot_top1"] = zero_shot_top1(
                        ImageProjections(model.image), classes, knn
                    )
        finally:
            model.train()
        return figures

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        load_queue(None, state)


#: CLIP clamps its learnable logit scale at 100.
MAX_LOGIT_SCALE = 100.0


class ImageProjections(nn.Module):
    """An image tower's projections as ``embed``, for the zero-shot classifier."""

    def __init__(self, image: nn.Module) -> None:
        super().__init__()
        self.image = image

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        return self.image(images)


def class_names(data: PairData) -> list[str]:
    """The label column's class names in ``knn_data``'s label order (sorted labels): a
    ``ClassLabel``'s names, else each label as a string."""
    if data.label_column is None or data.evaluation is None:
        raise TrainerError(
            "--zero-shot-template needs labels and held-out images: a label column (or "
            "--label-column), --knn-k > 0, and an evaluation split or --eval-holdout"
        )
    labels = sorted(set(data.train[data.label_column]) | set(data.evaluation[data.label_column]))
    names = getattr(data.train.features[data.label_column], "names", None)
    return [names[label] if names else str(label) for label in labels]


def text_encoder(config, data: PairData, columns):
    """``--text-model``'s encoder and tokenizer, or with ``scratch`` a small BERT and a
    vocabulary of ``columns``' texts."""
    from models.text import SCRATCH, load_text_encoder, scratch_text_encoder

    if config.text_model is None:
        raise TrainerError(
            "--columns needs --text-model: a transformers model directory, a hub name, or "
            "scratch (a small BERT from random weights)"
        )
    if config.text_model == SCRATCH:
        texts = [text for column in columns for value in data.train[column]
                 for text in ([value] if isinstance(value, str) else value)]  # fmt: skip
        return scratch_text_encoder(texts, config.max_length, DTYPES[config.dtype])
    return load_text_encoder(config.text_model, DTYPES[config.dtype])


def pairs_method(config, data: PairData, world_size: int, say, **kwargs):
    """Text-text (``TextPairsMethod``) or image-text (``ImageTextMethod``) pairs, as
    ``data``'s columns are."""
    if data.image_column is not None:
        return ImageTextMethod(config, data, world_size, say, **kwargs)
    return TextPairsMethod(config, data, world_size, say, **kwargs)


#: What text-text pairs never read (no image tower, no labels to probe): set, refused.
IMAGE_OPTIONS = (
    "model",
    "image_size",
    "augment",
    "crop_min_scale",
    "horizontal_flip",
    "skip_bad_images",
    "augmentation_seeding",
    "dropout",
    "drop_path",
    "sync_batchnorm",
    "logit_scale_init",
    "logit_bias_init",
    "zero_shot_template",
    "linear_probe",
)


def refuse_image_options(config) -> None:
    """``TrainerError`` for the first of ``IMAGE_OPTIONS`` set away from its default: only
    the data tell text pairs from image-text, so the config cannot refuse it itself."""
    defaults = type(config)(dataset=config.dataset, columns=config.columns).resolved()
    for name in IMAGE_OPTIONS:
        if getattr(config, name) != getattr(defaults, name):
            raise TrainerError(
                f"{flag(name)} does not apply to text pairs: --columns {config.columns} "
                "names no image"
            )


def first_texts(values: list) -> list[str]:
    """Each row's text, or the first of its list: evaluation takes no draw."""
    return [value if isinstance(value, str) else value[0] for value in values]


def embed_texts(tower: nn.Module, tokenizer, texts: list[str], max_length: int) -> torch.Tensor:
    """``texts`` through ``tower``, padded to their longest and truncated to ``max_length``."""
    tokens = tokenizer(texts, padding=True, truncation=True, max_length=max_length,
                       return_tensors="pt")  # fmt: skip
    device = next(tower.parameters()).device
    return tower(tokens["input_ids"].to(device), tokens["attention_mask"].to(device))


def say_truncated(data: PairData, columns, tokenizer, max_length: int, say) -> None:
    """One notice for the texts that ``max_length`` truncates, counted once at start-up by
    the main process, the one that prints it."""
    if is_distributed() and torch.distributed.get_rank() != 0:
        return
    truncated, total = count_truncated(
        [value for column in columns for value in data.train[column]], tokenizer, max_length
    )
    if truncated:
        say(
            f"notice: {truncated} of {total} texts are longer than --max-length {max_length} "
            "tokens and are truncated"
        )


def text_dropout(tower: nn.Module, tokenizer, config, world_size: int, say) -> nn.Module:
    """The tower's own dropout keyed by sample (``--dropout-masks per-sample``), and the
    dropout no key reaches switched off; or, the control, torch's per-process masks."""
    from models.text import switch_off_kernel_dropout

    if config.dropout_masks == "per-sample":
        tower = convert_sample_dropout(tower)
        probe = tokenizer(["probe"], return_tensors="pt")
        switch_off_kernel_dropout(tower, (probe["input_ids"], probe["attention_mask"]), say)
    elif world_size > 1 or config.accumulation_chunks > 1:
        say(
            "warning: --dropout-masks per-process draws the text tower's dropout masks from "
            "each process's RNG: training is not world-size invariant"
        )
    return tower


def image_data(config) -> ImageData:
    """The images of ``--dataset`` (``load_image_dataset``), with the evaluation split."""
    return load_image_dataset(
        config.dataset,
        config_name=config.dataset_config,
        split=config.split,
        image_column=config.image_column,
        label_column=config.label_column,
        eval_split=config.eval_split,
        eval_holdout=config.eval_holdout,
        evaluate=config.knn_k > 0,
    )


def pair_data(config) -> PairData:
    """The columns of ``--dataset`` named by ``--columns``: text, or an image and text."""
    columns = tuple(column.strip() for column in config.columns.split(","))
    return load_pair_dataset(
        config.dataset,
        columns,
        config_name=config.dataset_config,
        split=config.split,
        image_column=config.image_column,
        label_column=config.label_column,
        eval_split=config.eval_split,
        eval_holdout=config.eval_holdout,
        evaluate=config.knn_k > 0,
    )


@dataclass(frozen=True)
class MethodRow:
    """One ``--method``."""

    build: Callable[..., Any]
    #: Its data, from the options: ``ImageData`` or ``PairData``.
    load: Callable[[Any], Any] = image_data
    #: Its own defaults for options left at None.
    defaults: dict[str, Any] = field(default_factory=dict)
    #: Which of ``METHOD_OPTIONS`` it reads.
    options: tuple[str, ...] = ()


#: Options that only some methods read: a value other than the default is refused elsewhere.
DINO_OPTIONS = (
    "dino_out_dim",
    "center_momentum",
    "teacher_temperature",
    "teacher_temperature_warmup_steps",
    "global_crops",
    "local_crops",
    "local_crop_size",
    "dino_center",
    "freeze_last_layer",
)
TEACHER_OPTIONS = ("teacher_momentum", "eval_teacher")
TEXT_OPTIONS = (
    "columns",
    "zero_shot_template",
    "text_model",
    "text_pooling",
    "max_length",
    "two_towers",
    "unique_texts",
    "projection_dim",
    "mnrl_scale",
    "mnrl_symmetric",
    "attention_mask",
)
METHOD_OPTIONS = (
    "loss",
    *TEACHER_OPTIONS,
    "queue_size",
    "queue_keys",
    *DINO_OPTIONS,
    *TEXT_OPTIONS,
)

METHODS: dict[str, MethodRow] = {
    "simclr": MethodRow(SimCLRMethod, options=("loss", "queue_size", "queue_keys")),
    "moco": MethodRow(
        MomentumMethod,
        defaults={"temperature": 0.2, "teacher_momentum": 0.99},  # MoCo v3's
        options=(*TEACHER_OPTIONS, "queue_size", "queue_keys"),
    ),
    "byol": MethodRow(
        MomentumMethod,
        defaults={"teacher_momentum": 0.996},  # BYOL's
        options=TEACHER_OPTIONS,
    ),
    "dino": MethodRow(
        DINOMethod,
        defaults={"temperature": 0.1, "teacher_momentum": 0.996},  # DINO's
        options=(*TEACHER_OPTIONS, *DINO_OPTIONS),
    ),
    "pairs": MethodRow(
        pairs_method,
        load=pair_data,
        defaults={"optimizer": "adamw"},  # CLIP's and sentence-transformers'
        options=("loss", *TEXT_OPTIONS),
    ),
}
