"""Every option of a run, declared once: ``TrainConfig``, the run's own options and the
sections of the parts (each declared in the module of the part that reads it).

Each field is a ``--flag`` and a config-file key (``contrastive_accelerate.config``
generates both and checks each field's type, choices and bounds). What depends on
more than one field is checked here, once, before anything is built:

- ``TrainConfig.__post_init__``: each field alone (``config.validate``), what the
  method, its tower and its source compose to (``methods.composition``: the one place
  of those reasons), the rules between fields that every method shares, and the
  method's own refusals (``METHODS[method].check``);
- ``check_launch``: the options against the launch (processes, mixed precision);
- ``check_data``: the options against the data (``METHODS[method].check_data``);
- ``check_steps``: the options against a checkpoint's step.

Defaults that depend on other options are left at None and resolved in one place,
``TrainConfig.resolved()``: the shared ones here, each method's in its module.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from dataclasses import dataclass

from accelerate import Accelerator

from contrastive_accelerate.compat import launcher_gradient_accumulation_steps
from contrastive_accelerate.config import ConfigError, field_names, flag, is_set, option, validate
from contrastive_accelerate.data import batches_per_epoch
from contrastive_accelerate.data.augmentation import ImageOptions
from contrastive_accelerate.data.mixture import MixtureOptions
from contrastive_accelerate.data.sources import TableOptions
from contrastive_accelerate.data.streams import StreamOptions
from contrastive_accelerate.launch import (
    SUPPORTED_DISTRIBUTED_TYPES,
    TrainerError,
    refuse_accelerate_fsdp,
)
from contrastive_accelerate.methods import (
    DTYPES,
    LOSSES,
    METHOD_OPTIONS,
    METHODS,
    composition,
)
from contrastive_accelerate.methods.loss_table import LossOptions
from contrastive_accelerate.optim import OPTIMIZERS
from models.lora import LoRAOptions
from models.towers import IMAGE_TOWERS, PretrainedTowerOptions, TowerOptions

REPORT_TO = ("none", "tensorboard", "wandb", "all")
#: What only ``--streaming`` reads.
STREAMING_OPTIONS = tuple(name for name in field_names(StreamOptions) if name != "streaming")
#: What only a mixture (several ``--dataset``) reads.
MIXTURE_OPTIONS = field_names(MixtureOptions)


#: Every part's section of options, each once: the sources' (``TableOptions`` in
#: ``data.sources``, ``StreamOptions`` in ``data.streams``, ``MixtureOptions`` in
#: ``data.mixture``), the images' (``ImageOptions`` in ``data.augmentation``), the
#: towers' (``TowerOptions``, ``PretrainedTowerOptions`` in ``models.towers``,
#: ``LoRAOptions`` in ``models.lora``), the
#: losses' (``LossOptions`` in ``methods.loss_table``) and each method's (its row's
#: ``sections``, in its module). ``TrainConfig`` holds them all.
SECTIONS = tuple(dict.fromkeys((
    TableOptions, StreamOptions, MixtureOptions, ImageOptions, TowerOptions,
    PretrainedTowerOptions, LoRAOptions, LossOptions,
    *(section for row in METHODS.values() for section in row.sections),
)))  # fmt: skip


@dataclass
class TrainConfig(*reversed(SECTIONS)):  # the first section's fields first
    """Every option of a run: a ``--flag`` and a config-file key each. ``resume`` says
    whether a resumed run may change it (default "refuse"; ``contrastive_accelerate.config``).
    Options left at None take the derived defaults of ``resolved()``. The run's own are
    declared here; each part's in its own module, a section of ``SECTIONS``, which this
    class holds."""

    # Data
    dataset: str | tuple[str, ...] | None = option(
        None, "hub name, folder, save_to_disk dir or data file; several: a mixture"
    )
    dataset_config: str | None = option(None, "the dataset's configuration (load_dataset's name=)")
    split: str = option("train", "the split to train on")
    image_column: str | None = option(None, "none: the first of image, img, pixel_values")
    label_column: str | None = option(None, "none: the first of label, labels, fine_label")
    num_workers: int | None = option(
        None, "loader processes; none: one per spare core, at most 4", resume="free", at_least=0
    )
    # Method, model and loss
    method: str | None = option(
        None, "a row of the methods table; none: simclr, pairs if --columns",
        choices=METHODS,
    )  # fmt: skip
    dtype: str = option("float32", "parameter dtype; float64 for exactness checks", choices=DTYPES)
    loss: str | None = option(
        None, "objective, exact on any number of processes; none: ntxent, pairs: mnrl / infonce",
        choices=LOSSES,
    )  # fmt: skip
    # Optimisation
    batch_size: int = option(64, "global batch size, split across processes", at_least=2)
    accumulation_chunks: int = option(
        1, "gradient caching: embed each share in K chunks", resume="apply", at_least=1
    )
    fsdp: bool = option(
        False,
        "shard weights, gradients and optimizer state over the processes (FSDP2)",
        resume="apply",
    )
    epochs: int | None = option(
        None, "epochs (unless --max-steps); none: the method's on the digits, else 45",
        resume="apply", at_least=1,
    )  # fmt: skip
    max_steps: int | None = option(None, "overrides --epochs", resume="apply", at_least=1)
    optimizer: str | None = option(
        None, "none: sgd; lars for barlowtwins and vicreg, adamw for pairs", choices=OPTIMIZERS
    )
    lr: float | None = option(
        None,
        "peak lr; none: sgd 0.03 (moco, byol digits 0.1), lars 0.2, adamw 1e-3, text 5e-5",
        resume="apply",
        above=0.0,
    )
    momentum: float = option(0.9, "SGD / LARS momentum", resume="apply", at_least=0.0, below=1.0)
    weight_decay: float = option(5e-4, "weight decay", resume="apply", at_least=0.0)
    warmup_steps: int = option(10, "linear warm-up steps, then cosine", resume="apply", at_least=0)
    seed: int = option(0, "seed of the weights, the data order and every draw", at_least=0)
    # Run
    output_dir: str | None = option(None, "the run's folder; none: runs/<method>", resume="free")
    overwrite_output_dir: bool = option(
        False, "replace another run's checkpoints and final model", resume="free"
    )
    resume_from: str | None = option(
        None, "a checkpoint directory, or latest (the newest in --output-dir)", resume="free"
    )
    save_every: int = option(0, "steps between checkpoints; 0: none", resume="free", at_least=0)
    save_total_limit: int | None = option(
        None, "keep the newest N checkpoints; none: all", resume="free", at_least=1
    )
    eval_every: int = option(
        0, "steps between evaluations; 0: kNN at start, all at end", resume="free", at_least=0
    )
    knn_k: int = option(20, "kNN neighbours; 0: no evaluation", resume="free", at_least=0)
    linear_probe: bool = option(True, "a linear probe too, at the end", resume="free")
    log_every: int = option(10, "steps between logged losses", resume="free", at_least=1)
    report_to: str = option(
        "none", "trackers besides metrics.jsonl", resume="free", choices=REPORT_TO
    )
    collective_timeout: float | None = option(
        None, "seconds a collective waits for a stalled rank", resume="free", above=0.0
    )
    # Negative controls: each reproduces what breaks world-size invariance elsewhere.
    gather: bool = option(True, "--no-gather: negatives of the local batch only")
    dropout_masks: str = option(
        "per-sample", "per-process: torch's nn.Dropout", choices=("per-sample", "per-process")
    )
    augmentation_seeding: str = option(
        "per-sample", "per-process: seed + rank", choices=("per-sample", "per-process")
    )
    data_sharding: str = option(
        "exact", "accelerate: padded batches", choices=("exact", "accelerate")
    )

    def __post_init__(self) -> None:
        validate(self)
        if self.overwrite_output_dir and self.resume_from:
            raise ConfigError("--overwrite-output-dir and --resume-from exclude each other")
        if self.eval_dataset is not None and self.knn_k == 0:
            raise ConfigError("--eval-dataset applies with kNN evaluation: --knn-k 0 turns it off")
        if not self.augment and self.augmentation != "simclr":
            raise ConfigError(f"--augmentation {self.augmentation}: no views under --no-augment")
        method = self.chosen_method
        row = METHODS[method]
        composition.check(self, row)  # first: it says why a source or a tower is refused
        for name in METHOD_OPTIONS:
            if not is_set(self, name) or name in row.read_by(self):
                continue
            if name in row.options:  # the method reads it, with another loss
                loss = self.loss or row.defaults(self)["loss"]
                raise ConfigError(f"{flag(name)} does not apply to --loss {loss}")
            raise ConfigError(f"{flag(name)} does not apply to --method {method}")
        composition.check_tower_kind(self)  # first: --image-model replaces --model's tower
        METHODS[method].check(self)
        composition.check_tower_options(self, row)
        self._check_streams_and_mixtures()

    @property
    def mixed(self) -> bool:
        """Whether ``--dataset`` names several sources: a mixture."""
        return isinstance(self.dataset, tuple)

    def _check_streams_and_mixtures(self) -> None:
        """A stream or a mixture: no epochs, no held-out rows, text pairs or image-text."""
        for names, given, what in (
            (STREAMING_OPTIONS, self.streaming, "with --streaming"),
            (MIXTURE_OPTIONS, self.mixed, "to several --dataset"),
        ):
            for name in names if not given else ():
                if is_set(self, name):
                    raise ConfigError(f"{flag(name)} applies {what}")
        if isinstance(self.columns, tuple) and not self.mixed:
            raise ConfigError("several --columns need as many --dataset (a mixture)")
        if not (self.streaming or self.mixed):
            return
        if self.dataset is None or self.max_steps is None:
            raise ConfigError(
                "--streaming and several --dataset train on --dataset for --max-steps steps "
                "(a stream has no length, a mixture no epochs)"
            )
        for name in ("unique_texts", *field_names(TableOptions)):
            if is_set(self, name):
                raise ConfigError(f"{flag(name)} does not apply to a stream or a mixture")
        if self.mixed:
            self._check_mixture()

    def _check_mixture(self) -> None:
        if isinstance(self.columns, tuple) and len(self.columns) != len(self.dataset):
            raise ConfigError(
                f"--columns is given {len(self.columns)} times for {len(self.dataset)} "
                "--dataset: once for all, or once each"
            )
        if self.mixture == "round-robin":
            for name in ("mixture_weights", "mixture_temperature"):
                if is_set(self, name):
                    raise ConfigError(f"{flag(name)} applies to --mixture proportional")
        if self.mixture_weights is not None:
            if is_set(self, "mixture_temperature"):
                raise ConfigError("--mixture-temperature applies to weights by rows, not given")
            try:
                weights = [float(weight) for weight in self.mixture_weights.split(",")]
            except ValueError:
                weights = []
            finite = all(0 < w < float("inf") for w in weights) and sum(weights) < float("inf")
            if len(weights) != len(self.dataset) or not finite:
                raise ConfigError(
                    f"--mixture-weights {self.mixture_weights}: {len(self.dataset)} positive "
                    "finite numbers, one per --dataset, with a finite sum"
                )

    @property
    def chosen_method(self) -> str:
        """``--method``, or its default: pairs with ``--columns``, else simclr."""
        return self.method or ("pairs" if self.columns else "simclr")

    @classmethod
    def from_saved(cls, values: dict) -> TrainConfig:
        """The options a checkpoint saved; those this version does not know, and those
        its method does not read (earlier versions resolved some for every method), are
        left out."""
        names = {field.name for field in dataclasses.fields(cls)}
        values = {name: value for name, value in values.items() if name in names}
        # What decides the options read, and what a valid choice of them needs.
        shaping = ("method", "loss", "columns", "dataset", "max_steps", "streaming", "gist_guide",
                   "distill_teacher", "model")  # fmt: skip
        shape = cls(**{name: values[name] for name in shaping if name in values})
        read = METHODS[shape.chosen_method].read_by(shape)
        return cls(
            **{name: value for name, value in values.items()
               if name not in METHOD_OPTIONS or name in read}
        )  # fmt: skip

    @property
    def digits(self) -> bool:
        """Training on the offline 8x8 digits (no ``--dataset``), where the methods'
        defaults rows hold recipes measured on them."""
        return self.dataset is None

    def resolved(self) -> TrainConfig:
        """Every option left at None given its derived default: from the dataset (the
        digits are 8x8) and the model, then the method's own (``METHODS[...].defaults``),
        then the shared fallbacks, and the learning rate from the optimizer."""
        digits = self.digits
        config = _fill(
            self,
            method=self.chosen_method,
            output_dir=os.path.join("runs", self.chosen_method),
            image_size=None if self.image_model or self.clip_model else 8 if digits else 32,
            dropout=IMAGE_TOWERS[self.model].default_dropout,
            crop_min_scale=0.5 if digits else 0.2,
            horizontal_flip=not digits,
        )
        config = _fill(config, **METHODS[config.method].defaults(config))
        config = _fill(config, optimizer="sgd", epochs=45)
        return _fill(config, lr={"lars": 0.2, "sgd": 0.03}.get(config.optimizer, 1e-3))


def _fill(config: TrainConfig, **defaults) -> TrainConfig:
    """``config`` with each option that is None set to its entry of ``defaults``."""
    values = {name: value for name, value in defaults.items() if getattr(config, name) is None}
    return dataclasses.replace(config, **values) if values else config


def check_launch(config: TrainConfig, accelerator: Accelerator, own_accelerator: bool) -> None:
    """Refuse, in one line, what Accelerate would run but the options cannot honour."""
    world_size = accelerator.num_processes
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and world_size == 1:
        raise TrainerError(
            f"launched with WORLD_SIZE={launched} but Accelerate runs one process "
            f"({accelerator.distributed_type}): each process would train alone"
        )
    refuse_accelerate_fsdp(accelerator)
    if config.fsdp and world_size == 1:
        raise TrainerError(
            "--fsdp shards over the processes: launch 2 or more, or leave it out (one "
            "process holds the whole model)"
        )
    if accelerator.distributed_type not in SUPPORTED_DISTRIBUTED_TYPES:
        raise TrainerError(
            f"{accelerator.distributed_type} is not supported: the trainer keeps a full "
            "replica per process (DDP) or shards it itself (--fsdp); launch with a multi-GPU, "
            "multi-CPU or single-process config"
        )
    accumulation = max(
        accelerator.gradient_accumulation_steps, launcher_gradient_accumulation_steps()
    )
    if accumulation > 1:
        raise TrainerError(
            f"gradient accumulation ({accumulation} steps) is not supported: each micro-batch "
            "would see only its own negatives, a different contrastive objective; use the "
            f"trainer's --accumulation-chunks {accumulation} (gradient caching: the same memory "
            "saving, every negative)"
        )
    precision = accelerator.mixed_precision
    if precision == "fp8":
        raise TrainerError("--mixed_precision fp8 is not supported; use bf16 or fp16")
    if precision == "fp16" and accelerator.device.type == "cpu":
        raise TrainerError(
            "--mixed_precision fp16 needs a GPU: on the CPU Accelerate would silently train in "
            "float32; use --mixed_precision bf16"
        )
    if config.fsdp and precision == "fp16":
        raise TrainerError("--fsdp with --mixed_precision fp16 is not supported; use bf16")
    if config.dtype == "float64" and precision != "no":
        raise TrainerError("--dtype float64 cannot be combined with mixed precision")
    if config.batch_size % world_size:
        raise TrainerError(
            f"--batch-size {config.batch_size} is the global batch: it must be divisible by "
            f"the {world_size} processes"
        )
    if not own_accelerator:
        if config.report_to != "none" or config.collective_timeout is not None:
            raise TrainerError(
                "--report-to and --collective-timeout configure the Accelerator that train() "
                "makes; with your own, pass log_with / InitProcessGroupKwargs to it instead"
            )
    elif config.report_to in ("tensorboard", "wandb") and not importlib.util.find_spec(
        config.report_to
    ):
        raise TrainerError(
            f"--report-to {config.report_to}: {config.report_to} is not installed "
            f"(pip install {config.report_to})"
        )


def check_data(config: TrainConfig, data) -> None:
    """Refuse what the options ask of these data (``config`` resolved)."""
    # A stream or a mixture has no epochs (``StreamBatches`` refuses fewer streams than
    # processes).
    epochs = not (config.streaming or config.mixed)
    if epochs and batches_per_epoch(len(data.train), config.batch_size, config.drop_last) == 0:
        raise TrainerError(
            f"--batch-size {config.batch_size} exceeds the {len(data.train)} training samples "
            "with --drop-last"
        )
    METHODS[config.method].check_data(config, data)


def check_steps(step: int, total_steps: int) -> None:
    """Refuse a resumed run that its options leave nothing to do: at the last step, the
    run still saves and evaluates (a signal may have stopped it there)."""
    if step > total_steps:
        raise TrainerError(
            f"nothing to train: the checkpoint is at step {step} and the run ends at step "
            f"{total_steps}; raise --max-steps or --epochs"
        )
