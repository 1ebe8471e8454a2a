"""Contrastive pre-training with HuggingFace Accelerate, identical on 1 or N processes.

    accelerate launch trainer.py                                    # one process, digits
    accelerate launch --config_file accelerate_configs/cpu_2_processes.yaml trainer.py
    accelerate launch trainer.py --config run.yaml --lr 0.1         # a file, a flag overriding it
    from trainer import TrainConfig, train                          # inside your own pipeline

``--batch-size`` is the *global* batch: the same command line trains the same
model on any number of processes (see README for the measured tolerances). The
method (model, data items, embedding, loss, state) is ``contrastive_accelerate.methods``;
this file is the loop: options, ``train()``, the loop, ``main()``.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from functools import partial

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from tqdm.auto import tqdm

from contrastive_accelerate.checkpoint import CheckpointError, RunDirectory, RunState, resume
from contrastive_accelerate.compat import forget_prepared, prepared_count
from contrastive_accelerate.config import (
    ConfigError,
    flag,
    option,
    parse_args,
    resume_rules,
    validate,
)
from contrastive_accelerate.data import batches_per_epoch, train_loader, workers_stopped_on_exit
from contrastive_accelerate.grad_cache import cached_backward
from contrastive_accelerate.knn import KnnData, RawPixels, knn_data, knn_top1
from contrastive_accelerate.launch import (
    TrainerError,
    check_launch,
    make_accelerator,
    one_line_errors,
)
from contrastive_accelerate.linear_probe import linear_probe_top1
from contrastive_accelerate.methods import DTYPES, LOSSES, METHOD_OPTIONS, METHODS, PAIR_LOSSES
from contrastive_accelerate.optim import OPTIMIZERS, make_optimizer, warmup_cosine
from contrastive_accelerate.preemption import StopSignals, exit_preempted
from contrastive_accelerate.ranks import StepChecks, any_rank, on_main_process, raise_together
from losses.dino import CENTER_FORMULAS
from models import BACKBONES
from models.simclr import VIT_SIZES, vit_patch_size
from models.text import POOLINGS

REPORT_TO = ("none", "tensorboard", "wandb", "all")


@dataclass
class TrainConfig:
    """Every option of a run: a ``--flag`` and a config-file key each. ``resume`` says
    whether a resumed run may change it (default "refuse"; ``contrastive_accelerate.config``).
    Options left at None take the derived defaults of ``resolved()``."""

    # Data
    dataset: str | None = option(
        None, "hub name, folder, save_to_disk dir or data file; none: the offline digits"
    )
    dataset_config: str | None = option(None, "the dataset's configuration (load_dataset's name=)")
    split: str = option("train", "the split to train on")
    image_column: str | None = option(None, "none: the first of image, img, pixel_values")
    label_column: str | None = option(None, "none: the first of label, labels, fine_label")
    eval_split: str = option(
        "auto", "evaluation split: auto (test, validation, valid or val) or a name", resume="free"
    )
    eval_holdout: float = option(
        0.2, "share of the training split held out if no evaluation split; 0: none",
        at_least=0.0, below=1.0,
    )  # fmt: skip
    image_size: int | None = option(None, "none: 8 for the digits, else 32", at_least=1)
    augment: bool = option(True, "SimCLR's random augmentations")
    crop_min_scale: float | None = option(
        None, "smallest crop area fraction; none: 0.5 for the 8x8 digits, else 0.2",
        above=0.0, at_most=1.0,
    )  # fmt: skip
    horizontal_flip: bool | None = option(
        None, "horizontal flips; none: off for the digits (not mirror-symmetric), else on"
    )
    skip_bad_images: bool = option(False, "skip unreadable images instead of stopping")
    num_workers: int | None = option(
        None, "loader processes; none: one per spare core, at most 4", resume="free", at_least=0
    )
    # Method, model and loss
    method: str | None = option(
        None, "simclr (--loss), moco (v3), byol, dino, pairs; none: simclr, pairs if --columns",
        choices=METHODS,
    )  # fmt: skip
    model: str = option("resnet18", "encoder", choices=BACKBONES)
    dtype: str = option("float32", "parameter dtype; float64 for exactness checks", choices=DTYPES)
    loss: str | None = option(
        None, "objective, exact on any number of processes; none: ntxent, pairs: mnrl / infonce",
        choices=tuple(dict.fromkeys((*LOSSES, *PAIR_LOSSES))),
    )  # fmt: skip
    temperature: float | None = option(
        None, "ntxent, dcl, dclw, supcon, moco, dino: temperature; none 0.5, moco 0.2, dino 0.1",
        resume="apply", above=0.0,
    )  # fmt: skip
    dclw_sigma: float = option(0.5, "dclw: scale of the vMF weights", resume="apply", above=0.0)
    supcon_rescale: bool = option(False, "supcon: loss times the temperature", resume="apply")
    logit_scale_init: float | None = option(
        None, "infonce, siglip: initial learnable scale; none: 1/0.07 and 10", above=0.0
    )
    logit_bias_init: float = option(-10.0, "siglip: initial learnable bias")
    barlow_lambda: float = option(
        5e-3, "barlowtwins: weight of the off-diagonal terms", resume="apply", at_least=0.0
    )
    vicreg_lambda: float = option(
        25.0, "vicreg: weight of the invariance term", resume="apply", at_least=0.0
    )
    vicreg_mu: float = option(
        25.0, "vicreg: weight of the variance term", resume="apply", at_least=0.0
    )
    vicreg_nu: float = option(
        1.0, "vicreg: weight of the covariance term", resume="apply", at_least=0.0
    )
    loss_tile_rows: int | None = option(
        None, "loss rows computed at a time; none: dense up to 1 GiB", resume="free", at_least=1
    )
    teacher_momentum: float | None = option(
        None, "moco, byol, dino: EMA momentum at step 0, cosine to 1; none: 0.99, else 0.996",
        resume="apply", at_least=0.0, at_most=1.0,
    )  # fmt: skip
    queue_size: int = option(
        0, "moco, simclr with ntxent: a queue of past keys as negatives; 0: none", at_least=0
    )
    dino_out_dim: int = option(1024, "dino: outputs of DINO's head", at_least=1)
    center_momentum: float = option(
        0.9, "dino: EMA momentum of the teacher's center", resume="apply", at_least=0.0, at_most=1.0
    )
    teacher_temperature: float = option(
        0.04, "dino: teacher temperature after the warm-up", resume="apply", above=0.0
    )
    teacher_temperature_warmup_steps: int = option(
        0, "dino: steps of the teacher temperature's warm-up from 0.04", resume="apply", at_least=0
    )
    freeze_last_layer: int = option(
        1, "dino: epochs the head's last layer stays frozen (DINO's)", resume="apply", at_least=0
    )
    global_crops: int = option(2, "dino: global crops per sample", at_least=1)
    local_crops: int | None = option(
        None, "dino: local crops per sample; none: 6, or 0 for the mlp", at_least=0
    )
    local_crop_size: int | None = option(
        None, "dino: local crop size; none: half of --image-size", at_least=1
    )
    dropout: float | None = option(
        None, "vit, mlp: dropout; none: 0.1 for the vits, else 0", at_least=0.0, below=1.0
    )
    drop_path: float = option(
        0.0, "vit: stochastic depth of the last block, linear from 0 (DINO: 0.1)",
        at_least=0.0, below=1.0,
    )  # fmt: skip
    sync_batchnorm: bool = option(True, "BatchNorm statistics of the global batch when W > 1")
    # Text pairs (--method pairs)
    columns: str | None = option(
        None, "pairs: columns anchor,positive[,negative...] (sentence-transformers' order)"
    )
    text_model: str | None = option(None, "pairs: a transformers model directory or hub name")
    text_pooling: str = option("mean", "pairs: masked mean or the first token", choices=POOLINGS)
    max_length: int = option(128, "pairs: tokens per text, longer ones truncated", at_least=2)
    two_towers: bool = option(False, "pairs: one tower for the anchors, one for the rest")
    unique_texts: bool = option(False, "pairs: no text twice in a global batch")
    projection_dim: int = option(0, "pairs: a linear projection's width; 0: none", at_least=0)
    mnrl_scale: float = option(
        20.0, "mnrl: similarity scale (1 / temperature)", resume="apply", above=0.0
    )
    mnrl_symmetric: bool = option(
        False, "mnrl: also each positive against every anchor", resume="apply"
    )
    zero_shot_template: str | None = option(
        None, 'image-text: zero-shot evaluation with e.g. "a photo of a {}"', resume="free"
    )
    # Optimisation
    batch_size: int = option(64, "global batch size, split across processes", at_least=2)
    accumulation_chunks: int = option(
        1, "gradient caching: embed each share in K chunks", resume="apply", at_least=1
    )
    epochs: int = option(45, "epochs to train (unless --max-steps)", resume="apply", at_least=1)
    max_steps: int | None = option(None, "overrides --epochs", resume="apply", at_least=1)
    drop_last: bool = option(False, "drop each epoch's short last batch")
    optimizer: str | None = option(
        None, "none: sgd; lars for barlowtwins and vicreg, adamw for pairs", choices=OPTIMIZERS
    )
    lr: float | None = option(
        None,
        "peak lr; none: sgd 0.03, lars 0.2, adamw 1e-3 (5e-5: pretrained text)",
        resume="apply",
        above=0.0,
    )
    momentum: float = option(0.9, "SGD / LARS momentum", resume="apply", at_least=0.0, below=1.0)
    weight_decay: float = option(5e-4, "weight decay", resume="apply", at_least=0.0)
    warmup_steps: int = option(10, "linear warm-up steps, then cosine", resume="apply", at_least=0)
    seed: int = option(0, "seed of the weights, the data order and every draw", at_least=0)
    # Run
    output_dir: str = option("runs/simclr", "checkpoints, final model, metrics", resume="free")
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
        0, "steps between kNN evaluations; 0: at start and end", resume="free", at_least=0
    )
    knn_k: int = option(20, "kNN neighbours; 0: no evaluation", resume="free", at_least=0)
    linear_probe: bool = option(True, "a linear probe too, at the end", resume="free")
    eval_teacher: bool = option(
        False, "moco, byol, dino: evaluate the teacher's encoder, as the papers do", resume="free"
    )
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
    queue_keys: str = option(
        "global", "per-rank: lightly's default, each rank queues its own keys",
        choices=("global", "per-rank"),
    )  # fmt: skip
    dino_center: str = option(
        "global", "dino: DINO's all_reduce(sum) / (local rows x W)", choices=CENTER_FORMULAS
    )
    attention_mask: bool = option(True, "pairs: --no-attention-mask attends to the padding")

    def __post_init__(self) -> None:
        validate(self)
        if self.overwrite_output_dir and self.resume_from:
            raise ConfigError("--overwrite-output-dir and --resume-from exclude each other")
        method = self.chosen_method
        for name in METHOD_OPTIONS:
            default = next(f.default for f in dataclasses.fields(self) if f.name == name)
            if getattr(self, name) != default and name not in METHODS[method].options:
                raise ConfigError(f"{flag(name)} does not apply to --method {method}")
        if method == "pairs" and not self.columns:
            raise ConfigError("--method pairs needs --columns anchor,positive[,negative...]")
        if self.loss is not None and self.loss not in (
            PAIR_LOSSES if method == "pairs" else LOSSES
        ):
            raise ConfigError(f"--loss {self.loss} does not apply to --method {method}")
        if self.queue_size and method == "simclr" and self.loss not in (None, "ntxent"):
            raise ConfigError(f"--queue-size applies to --loss ntxent, not {self.loss}")
        if self.local_crops and self.model == "mlp":
            raise ConfigError("--local-crops: mlp takes one input size; use a resnet or a vit")
        if self.local_crop_size and self.image_size and self.local_crop_size > self.image_size:
            raise ConfigError(
                f"--local-crop-size {self.local_crop_size} is larger than the global crops "
                f"(--image-size {self.image_size})"
            )
        vit_crops = self.model in VIT_SIZES and self.local_crops != 0
        if vit_crops and self.local_crop_size and self.image_size:
            patch = vit_patch_size(self.image_size)
            if self.local_crop_size % patch:
                raise ConfigError(
                    f"--local-crop-size {self.local_crop_size}: {self.model} at --image-size "
                    f"{self.image_size} has patches of {patch} px, which must divide it"
                )
        if self.drop_path and self.model not in VIT_SIZES:
            raise ConfigError(f"--drop-path applies to the vit encoders, not {self.model}")
        if self.dropout and self.model not in ("mlp", *VIT_SIZES):
            raise ConfigError(
                f"--dropout applies to the vit and mlp encoders; {self.model} has no dropout layers"
            )

    @property
    def chosen_method(self) -> str:
        """``--method``, or its default: pairs with ``--columns``, else simclr."""
        return self.method or ("pairs" if self.columns else "simclr")

    @classmethod
    def from_saved(cls, values: dict) -> TrainConfig:
        """The options a checkpoint saved; those this version does not know are left out."""
        names = {field.name for field in dataclasses.fields(cls)}
        return cls(**{name: value for name, value in values.items() if name in names})

    def resolved(self) -> TrainConfig:
        """Every option left at None given its derived default: from the dataset (the
        digits are 8x8), the model, and the rows of ``LOSSES`` and ``METHODS``."""
        digits = self.dataset is None
        method = self.chosen_method
        # Pairs: mnrl for text, infonce for image-text, which the data decide.
        loss = self.loss or ("ntxent" if method == "simclr" else None)
        derived = {
            "method": method,
            "loss": loss,
            "image_size": 8 if digits else 32,
            "dropout": 0.1 if self.model in VIT_SIZES else 0.0,
            "crop_min_scale": 0.5 if digits else 0.2,
            "horizontal_flip": not digits,
            "optimizer": "sgd",
            "temperature": 0.5,
            **(LOSSES[loss].defaults if method == "simclr" else {}),
            **METHODS[method].defaults,
        }
        values = {k: v for k, v in derived.items() if getattr(self, k) is None}
        config = dataclasses.replace(self, **values)
        if config.method == "dino":
            crops = {
                "local_crops": 0 if config.model == "mlp" else 6,
                "local_crop_size": max(1, config.image_size // 2),
            }
            crops = {k: v for k, v in crops.items() if getattr(config, k) is None}
            config = dataclasses.replace(config, **crops)
        if config.lr is None:
            lr = {"lars": 0.2, "sgd": 0.03}.get(config.optimizer, 1e-3)
            if config.method == "pairs" and config.text_model != "scratch":
                lr = 5e-5  # a pretrained text tower: sentence-transformers' AdamW default
            config = dataclasses.replace(config, lr=lr)
        return config


@dataclass
class TrainResult:
    """What a pipeline needs after ``train``."""

    model: torch.nn.Module  # unwrapped, trained, on the accelerator's device
    metrics: dict[str, float]
    step: int
    final_model_dir: str | None  # None when preempted
    last_checkpoint: str | None  # the newest checkpoint this run wrote
    preempted: str | None  # the signal that stopped the run after a checkpoint, if any


def train(config: TrainConfig, accelerator: Accelerator | None = None) -> TrainResult:
    """Train as ``config`` says.

    ``accelerator``: pass yours to train inside your own pipeline; its mixed precision
    and trackers apply, and ``train`` leaves its trackers and process group alone, so
    you can call ``train`` again or run collectives of your own afterwards. ``None``:
    one is made from ``config`` (``--report-to``, ``--collective-timeout``).
    """
    own_accelerator = accelerator is None
    if own_accelerator:
        accelerator = make_accelerator(
            config.output_dir, config.report_to, config.collective_timeout
        )
    check_launch(
        accelerator,
        own_accelerator,
        batch_size=config.batch_size,
        dtype=config.dtype,
        report_to=config.report_to,
        collective_timeout=config.collective_timeout,
    )
    # The output directory belongs to one run at a time (a lock the OS drops on exit).
    run = RunDirectory(config.output_dir, keep=config.save_total_limit)
    resume_path = on_main_process(
        run.claim, config.resume_from, config.overwrite_output_dir, errors=(CheckpointError,)
    )
    prepared = prepared_count(accelerator)
    try:
        return _train(config.resolved(), accelerator, run, resume_path, own_accelerator)
    finally:
        run.release()
        if own_accelerator:
            for tracker in accelerator.trackers:
                tracker.finish()
        # A pipeline calling train() again must not keep this run's model alive.
        forget_prepared(accelerator, prepared)


def _train(
    config: TrainConfig,
    accelerator: Accelerator,
    run: RunDirectory,
    resume_path: str | None,
    own_accelerator: bool,
) -> TrainResult:
    """The run itself, top to bottom: data, method, optimizer, resume, loop, save."""
    # Data: the global batch and each sample's randomness depend on (seed, epoch, index).
    data = METHODS[config.method].load(config)
    accelerator.print(data.evaluation_source)
    steps_per_epoch = batches_per_epoch(len(data.train), config.batch_size, config.drop_last)
    if steps_per_epoch == 0:
        raise TrainerError(
            f"--batch-size {config.batch_size} exceeds the {len(data.train)} training samples "
            "with --drop-last"
        )
    total_steps = config.max_steps or config.epochs * steps_per_epoch

    # Method and optimizer
    set_seed(config.seed)  # identical initial weights on every rank
    method = METHODS[config.method].build(
        config,
        data,
        accelerator.num_processes,
        accelerator.print,
        total_steps=total_steps,
        device=accelerator.device,
    )
    if config.augmentation_seeding == "per-process":
        set_seed(config.seed, device_specific=True)  # the common practice: seed + rank
    optimizer = make_optimizer(
        config.optimizer,
        method.model.parameters(),
        lr=config.lr,
        momentum=config.momentum,
        weight_decay=config.weight_decay,
    )
    model, optimizer = accelerator.prepare(method.model, optimizer)
    learning_rate = warmup_cosine(config.lr, config.warmup_steps, total_steps)

    # Resume: model, optimizer and method state; the step gives the data position and the lr.
    state = RunState(dataclasses.asdict(config), len(data.train), accelerator.num_processes)
    step = _resume(accelerator, model, optimizer, method, resume_path, state) if resume_path else 0
    if step >= total_steps:
        raise TrainerError(
            f"nothing to train: the checkpoint is at step {step} and the run ends at step "
            f"{total_steps}; raise --max-steps or --epochs"
        )
    if accelerator.is_main_process:
        run.log({"start_step": step, **dataclasses.asdict(state)})
    if own_accelerator:
        accelerator.init_trackers(config.method, config=_flat_for_trackers(config))
    # Every rank evaluates its share of the kNN bank and queries (contrastive_accelerate.knn).
    knn = None
    if data.evaluation is not None and data.image_column is not None:
        knn = knn_data(data.train, data.evaluation, data.image_column, data.label_column,
                       config.image_size, config.skip_bad_images)  # fmt: skip
    # The encoder that evaluation sees: the student's, or the teacher's (--eval-teacher).
    evaluated = method.teacher.network if config.eval_teacher else accelerator.unwrap_model(model)
    metrics: dict[str, float] = {}
    if step == 0 and knn is not None:
        metrics["knn_top1_init"] = _evaluate(accelerator, evaluated, knn, config.knn_k, run, step)
    # Non-finite losses and problems found without a collective: raised at logging and saving.
    checks = StepChecks(accelerator.device)
    save = partial(_save, accelerator, run, model, optimizer, method, state, checks)

    # Loop
    loader, sampler = train_loader(
        method.dataset,
        accelerator,
        batch_size=config.batch_size,
        seed=config.seed,
        drop_last=config.drop_last,
        num_workers=config.num_workers,
        padded_batches=config.data_sharding == "accelerate",
        duplicate_keys=method.dataset.duplicate_keys() if config.unique_texts else None,
    )
    progress = tqdm(
        total=total_steps,
        initial=step,
        disable=not accelerator.is_main_process,
        desc="training",
        dynamic_ncols=True,
    )
    started, started_step = time.perf_counter(), step
    last_checkpoint, saved_step, preempted = None, step, None
    # The bar ends its line before any error; the workers stop whatever ends the loop.
    with progress, StopSignals() as signals, workers_stopped_on_exit(loader):
        while step < total_steps and not preempted:
            epoch, first_batch = divmod(step, steps_per_epoch)
            sampler.set_epoch(epoch, first_batch)
            for batch in loader:
                stop, skipped = _stop_requested(signals, batch, config.skip_bad_images)
                if stop:
                    preempted = signals.requested or "a signal to another rank"
                    if step != saved_step:
                        last_checkpoint = save(step)
                    break
                # Every rank's share, known from the sampler: the losses exchange nothing
                # (unless a rank skipped an image, or Accelerate shards: the control).
                known = not skipped and config.data_sharding != "accelerate"
                sizes = sampler.share_sizes(step % steps_per_epoch) if known else None
                loss = cached_backward(
                    model,
                    batch.split(config.accumulation_chunks),
                    partial(method.loss, batch=batch, sizes=sizes, step=step),
                    forward=partial(method.embed, model, step=step),
                    backward=accelerator.backward,
                )
                checks.record(step, loss)
                lr = learning_rate(step)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                method.before_optimizer_step(epoch)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                method.after_step(step)
                step += 1
                progress.update(1)

                if step % config.log_every == 0 or step == total_steps:
                    checks.raise_if_any()
                    trained = (step - started_step) * config.batch_size
                    speed = trained / (time.perf_counter() - started)
                    metrics |= _log(accelerator, run, progress, step, loss, lr, epoch, speed)
                if config.save_every and step % config.save_every == 0:
                    last_checkpoint, saved_step = save(step), step
                if knn is not None and config.eval_every and step % config.eval_every == 0:
                    if step < total_steps:
                        _evaluate(accelerator, evaluated, knn, config.knn_k, run, step)
                if step == total_steps:
                    break

    # Save
    unwrapped = accelerator.unwrap_model(model)
    if preempted:
        accelerator.print(
            f"stopped by {preempted} at step {step}: checkpoint "
            f"{last_checkpoint or 'of this step already saved'}; continue with "
            "--resume-from latest"
        )
        return TrainResult(unwrapped, metrics, step, None, last_checkpoint, preempted)
    if knn is not None:
        metrics["knn_top1"] = _evaluate(accelerator, evaluated, knn, config.knn_k, run, step)
        metrics |= _baselines_and_probe(accelerator, evaluated, knn, config, run, step)
    metrics |= _method_figures(accelerator, method, knn, run, step)
    final = on_main_process(
        run.save_final, unwrapped, method.state_dict(), errors=(CheckpointError,)
    )
    if accelerator.is_main_process:
        print(_summary(metrics, config.knn_k, final, knn), flush=True)
    return TrainResult(unwrapped, metrics, step, final, last_checkpoint, None)


def _stop_requested(signals: StopSignals, batch, skip_bad_images: bool) -> tuple[bool, bool]:
    """Whether any rank was signalled to stop, and whether any rank skipped an image (its
    share is then smaller than the sampler's). One exchange per step, before any other
    collective of the step, on the host, also says whether any rank drew an unreadable
    image: an error on every rank, or skipped and said with ``--skip-bad-images``."""
    stop, broken, skipped = any_rank(
        signals.requested is not None,
        bool(batch.unreadable) and not skip_bad_images,
        bool(batch.unreadable),
    )
    if broken:
        raise_together(batch.unreadable[0] if batch.unreadable else None)
    for image in batch.unreadable:
        print(f"warning: skipping {image} (--skip-bad-images)", flush=True)
    return stop, skipped


def _log(accelerator, run, progress, step, loss, lr, epoch, samples_per_s) -> dict[str, float]:
    """The global loss (each rank's loss is W x its share: the mean is it) and the speed,
    to the progress bar, the trackers and metrics.jsonl."""
    record = {
        "loss": accelerator.reduce(loss.detach(), "mean").item(),
        "samples_per_s": samples_per_s,
        "lr": lr,
        "epoch": epoch,
    }
    progress.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{lr:.3g}")
    accelerator.log(record, step=step)
    if accelerator.is_main_process:
        run.log({"step": step, **record})
    return {"loss": record["loss"], "samples_per_s": samples_per_s}


def _save(accelerator, run, model, optimizer, method, state, checks, step: int) -> str:
    """A checkpoint, written by the main process: every rank holds the same states."""
    checks.raise_if_any()  # never a checkpoint of a model that a non-finite loss trained
    return on_main_process(
        run.save_checkpoint,
        step,
        accelerator.unwrap_model(model),
        optimizer,
        state,
        method.state_dict(),
        errors=(CheckpointError,),
    )


def _resume(accelerator, model, optimizer, method, path: str, state: RunState) -> int:
    """Load the checkpoint at ``path``; returns its step. A changed option that shapes the
    optimisation is applied and said (``resume="apply"``) or refused (``"refuse"``)."""
    checkpoint, changed = resume(
        path,
        accelerator.unwrap_model(model),
        optimizer,
        state,
        resume_rules(TrainConfig),
        resolve=lambda saved: dataclasses.asdict(TrainConfig.from_saved(saved).resolved()),
    )
    method.load_state_dict(checkpoint.method_state)
    for entry in changed:
        accelerator.print(f"resume: applying {entry}")
    accelerator.print(f"resumed from {path} at step {checkpoint.step}")
    return checkpoint.step


def _evaluate(accelerator, encoder, knn: KnnData, k: int, run: RunDirectory, step: int) -> float:
    encoder.eval()
    accuracy = knn_top1(encoder, knn, k=k)
    encoder.train()
    accelerator.log({"knn_top1": accuracy}, step=step)
    if accelerator.is_main_process:
        run.log({"step": step, "knn_top1": accuracy})
    return accuracy


def _baselines_and_probe(accelerator, encoder, knn: KnnData, config, run, step: int) -> dict:
    """What the trained encoder's figures mean: kNN on raw pixels of the same held-out
    images, and with ``--linear-probe`` the probe of the encoder's and of raw features."""
    encoder.eval()
    results = {"raw_pixels_knn_top1": knn_top1(RawPixels(), knn, k=config.knn_k)}
    if config.linear_probe:
        results["linear_probe_top1"] = linear_probe_top1(encoder, knn)
        results["raw_pixels_linear_probe_top1"] = linear_probe_top1(RawPixels(), knn)
    encoder.train()
    accelerator.log(results, step=step)
    if accelerator.is_main_process:
        run.log({"step": step, **results})
    return results


def _method_figures(accelerator, method, knn, run: RunDirectory, step: int) -> dict:
    """The method's own final figures (``method.evaluate``: zero-shot, retrieval), logged
    like the kNN's."""
    results = method.evaluate(knn)
    if results:
        accelerator.log(results, step=step)
        if accelerator.is_main_process:
            run.log({"step": step, **results})
    return results


def _summary(metrics: dict[str, float], k: int, final: str, knn: KnnData | None) -> str:
    """The final figures, each next to its raw-pixel baseline on the same held-out images."""
    lines = [f"final model: {final}"]
    if "loss" in metrics:
        lines.append(f"final loss: {metrics['loss']:.4f}")
    if knn is not None:
        held_out = f"{len(knn.query_labels)} held-out images"
        line = f"kNN top-1 (k={k}, {held_out}): raw pixels {metrics['raw_pixels_knn_top1']:.1%},"
        if "knn_top1_init" in metrics:
            line += f" random init {metrics['knn_top1_init']:.1%} ->"
        lines.append(f"{line} trained {metrics['knn_top1']:.1%}")
    if "linear_probe_top1" in metrics:
        raw, trained = metrics["raw_pixels_linear_probe_top1"], metrics["linear_probe_top1"]
        probe = f"linear probe top-1 ({held_out}): raw pixels {raw:.1%}"
        lines.append(f"{probe}, trained {trained:.1%}")
    if "zero_shot_top1" in metrics:
        lines.append(f"zero-shot top-1 ({held_out}): {metrics['zero_shot_top1']:.1%}")
    retrieval = {key: value for key, value in metrics.items() if "@" in key}
    if retrieval:
        figures = ", ".join(f"{key} {value:.3f}" for key, value in retrieval.items())
        lines.append(f"retrieval on the held-out pairs: {figures}")
    return "\n".join(lines)


def _flat_for_trackers(config: TrainConfig) -> dict:
    # TensorBoard's hparams take numbers, strings and booleans only.
    return {
        key: "none" if value is None else value for key, value in dataclasses.asdict(config).items()
    }


def main(argv: list[str] | None = None) -> None:
    with one_line_errors():  # every rank validates the same inputs: every rank exits, no hang
        result = train(parse_args(TrainConfig, argv, description=__doc__.split("\n")[0]))
    if result.preempted:
        exit_preempted()


if __name__ == "__main__":
    main()
