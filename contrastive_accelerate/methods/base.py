"""What every method is to the loop (``Method``, ``MethodRow``), and the parts that
several methods share: the image tower, two views of an image, a queue, a teacher."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from contrastive_accelerate import collectives
from contrastive_accelerate.checkpoint_shards import load_local_state, stored_under
from contrastive_accelerate.collectives import is_distributed
from contrastive_accelerate.data import TwoViewBatch, TwoViews
from contrastive_accelerate.data.images import (
    MixedImages,
    load_image_mixture,
    load_streamed_images,
    per_source,
)
from contrastive_accelerate.data.interfaces import StreamDataset, TableDataset
from contrastive_accelerate.data.mixture import Mixture
from contrastive_accelerate.data.sources import ImageData, load_image_dataset
from contrastive_accelerate.grad_cache import has_batch_statistics
from contrastive_accelerate.knn import KnnData
from contrastive_accelerate.launch import TrainerError
from contrastive_accelerate.sharding import is_sharded, shard_model
from models import (
    convert_sample_dropout,
    convert_sync_batchnorm,
    sample_keys,
    sample_randomness,
)
from models.checkpointing import checkpoint_image_encoder
from models.image import ImageModel
from models.momentum import EMATeacher, KeyQueue

DTYPES = {"float32": torch.float32, "float64": torch.float64}

#: A notice printed once (``accelerator.print``).
Say = Callable[[str], Any]


class Method:
    """One training method, as the loop calls it; nothing else of it is called.

    ``__init__(config, data, world_size, say, *, total_steps, device)`` builds it from
    the run's resolved options (``TrainConfig.resolved()``), after seeding, so that
    every rank starts from the same weights, and sets:

    - ``model``: every trained module (towers, heads, a learnable scale); the loop
      prepares it with the optimizer (DDP), or with ``--fsdp`` shards it (``shard``).
    - ``dataset``: dataset rows as items, keyed by ``(epoch, index)``, over a table or a
      stream, or a mixture of them (``data.interfaces``: ``TableDataset``,
      ``StreamDataset``); ``dataset.collate`` makes the ``Batch``, whose ``split(k)``
      gives the chunks of gradient caching and whose ``unreadable`` lists the images
      that could not be decoded.

    The hooks below are the loop's calls; those with a body here are no-ops that a
    method overrides when it has something to do.
    """

    model: nn.Module
    dataset: TableDataset | StreamDataset | Mixture
    #: Content digests of the models and tokenizers an option loaded, by option name
    #: (``RunState.inputs``): a resume compares these, not the option's path.
    inputs: dict[str, dict[str, str]] = {}

    def embed(self, model: nn.Module, chunk: Any, step: int) -> torch.Tensor:
        """One chunk as embeddings. It is the forward that ``cached_backward`` replays,
        so its randomness must be keyed by sample."""
        raise NotImplementedError

    def loss(
        self, outputs: list[torch.Tensor], batch: Any, sizes: Sequence[int] | None, step: int
    ) -> torch.Tensor:
        """This rank's share of the loss of the global batch, from the embeddings of all
        of this rank's chunks; called once per step. ``sizes`` is every rank's number of
        samples when the loop knows it (the losses then exchange nothing:
        ``losses.inputs``), else None."""
        raise NotImplementedError

    def shard(self, mixed_precision: str) -> None:
        """``--fsdp``: shard the trained modules over the processes, in place, before the
        optimizer is made (``contrastive_accelerate.sharding``). ``embed`` must then call
        ``model`` itself, not its submodules: FSDP2 gathers the root's own weights (heads,
        embeddings) in the root's forward; so must ``evaluate``, through the model's
        ``sharding.EVALUATION_CALLS`` (``project_texts``, ...), as many times on every
        rank, and ``final/`` is written one tower at a time (``final_model``)."""
        shard_model(self.model, mixed_precision)

    def before_optimizer_step(self, epoch: int, step: int) -> None:
        """Between the backward and the optimizer step of ``step`` in ``epoch`` (DINO's
        frozen last layer)."""

    def after_step(self, step: int) -> None:
        """After each optimizer step (an EMA teacher's update, a queue's push)."""

    def evaluated_encoder(self) -> nn.Module:
        """The encoder that the loop's kNN and linear probe evaluate."""
        return self.model

    def duplicate_keys(self) -> list[tuple[int, ...]] | None:
        """Each dataset row's keys, for a sampler that puts no key twice in a global
        batch; None: the sampler needs none."""
        return None

    def evaluate(self, knn: KnnData | None) -> dict[str, float]:
        """The method's own figures, every ``--eval-every`` steps and at the end, beside the
        loop's kNN and linear probe (image-text's zero-shot accuracy, retrieval, BEIR),
        from the held-out images ``knn``."""
        return {}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors that persist across steps besides the model and the optimizer (a queue
        of past keys, a running center, a teacher's weights), saved with every checkpoint
        and the final model. They must be the same on every rank, which is what makes
        them resumable on another number of processes."""
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load ``state_dict``'s tensors from a checkpoint, refusing what this run has no
        room for."""
        load_queue(None, state)


#: Every kind of source: a table, streamed shards, a mixture (``composition.SOURCES``).
EVERY_SOURCE = ("table", "stream", "mixture")
#: The image towers an image method's heads sit on: from scratch, a transformers vision
#: model or a timm model (``composition.TOWERS``).
IMAGE_METHOD_TOWERS = ("scratch", "transformers", "timm")


@dataclass(frozen=True)
class Family:
    """What one kind of run of a method trains on (``methods.composition`` reads it):
    the kinds of source it reads and, if it takes images, the kinds of image tower."""

    #: How a refusal names it, e.g. "--method simclr".
    name: str
    #: Kinds of source (``composition.SOURCES``) it trains on.
    sources: tuple[str, ...] = ("table",)
    #: Kinds of image tower (``composition.TOWERS``) it trains; None: it takes no images.
    towers: tuple[str, ...] | None = ("scratch",)
    #: The options of ``models.towers.TOWER_OPTIONS`` that its other towers read (a text
    #: tower's ``--gradient-checkpointing``), whatever ``--model`` reads.
    reads: tuple[str, ...] = ()
    #: The ``--loss`` rows it takes (``methods.loss_table.LOSSES``), the first its default;
    #: none: it has a loss of its own.
    losses: tuple[str, ...] = ()


@dataclass(frozen=True)
class MethodRow:
    """One ``--method`` of ``METHODS``: everything the options and the loop know of it."""

    #: ``build(config, data, world_size, say, *, total_steps, device) -> Method``.
    build: Callable[..., Method]
    #: Its data, from the options: ``ImageData`` or ``PairData``.
    load: Callable[[Any], Any]
    #: The options only it (and the other methods naming them) reads; set for another
    #: method, they are refused.
    options: tuple[str, ...] = ()
    #: The sections that declare its own options (dataclasses of ``config.option``
    #: fields, in its module); ``TrainConfig`` holds every row's.
    sections: tuple[type, ...] = ()
    #: ``reads(config)``: those of ``options`` that this configuration reads (a loss reads
    #: its own); set but not read, they are refused too. None: all of ``options``.
    reads: Callable[[Any], Collection[str]] | None = None
    #: ``defaults(config) -> {option: value}`` for its options left at None.
    defaults: Callable[[Any], dict[str, Any]] = lambda config: {}
    #: ``check(config)``: its refusals of the options alone (``ConfigError``).
    check: Callable[[Any], None] = lambda config: None
    #: ``check_data(config, data)``: its refusals that need the data (``TrainerError``),
    #: made before anything is built.
    check_data: Callable[[Any, Any], None] = lambda config, data: None
    #: What it trains on (``methods.composition``): one ``Family``, or several that only
    #: the data tell apart, whose ``check_data`` then asks ``composition.check_family``.
    families: tuple[Family, ...] = ()

    def read_by(self, config) -> Collection[str]:
        """The options of ``options`` that ``config`` reads."""
        return self.options if self.reads is None else self.reads(config)


def dataset_options(config) -> dict[str, Any]:
    """What every loader of ``--dataset`` takes from the options: the source, its
    columns and the evaluation split (none without kNN)."""
    return {
        "config_name": config.dataset_config,
        "split": config.split,
        "image_column": config.image_column,
        "label_column": config.label_column,
        "eval_split": config.eval_split,
        "eval_holdout": config.eval_holdout,
        "evaluate": config.knn_k > 0 and config.eval_dataset is None,  # else held out there
    }


def augmentation_options(config) -> dict[str, Any]:
    """What every augmented dataset takes from the options besides size, seed and on/off."""
    return {
        "per_sample_seed": config.augmentation_seeding == "per-sample",
        "crop_min_scale": config.crop_min_scale,
        "horizontal_flip": config.horizontal_flip,
        "augmentation": config.augmentation,
    }


def image_data(config) -> ImageData | MixedImages:
    """The images of ``--dataset``: a table with its evaluation split
    (``load_image_dataset``), streamed shards or a mixture (``data.images``)."""
    if config.mixed:
        weights = config.mixture_weights
        return load_image_mixture(
            config.dataset, image_column=config.image_column, streaming=config.streaming,
            streams=config.streams, shuffle_buffer=config.shuffle_buffer, mixture=config.mixture,
            weights=[float(w) for w in weights.split(",")] if weights else None,
            temperature=config.mixture_temperature,
        )  # fmt: skip
    if config.streaming:
        return load_streamed_images(
            config.dataset, image_column=config.image_column, streams=config.streams,
            shuffle_buffer=config.shuffle_buffer, config_name=config.dataset_config,
            split=config.split,
        )  # fmt: skip
    return load_image_dataset(config.dataset, **dataset_options(config))


#: SimCLR's projection head (layers, hidden width, output width), which the other image
#: methods' heads share.
SIMCLR_HEAD = (2, 512, 128)


def head_shape(head: tuple[int, int, int]) -> dict[str, int]:
    """A projection head's (layers, hidden width, output width) as a model's arguments."""
    layers, hidden, width = head
    return {"projection_layers": layers, "projection_hidden_dim": hidden, "projection_dim": width}


def image_model(
    config,
    world_size: int,
    say: Say,
    model_class: type[ImageModel],
    *,
    other_size: int | None = None,
    **heads: Any,
) -> ImageModel:
    """``--model``'s tower, or ``--image-model``'s or ``--timm-model``'s, under the
    method's heads (``model_class``, with ``heads`` its own arguments: the head's shape, a
    learnable scale, a predictor's width), with global BatchNorm statistics and dropout
    keyed by sample where the options ask for them (a pretrained tower's own dropout is
    keyed where it loads: ``image_text.pretrained_image_tower``), taking crops of
    ``other_size`` too if given (DINO's local crops). A pretrained tower's content
    digests are the model's ``inputs`` (``Method.inputs``)."""
    encoder = export = None
    inputs = {}
    if config.image_model or config.timm_model:
        from contrastive_accelerate.methods.image_text import pretrained_image_tower

        if config.image_size is None:
            named = "--timm-model" if config.timm_model else "--image-model"
            raise TrainerError(
                f"{named} with --method {config.method}: give --image-size, the size "
                "of the crops its tower takes"
            )
        loaded = pretrained_image_tower(config, world_size, say, other_size)
        encoder, export, inputs = loaded.tower, loaded.export, loaded.inputs
    model = model_class(
        backbone=config.model,
        image_size=config.image_size,
        dropout=config.dropout,
        drop_path=config.drop_path,
        encoder=encoder,
        **heads,
    ).to(DTYPES[config.dtype])
    model.export_tower, model.inputs = export, inputs
    scratch = encoder is None and config.model != "mlp"  # image-text's text tower may
    if config.gradient_checkpointing and scratch:  # a pretrained one is checkpointed on load
        checkpoint_image_encoder(model.encoder)
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


def two_views_dataset(config, data: ImageData | MixedImages) -> TwoViews | Mixture:
    """Two augmented views of each image, drawn from (seed, epoch, index, view); of each
    source, for a mixture."""
    return per_source(data, lambda rows, image_column: TwoViews(
        rows, image_column, config.image_size, config.seed, config.augment,
        **augmentation_options(config),
    ))  # fmt: skip


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


def view_halves(outputs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every chunk's view-0 rows, then every chunk's view-1 rows."""
    if len(outputs) == 1:  # no copy
        return outputs[0].tensor_split(2)
    z0 = torch.cat([output[: len(output) // 2] for output in outputs])
    z1 = torch.cat([output[len(output) // 2 :] for output in outputs])
    return z0, z1


def push_batch_keys(
    queue: KeyQueue, keys: torch.Tensor, sizes: Sequence[int] | None, *, global_keys: bool = True
) -> None:
    """A step's keys into ``queue``: ``keys`` are this rank's rows, each row the keys of
    its views side by side; gathered into the global batch (unless ``global_keys`` is
    off: the per-rank control), then queued view by view in global sample order."""
    if global_keys and is_distributed():
        keys = collectives.gather(keys, sizes=sizes)
    views = keys.shape[1] // queue.buffer.shape[1]
    queue.push(torch.cat(keys.chunk(views, dim=1)))


class PastKeys:
    """A method's queue of past keys, ``--queue-size`` long (none at 0), and this step's
    keys waiting for it: ``hold`` them in ``loss``, ``push`` them in ``after_step``,
    gathered into the global batch (``--queue-keys per-rank``: each rank its own, the
    control). The queue is the method's state (``state_dict``). MoCo, SwAV and SimCLR's
    NT-Xent memory bank keep one."""

    def __init__(self, config, dim: int, dtype: torch.dtype, device=None) -> None:
        self.queue = KeyQueue(config.queue_size, dim, dtype, device) if config.queue_size else None
        self.global_keys = config.queue_keys == "global"
        self._held: tuple[torch.Tensor, Sequence[int] | None] | None = None

    def hold(self, keys: torch.Tensor, sizes: Sequence[int] | None) -> None:
        """This rank's keys of this step (each row the keys of its views side by side)."""
        if self.queue is not None:
            self._held = (keys, sizes)

    def push(self) -> None:
        if self._held is not None:
            push_batch_keys(self.queue, *self._held, global_keys=self.global_keys)
            self._held = None

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.queue.state_dict() if self.queue is not None else {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        load_queue(self.queue, state)


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


def teacher_state(teacher: EMATeacher) -> dict[str, torch.Tensor]:
    """The teacher's weights and buffers, under ``teacher.``: a sharded teacher's as its
    shards (``DTensor``), which a sharded checkpoint stores as they are and ``final/``
    gathers one at a time."""
    return {f"teacher.{name}": value for name, value in teacher.network.state_dict().items()}


def load_teacher(teacher: EMATeacher, state: Mapping[str, torch.Tensor], method: str) -> dict:
    """Load ``teacher_state``'s entries of ``state`` (a sharded teacher reads only its
    rows of a sharded checkpoint's); returns the other entries."""
    prefix = "teacher."
    weights = stored_under(state, prefix)
    if set(weights) != set(teacher.network.state_dict()):
        problem = (
            "has no teacher weights" if not weights else "has teacher weights that do not match"
        )
        raise TrainerError(f"the checkpoint {problem} for this run's --method {method} and model")
    if is_sharded(teacher.network):
        load_local_state(teacher.network, weights)  # this rank's rows
    else:
        teacher.network.load_state_dict(weights)
    return {name: state[name] for name in state if not name.startswith(prefix)}
