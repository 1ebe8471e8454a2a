"""SimCLR pre-training with HuggingFace Accelerate, identical on 1 or N processes.

    accelerate launch trainer.py                                    # one process, digits
    accelerate launch --config_file accelerate_configs/cpu_2_processes.yaml trainer.py
    accelerate launch trainer.py --config run.yaml --lr 0.1         # a file, a flag overriding it
    from trainer import TrainConfig, train                          # inside your own pipeline

``--batch-size`` is the *global* batch: the same command line trains the same
model on any number of processes (see README for the measured tolerances).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import math
import os
import re
import sys
import time
import traceback
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from accelerate import Accelerator, DistributedType
from accelerate.data_loader import prepare_data_loader
from accelerate.utils import InitProcessGroupKwargs, set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from contrastive_accelerate.checkpoint import (
    CheckpointError,
    RunDirectory,
    load_checkpoint,
    load_model_state,
    load_optimizer_state,
    save_checkpoint,
    save_final_model,
)
from contrastive_accelerate.config import ConfigError, option, parse_args, resume_rules, validate
from contrastive_accelerate.data import (
    GlobalBatchSampler,
    TwoViews,
    batches_per_epoch,
    label_ids,
    load_image_dataset,
)
from contrastive_accelerate.grad_cache import cached_backward, has_batch_statistics
from contrastive_accelerate.knn import KnnData, knn_data, knn_top1
from contrastive_accelerate.lars import LARS
from contrastive_accelerate.preemption import EXIT_PREEMPTED, StopSignals, ignore_stop_signals
from contrastive_accelerate.ranks import (
    any_rank,
    on_main_process,
    raise_together,
    settle_before_exit,
)
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
    BACKBONES,
    SimCLR,
    convert_sample_dropout,
    convert_sync_batchnorm,
    sample_keys,
    sample_randomness,
)
from models.simclr import VIT_SIZES

OPTIMIZERS = ("sgd", "adamw", "lars")
#: --loss: the loss and the projection head (layers, hidden and output width) it trains.
LOSSES = {
    "ntxent": (2, 512, 128),
    "dcl": (2, 512, 128),
    "dclw": (2, 512, 128),
    "supcon": (2, 512, 128),
    "infonce": (2, 512, 128),
    "siglip": (2, 512, 128),
    # The papers' 3-layer 8192-wide projectors, scaled down for small data.
    "barlowtwins": (3, 1024, 1024),
    "vicreg": (3, 1024, 1024),
}
DTYPES = {"float32": torch.float32, "float64": torch.float64}
REPORT_TO = ("none", "tensorboard", "wandb", "all")


class TrainerError(ValueError):
    """A configuration or input problem: reported as one line on every rank."""


@dataclass
class TrainConfig:
    """Every option of a run. Each field is also a ``--flag`` and a config-file key;
    ``resume`` says whether a resumed run may change it (see ``contrastive_accelerate.config``)."""

    # Data
    dataset: str | None = option(
        None,
        "hub name, local dataset directory or image folder (datasets.load_dataset), "
        "save_to_disk directory, or one .parquet/.csv/.json(l) file; none: scikit-learn's "
        "8x8 digits, offline",
        resume="refuse",
    )
    dataset_config: str | None = option(
        None, "the dataset's configuration (load_dataset's name=)", resume="refuse"
    )
    split: str = option("train", "the split to train on", resume="refuse")
    image_column: str | None = option(
        None, "none: the first of image, img, pixel_values", resume="refuse"
    )
    label_column: str | None = option(
        None,
        "labels for kNN evaluation; none: the first of label, labels, fine_label",
        resume="refuse",
    )
    eval_split: str = option(
        "auto",
        "kNN evaluation split: auto (the first of test, validation, valid, val) or a name",
        resume="free",
    )
    eval_holdout: float = option(
        0.2,
        "fraction of the training split held out for kNN evaluation when the dataset has no "
        "evaluation split (printed at start-up); 0 trains on every image",
        resume="refuse",
        at_least=0.0,
        below=1.0,
    )
    image_size: int | None = option(
        None, "none: 8 for the default digits (their size), else 32", resume="refuse", at_least=1
    )
    augment: bool = option(True, "SimCLR's random augmentations", resume="refuse")
    crop_min_scale: float | None = option(
        None,
        "smallest RandomResizedCrop area fraction; none: 0.5 for the 8x8 digits (a 20% crop "
        "keeps ~3x3 of their pixels), else 0.2 (SimCLR's CIFAR setting)",
        resume="refuse",
        above=0.0,
        at_most=1.0,
    )
    skip_bad_images: bool = option(
        False,
        "skip unreadable images (the same ones on every rank, so invariance and resume hold) "
        "instead of stopping with an error naming the file",
        resume="refuse",
    )
    num_workers: int | None = option(
        None,
        "DataLoader worker processes, kept across epochs; none: one per spare core of this "
        "process's share of the machine, at most 4",
        resume="free",
        at_least=0,
    )
    # Model and loss
    model: str = option("resnet18", "encoder", resume="refuse", choices=BACKBONES)
    dtype: str = option(
        "float32",
        "parameter dtype; float64 for exactness checks (mixed precision is Accelerate's "
        "--mixed_precision)",
        resume="refuse",
        choices=tuple(DTYPES),
    )
    loss: str = option(
        "ntxent",
        "contrastive objective, exact on any number of processes (see README)",
        resume="refuse",
        choices=tuple(LOSSES),
    )
    temperature: float = option(
        0.5, "temperature of ntxent, dcl, dclw and supcon", resume="apply", above=0.0
    )
    dclw_sigma: float = option(
        0.5, "dclw: scale of the von Mises-Fisher weights", resume="apply", above=0.0
    )
    supcon_rescale: bool = option(
        False, "supcon: multiply the loss by the temperature", resume="apply"
    )
    logit_scale_init: float | None = option(
        None,
        "infonce, siglip: initial learnable logit scale; none: 1/0.07 (CLIP) for infonce, "
        "10 for siglip",
        resume="refuse",
        above=0.0,
    )
    logit_bias_init: float = option(-10.0, "siglip: initial learnable logit bias", resume="refuse")
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
        None,
        "rows of the loss computed at a time; none: dense until the logits pass 1 GiB",
        resume="free",
        at_least=1,
    )
    dropout: float | None = option(
        None,
        "dropout of the vit and mlp encoders; none: 0.1 for vit_tiny and vit_small, else 0",
        resume="refuse",
        at_least=0.0,
        below=1.0,
    )
    dropout_masks: str = option(
        "per-sample",
        "per-sample (each sample's mask from seed, step and its dataset index: world-size "
        "and chunking invariant) or per-process (torch's nn.Dropout, global RNG: a control)",
        resume="refuse",
        choices=("per-sample", "per-process"),
    )
    sync_batchnorm: bool = option(
        True, "BatchNorm statistics over the global batch when W > 1", resume="refuse"
    )
    gather: bool = option(
        True,
        "--no-gather: negatives from the local batch only (a different objective; a control)",
        resume="refuse",
    )
    # Optimisation
    batch_size: int = option(
        128, "global batch size (pairs), split across processes", resume="refuse", at_least=2
    )
    accumulation_chunks: int = option(
        1,
        "embed each process's share of the batch in this many chunks and backpropagate the "
        "whole batch's loss through them (gradient caching): activation memory of one chunk, "
        "gradient of the whole batch (exact without BatchNorm, which sees each chunk alone)",
        resume="apply",
        at_least=1,
    )
    epochs: int = option(30, "epochs to train (unless --max-steps)", resume="apply", at_least=1)
    max_steps: int | None = option(None, "overrides --epochs", resume="apply", at_least=1)
    drop_last: bool = option(False, "drop each epoch's short last batch", resume="refuse")
    optimizer: str | None = option(
        None,
        "optimizer; none: sgd, or lars (their papers' choice) for barlowtwins and vicreg",
        resume="refuse",
        choices=OPTIMIZERS,
    )
    lr: float | None = option(
        None,
        "peak learning rate; none: 0.03 (SGD: 0.06 x batch / 256, lightly's CIFAR-10 recipe), "
        "0.2 with LARS for barlowtwins and vicreg (their papers')",
        resume="apply",
        above=0.0,
    )
    momentum: float = option(0.9, "SGD / LARS momentum", resume="apply", at_least=0.0, below=1.0)
    weight_decay: float = option(5e-4, "weight decay", resume="apply", at_least=0.0)
    warmup_steps: int = option(
        10, "linear warm-up steps, then cosine decay", resume="apply", at_least=0
    )
    seed: int = option(
        0, "seed of the weights, the data order and every augmentation", resume="refuse", at_least=0
    )
    # Run
    output_dir: str = option("runs/simclr", "checkpoints, final model, metrics", resume="free")
    overwrite_output_dir: bool = option(
        False, "replace another run's checkpoints and final model in --output-dir", resume="free"
    )
    resume_from: str | None = option(
        None,
        "a checkpoint directory, or 'latest': the newest complete checkpoint in --output-dir "
        "(a fresh start if there is none), so a requeued job can repeat its command line",
        resume="free",
    )
    save_every: int = option(0, "steps between checkpoints; 0: none", resume="free", at_least=0)
    save_total_limit: int | None = option(
        None, "keep only the newest N checkpoints; none: all", resume="free", at_least=1
    )
    eval_every: int = option(
        0, "steps between kNN evaluations; 0: at start and end only", resume="free", at_least=0
    )
    knn_k: int = option(
        20, "neighbours of the kNN evaluation; 0: no evaluation", resume="free", at_least=0
    )
    log_every: int = option(10, "steps between logged losses", resume="free", at_least=1)
    report_to: str = option(
        "none",
        "trackers besides metrics.jsonl (Accelerate's log_with)",
        resume="free",
        choices=REPORT_TO,
    )
    collective_timeout: float | None = option(
        None,
        "seconds a collective may wait for a stalled rank before the job fails; none: "
        "Accelerate's default (30 min on gloo, 10 min on NCCL)",
        resume="free",
        above=0.0,
    )
    # The two below exist to reproduce what breaks world-size invariance elsewhere:
    augmentation_seeding: str = option(
        "per-sample",
        "per-sample (world-size invariant) or per-process (seed + rank, global RNG: a control)",
        resume="refuse",
        choices=("per-sample", "per-process"),
    )
    data_sharding: str = option(
        "exact",
        "exact (no padding) or accelerate (Accelerate's even_batches padding: a control)",
        resume="refuse",
        choices=("exact", "accelerate"),
    )

    def __post_init__(self) -> None:
        validate(self)
        if self.overwrite_output_dir and self.resume_from:
            raise ConfigError("--overwrite-output-dir and --resume-from exclude each other")
        if self.dropout and self.model not in ("mlp", *VIT_SIZES):
            raise ConfigError(
                f"--dropout applies to the vit and mlp encoders; {self.model} has no dropout layers"
            )


@dataclass
class TrainResult:
    """What a pipeline needs after ``train``."""

    model: SimCLR  # unwrapped, trained, on the accelerator's device
    metrics: dict[str, float]
    step: int
    final_model_dir: str | None  # None when preempted
    last_checkpoint: str | None  # the newest checkpoint this run wrote
    preempted: str | None  # the signal that stopped the run after a checkpoint, if any


def train(config: TrainConfig, accelerator: Accelerator | None = None) -> TrainResult:
    """Train SimCLR as ``config`` says.

    ``accelerator``: pass yours to train inside your own pipeline; its mixed precision
    and trackers apply, and ``train`` leaves its trackers and process group alone, so
    you can call ``train`` again or run collectives of your own afterwards. ``None``:
    one is made from ``config`` (``--report-to``, ``--collective-timeout``).
    """
    own_accelerator = accelerator is None
    if own_accelerator:
        accelerator = _make_accelerator(config)
    _check_launch(config, accelerator, own_accelerator)
    # The output directory belongs to one run at a time (a lock the OS drops on exit).
    run = RunDirectory(config.output_dir)
    resume_path = on_main_process(
        run.claim, config.resume_from, config.overwrite_output_dir, errors=(CheckpointError,)
    )
    prepared = len(accelerator._models), len(accelerator._optimizers)
    try:
        return _train(config, accelerator, run, resume_path, own_accelerator)
    finally:
        run.release()
        if own_accelerator:
            for tracker in accelerator.trackers:
                tracker.finish()
        # Accelerate keeps every object it prepared; a pipeline calling train() again
        # with the same accelerator must not keep this run's model and optimizer alive.
        del accelerator._models[prepared[0] :], accelerator._optimizers[prepared[1] :]


def _train(
    config: TrainConfig,
    accelerator: Accelerator,
    run: RunDirectory,
    resume_path: str | None,
    own_accelerator: bool,
) -> TrainResult:
    """The run itself, top to bottom: config, data, model, optimizer, loop, save."""
    config = _with_defaults(config)
    world_size, dtype = accelerator.num_processes, DTYPES[config.dtype]

    # Data: the global batch and each sample's augmentation depend on (seed, epoch, index) only.
    data = load_image_dataset(
        config.dataset,
        config_name=config.dataset_config,
        split=config.split,
        image_column=config.image_column,
        label_column=config.label_column,
        eval_split=config.eval_split,
        eval_holdout=config.eval_holdout,
        evaluate=config.knn_k > 0,
    )
    accelerator.print(data.evaluation_source)
    per_sample_seed = config.augmentation_seeding == "per-sample"
    views = TwoViews(
        data.train,
        data.image_column,
        config.image_size,
        config.seed,
        config.augment,
        per_sample_seed=per_sample_seed,
        crop_min_scale=config.crop_min_scale,
    )
    steps_per_epoch = batches_per_epoch(len(data.train), config.batch_size, config.drop_last)
    if steps_per_epoch == 0:
        raise TrainerError(
            f"--batch-size {config.batch_size} exceeds the {len(data.train)} training samples "
            "with --drop-last"
        )
    total_steps = config.max_steps or config.epochs * steps_per_epoch

    # Model, loss, optimizer
    set_seed(config.seed)  # identical initial weights on every rank
    layers, hidden, width = LOSSES[config.loss]
    model = SimCLR(
        backbone=config.model,
        image_size=config.image_size,
        projection_layers=layers,
        projection_hidden_dim=hidden,
        projection_dim=width,
        logit_scale=_logit_scale_init(config),
        logit_bias=config.logit_bias_init if config.loss == "siglip" else None,
        dropout=config.dropout,
    ).to(dtype)
    if world_size > 1 and config.sync_batchnorm:
        model = convert_sync_batchnorm(model)
    chunks = config.accumulation_chunks
    if config.dropout and config.dropout_masks == "per-sample":
        model = convert_sample_dropout(model)  # masks keyed by sample: see sample_keys below
    elif config.dropout and (world_size > 1 or chunks > 1):
        accelerator.print(
            "warning: --dropout-masks per-process draws masks from each process's RNG: "
            "training is not world-size invariant, and the chunks' recompute draws new masks"
        )
    if chunks > 1 and has_batch_statistics(model):
        accelerator.print(
            f"warning: with --accumulation-chunks {chunks} BatchNorm normalises each chunk "
            "with that chunk's statistics: the gradient is not that of the whole batch in one "
            "pass (a BatchNorm-free model, e.g. vit_tiny or mlp, makes it exact)"
        )
    if not per_sample_seed:
        set_seed(config.seed, device_specific=True)  # the common practice: seed + rank
    criterion = _criterion(config)
    labels = None
    if config.loss == "supcon":
        if data.label_column is None:
            raise TrainerError(
                "--loss supcon needs labels, and the dataset has no label column "
                "(label, labels, fine_label); pass --label-column"
            )
        labels = label_ids(data.train, data.label_column)
    optimizer = _optimizer(config, model)
    model, optimizer = accelerator.prepare(model, optimizer)
    unwrapped_model = accelerator.unwrap_model(model)
    learning_rate = _warmup_cosine(config.lr, config.warmup_steps, total_steps)

    # Resume: model and optimizer state; the step gives the data position and the lr.
    step = 0
    if resume_path:
        step = _resume(accelerator, model, optimizer, resume_path, config, len(data.train))
    if step >= total_steps:
        raise TrainerError(
            f"nothing to train: the checkpoint is at step {step} and the run ends at step "
            f"{total_steps}; raise --max-steps or --epochs"
        )
    run_state = {
        "config": dataclasses.asdict(config),
        "train_samples": len(data.train),
        "world_size": world_size,
    }
    if accelerator.is_main_process:
        run.log({"start_step": step, **run_state})
    if own_accelerator:
        accelerator.init_trackers("simclr", config=_flat_for_trackers(config))
    # Every rank evaluates its share of the kNN bank and queries (contrastive_accelerate.knn).
    knn = None
    if data.evaluation is not None:
        knn = knn_data(
            data.train,
            data.evaluation,
            data.image_column,
            data.label_column,
            config.image_size,
            config.skip_bad_images,
        )
    evaluate = data.evaluation is not None
    metrics: dict[str, float] = {}
    if step == 0 and evaluate:
        metrics["knn_top1_init"] = _evaluate(accelerator, model, knn, config, run, step)

    # Loop
    loader, sampler = _train_loader(views, accelerator, config)
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
    with progress, StopSignals() as signals, _workers_stopped_on_exit(loader):
        while step < total_steps and not preempted:
            epoch, first_batch = divmod(step, steps_per_epoch)
            sampler.set_epoch(epoch, first_batch)
            for view0, view1, indices, unreadable in loader:
                # One exchange per step, before any collective of the step: every rank
                # learns whether any rank was signalled or drew an unreadable image.
                stop, broken = any_rank(
                    accelerator.device,
                    signals.requested is not None,
                    bool(unreadable) and not config.skip_bad_images,
                )
                if broken:
                    raise_together(unreadable[0] if unreadable else None)
                for image in unreadable:
                    print(f"warning: skipping {image} (--skip-bad-images)", flush=True)
                if stop:
                    preempted = signals.requested or "a signal to another rank"
                    if step != saved_step:
                        last_checkpoint = _save(
                            accelerator, run, model, optimizer, config, step, run_state
                        )
                    break

                # Each chunk holds both views of its samples: one forward over both, so
                # BatchNorm sees them together, as in SimCLR. tensor_split always gives
                # `chunks` pieces, empty ones on a rank with little or no share of a short
                # last batch, so every rank runs the same collectives.
                step_chunks = list(
                    zip(
                        view0.tensor_split(chunks),
                        view1.tensor_split(chunks),
                        indices.tensor_split(chunks),
                        strict=True,
                    )
                )

                loss = cached_backward(
                    model,
                    step_chunks,
                    partial(_global_loss, criterion, unwrapped_model, labels, indices),
                    forward=partial(_embed, model, config.seed, step, accelerator.device, dtype),
                    backward=accelerator.backward,
                )
                lr = learning_rate(step)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                progress.update(1)

                if step % config.log_every == 0 or step == total_steps:
                    # Each rank's loss is W x its share of the global loss: the mean is it.
                    metrics["loss"] = accelerator.reduce(loss.detach(), "mean").item()
                    metrics["samples_per_s"] = (
                        (step - started_step) * config.batch_size / (time.perf_counter() - started)
                    )
                    record = {
                        "loss": metrics["loss"],
                        "samples_per_s": metrics["samples_per_s"],
                        "lr": lr,
                        "epoch": epoch,
                    }
                    progress.set_postfix(loss=f"{metrics['loss']:.4f}", lr=f"{lr:.3g}")
                    accelerator.log(record, step=step)
                    if accelerator.is_main_process:
                        run.log({"step": step, **record})
                if config.save_every and step % config.save_every == 0:
                    last_checkpoint = _save(
                        accelerator, run, model, optimizer, config, step, run_state
                    )
                    saved_step = step
                if evaluate and config.eval_every and step % config.eval_every == 0:
                    if step < total_steps:
                        _evaluate(accelerator, model, knn, config, run, step)
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
    if evaluate:
        metrics["knn_top1"] = _evaluate(accelerator, model, knn, config, run, step)
    final = on_main_process(
        save_final_model, config.output_dir, unwrapped, errors=(CheckpointError,)
    )
    if accelerator.is_main_process:
        print(_summary(metrics, config, final, knn), flush=True)
    return TrainResult(unwrapped, metrics, step, final, last_checkpoint, None)


def _make_accelerator(config: TrainConfig) -> Accelerator:
    handlers = []
    if config.collective_timeout is not None:
        timeout = datetime.timedelta(seconds=config.collective_timeout)
        handlers.append(InitProcessGroupKwargs(timeout=timeout))
    return Accelerator(
        # Without an accelerator, Accelerate launched with several processes reports
        # DistributedType.NO unless told to use the CPU: every process would train alone.
        cpu=not torch.accelerator.is_available(),
        log_with=None if config.report_to == "none" else config.report_to,
        project_dir=config.output_dir,
        kwargs_handlers=handlers,
    )


def _check_launch(config: TrainConfig, accelerator: Accelerator, own_accelerator: bool) -> None:
    """Refuse, in one line, what Accelerate would run but this trainer cannot honour."""
    world_size = accelerator.num_processes
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and world_size == 1:
        raise TrainerError(
            f"launched with WORLD_SIZE={launched} but Accelerate runs one process "
            f"({accelerator.distributed_type}): each process would train alone"
        )
    if accelerator.distributed_type not in _SUPPORTED_DISTRIBUTED_TYPES:
        raise TrainerError(
            f"{accelerator.distributed_type} is not supported: the trainer keeps a full "
            "replica per process (DDP); launch with a multi-GPU, multi-CPU or single-process config"
        )
    accumulation = max(accelerator.gradient_accumulation_steps, _launcher_accumulation_steps())
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
    elif config.report_to in ("tensorboard", "wandb"):
        import importlib.util

        package = "tensorboard" if config.report_to == "tensorboard" else "wandb"
        if importlib.util.find_spec(package) is None:
            raise TrainerError(
                f"--report-to {config.report_to}: {package} is not installed "
                f"(pip install {package})"
            )


_SUPPORTED_DISTRIBUTED_TYPES = (
    DistributedType.NO,
    DistributedType.MULTI_CPU,
    DistributedType.MULTI_GPU,
    DistributedType.MULTI_XPU,
    DistributedType.MULTI_NPU,
    DistributedType.MULTI_MLU,
    DistributedType.MULTI_SDAA,
    DistributedType.MULTI_MUSA,
    DistributedType.MULTI_HPU,
)


def _launcher_accumulation_steps() -> int:
    """``accelerate launch --gradient_accumulation_steps N``, which Accelerate passes on to
    the script only for DeepSpeed and otherwise drops; read back from the launcher's
    command line (Linux), so that the option is refused rather than ignored."""
    steps = int(os.environ.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "1") or 1)
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as file:
            arguments = file.read().decode(errors="replace").split("\0")
    except OSError:
        return steps
    if not any(
        argument.endswith(("accelerate", "accelerate.commands.launch", "launch"))
        for argument in arguments[:3]
    ):
        return steps
    for index, argument in enumerate(arguments):
        if argument.endswith(".py"):
            break  # the training script: what follows are its own flags
        name, _, value = argument.partition("=")
        if name in ("--gradient_accumulation_steps", "--gradient-accumulation-steps"):
            value = value or (arguments[index + 1] if index + 1 < len(arguments) else "1")
            steps = max(steps, int(value) if value.isdigit() else 1)
    return steps


def _with_defaults(config: TrainConfig) -> TrainConfig:
    """Fill the options whose default depends on the dataset (the digits are 8x8) or the loss."""
    digits = config.dataset is None
    if config.image_size is None:
        config = dataclasses.replace(config, image_size=8 if digits else 32)
    if config.dropout is None:
        config = dataclasses.replace(config, dropout=0.1 if config.model in VIT_SIZES else 0.0)
    if config.crop_min_scale is None:
        config = dataclasses.replace(config, crop_min_scale=0.5 if digits else 0.2)
    # Barlow Twins and VICReg: their papers' LARS at 0.2 (measured on the digits, 4 epochs:
    # kNN 92.2%, where SGD at lr 1e-4..3e-3 fell to 42-83%).
    redundancy = config.loss in ("barlowtwins", "vicreg")
    if config.optimizer is None:
        config = dataclasses.replace(config, optimizer="lars" if redundancy else "sgd")
    if config.lr is None:
        config = dataclasses.replace(config, lr=0.2 if config.optimizer == "lars" else 0.03)
    return config


def _train_loader(
    views: TwoViews, accelerator: Accelerator, config: TrainConfig
) -> tuple[DataLoader, GlobalBatchSampler]:
    """This rank's share of every global batch; ``sampler.set_epoch`` picks the epoch and
    the first batch. One loader for the whole run, so its workers persist across epochs
    (safe: each item's augmentation depends on its (epoch, index), not on the worker)."""
    rank, world_size = accelerator.process_index, accelerator.num_processes
    if config.data_sharding == "accelerate":
        # Accelerate shards whole global batches and, with even_batches, pads a short
        # last batch with repeated samples: the padded-batches negative control.
        rank, world_size = 0, 1
    sampler = GlobalBatchSampler(
        len(views),
        config.batch_size,
        0,
        config.seed,
        rank,
        world_size,
        drop_last=config.drop_last,
    )
    workers = config.num_workers
    if workers is None:  # the cores this process may use beyond its own, up to 4
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes))
        workers = min(4, max(0, (cores or 1) // local_processes - 1))
    loader = DataLoader(
        views,
        batch_sampler=sampler,
        collate_fn=views.collate,
        num_workers=workers,
        persistent_workers=workers > 0,
        pin_memory=accelerator.device.type == "cuda",
        worker_init_fn=ignore_stop_signals if workers else None,
    )
    if config.data_sharding == "accelerate":
        loader = prepare_data_loader(
            loader,
            num_processes=accelerator.num_processes,
            process_index=accelerator.process_index,
            split_batches=True,
            even_batches=True,
        )
    return loader, sampler


@contextlib.contextmanager
def _workers_stopped_on_exit(loader: DataLoader):
    """Stop the loader's persistent workers when the loop ends, by an error too. They
    ignore SIGTERM (preemption is the main process's to handle), so the SIGTERM with
    which multiprocessing ends daemonic children at exit would leave the interpreter
    waiting for them forever, while an error's traceback keeps the loader alive."""
    try:
        yield
    finally:
        iterator = getattr(loader, "_iterator", None)  # DataLoader's persistent iterator
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()


def _optimizer(config: TrainConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    params = model.parameters()
    if config.optimizer == "sgd":
        return torch.optim.SGD(
            params, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay
        )
    if config.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    return LARS(params, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay)


def _criterion(config: TrainConfig) -> torch.nn.Module:
    common = {"gather_distributed": config.gather}
    tiles = {**common, "tile_rows": config.loss_tile_rows}
    if config.loss == "ntxent":
        return NTXentLoss(config.temperature, **tiles)
    if config.loss == "dcl":
        return DCLLoss(config.temperature, **tiles)
    if config.loss == "dclw":
        return DCLWLoss(config.temperature, sigma=config.dclw_sigma, **tiles)
    if config.loss == "supcon":
        return SupConLoss(config.temperature, rescale=config.supcon_rescale, **tiles)
    if config.loss == "infonce":
        return InfoNCELoss(**tiles)
    if config.loss == "siglip":
        return SigLIPLoss(tile_columns=config.loss_tile_rows, **common)
    if config.loss == "barlowtwins":
        return BarlowTwinsLoss(config.barlow_lambda, **common)
    return VICRegLoss(config.vicreg_lambda, config.vicreg_mu, config.vicreg_nu, **common)


def _logit_scale_init(config: TrainConfig) -> float | None:
    if config.loss not in ("infonce", "siglip"):
        return None
    if config.logit_scale_init is not None:
        return config.logit_scale_init
    return 1 / 0.07 if config.loss == "infonce" else 10.0


def _embed(model, seed: int, step: int, device, dtype, chunk) -> torch.Tensor:
    """The projections of one chunk's two views; dropout keyed by each sample's dataset index."""
    view0, view1, indices = chunk
    # Each view goes to the device as it comes from the loader (pinned on CUDA, so the
    # copies are asynchronous), then they are joined there: a join on the host would copy
    # them into unpinned memory first, whose upload makes the host wait.
    images = torch.cat([view.to(device, dtype, non_blocking=True) for view in (view0, view1)])
    keys = torch.cat([sample_keys(seed, step, indices, view) for view in (0, 1)])
    # A few hundred int64s from unpinned memory: staged by the driver, no wait either.
    with sample_randomness(keys.to(device, non_blocking=True)):
        return model(images)


def _global_loss(criterion, model: SimCLR, labels, indices, outputs) -> torch.Tensor:
    """The loss of this rank's whole share, from every chunk's ``_embed`` output."""
    out0 = torch.cat([output[: len(output) // 2] for output in outputs])
    out1 = torch.cat([output[len(output) // 2 :] for output in outputs])
    return _loss(criterion, model, out0, out1, labels, indices)


def _loss(criterion, model: SimCLR, out0, out1, labels, indices) -> torch.Tensor:
    """The configured loss of one batch's projections; the CLIP-style losses take
    normalised features and the model's learnable scale (and bias), as in open_clip."""
    if isinstance(criterion, SupConLoss):
        return criterion(out0, out1, labels[indices].to(out0.device))
    if isinstance(criterion, InfoNCELoss | SigLIPLoss):
        features0, features1 = F.normalize(out0, dim=1), F.normalize(out1, dim=1)
        if isinstance(criterion, InfoNCELoss):
            return criterion(features0, features1, model.logit_scale)
        return criterion(features0, features1, model.logit_scale, model.logit_bias)
    return criterion(out0, out1)


def _warmup_cosine(peak: float, warmup_steps: int, total_steps: int):
    """The learning rate of step ``s`` (0-based): linear warm-up, then cosine to zero.
    A function of the step alone, so a checkpoint needs no scheduler state."""
    warmup_steps = min(warmup_steps, total_steps)

    def learning_rate(step: int) -> float:
        if step < warmup_steps:
            return peak * (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return peak * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return learning_rate


# Checkpoints: safetensors and JSON only (contrastive_accelerate.checkpoint), written by
# the main process; model and optimizer states are identical on every rank.


def _save(accelerator, run, model, optimizer, config, step, state) -> str:
    path = on_main_process(
        save_checkpoint,
        config.output_dir,
        step,
        accelerator.unwrap_model(model),
        optimizer,
        state["config"],
        state["train_samples"],
        state["world_size"],
        errors=(CheckpointError,),
    )
    if config.save_total_limit and accelerator.is_main_process:
        run.prune(config.save_total_limit)
    return path


def _resume(accelerator, model, optimizer, path, config: TrainConfig, train_samples) -> int:
    """Load ``path`` into the model and optimizer; returns its step.

    Every option that shapes the optimisation was saved with the checkpoint: a
    difference is applied and said (``resume="apply"``) or refused (``"refuse"``).
    """
    checkpoint = load_checkpoint(path)
    changed, refused = [], []
    current = dataclasses.asdict(config)
    for name, rule in resume_rules(TrainConfig).items():
        if rule == "free":
            continue
        if name not in checkpoint.config:
            refused.append(f"--{name.replace('_', '-')} (not in the checkpoint)")
        elif checkpoint.config[name] != current[name]:
            entry = f"--{name.replace('_', '-')} {checkpoint.config[name]!r} -> {current[name]!r}"
            (changed if rule == "apply" else refused).append(entry)
    if refused:
        raise TrainerError(
            f"--resume-from {path!r}: this run differs from the checkpoint's in "
            f"{'; '.join(refused)}; these must match to continue it"
        )
    if checkpoint.train_samples != train_samples:
        raise TrainerError(
            f"--resume-from {path!r}: the checkpoint's run trained on {checkpoint.train_samples} "
            f"images, this one has {train_samples} (the dataset, --eval-holdout or --knn-k 0 "
            "changed what is held out)"
        )
    load_model_state(accelerator.unwrap_model(model), checkpoint)
    load_optimizer_state(optimizer, checkpoint)
    for entry in changed:
        accelerator.print(f"resume: applying {entry}")
    accelerator.print(f"resumed from {path} at step {checkpoint.step}")
    return checkpoint.step


def _evaluate(accelerator, model, knn: KnnData | None, config, run, step: int) -> float:
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.eval()
    accuracy = knn_top1(unwrapped, knn, k=config.knn_k)
    unwrapped.train()
    accelerator.log({"knn_top1": accuracy}, step=step)
    if accelerator.is_main_process:
        run.log({"step": step, "knn_top1": accuracy})
    return accuracy


def _summary(metrics: dict[str, float], config: TrainConfig, final: str, knn) -> str:
    lines = [f"final model: {final}"]
    if "loss" in metrics:
        lines.append(f"final loss: {metrics['loss']:.4f}")
    if knn is not None:
        line = f"kNN top-1 (k={config.knn_k}, {len(knn.query_labels)} held-out images):"
        if "knn_top1_init" in metrics:
            line += f" random init {metrics['knn_top1_init']:.1%} ->"
        lines.append(f"{line} trained {metrics['knn_top1']:.1%}")
    return "\n".join(lines)


def _flat_for_trackers(config: TrainConfig) -> dict:
    # TensorBoard's hparams take numbers, strings and booleans only.
    return {
        key: "none" if value is None else value for key, value in dataclasses.asdict(config).items()
    }


def main(argv: list[str] | None = None) -> None:
    result = None
    try:
        config = parse_args(TrainConfig, argv, description=__doc__.split("\n")[0])
        result = train(config)
    except (ValueError, RuntimeError) as error:
        if isinstance(error, RuntimeError) and not _collective_failure(error):
            raise  # a bug: keep its traceback
        # Every rank validates the same inputs, so every rank exits here: no hang.
        # One write per line: the ranks share the launcher's stderr and must not interleave.
        text = " ".join(str(error).split()) or type(error).__name__
        lost_contact = isinstance(error, RuntimeError)
        if lost_contact:
            text = re.sub(r"^\[[^]]*\]\s*", "", text)  # gloo's source-location prefix
            text = f"lost contact with another process (stalled or died): {text[:200]}"
        sys.stderr.flush()
        os.write(sys.stderr.fileno(), f"error: {text}\n".encode())
        if not lost_contact:  # a stalled or dead peer would never arrive
            settle_before_exit()
        sys.exit(2)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if result.preempted:
        # The checkpoint is written: a launcher's forwarded copy of the signal must not
        # turn this exit into a death by signal while the interpreter shuts down.
        ignore_stop_signals()
        sys.exit(EXIT_PREEMPTED)


def _collective_failure(error: RuntimeError) -> bool:
    """A collective that timed out or lost its peer. gloo raises plain RuntimeErrors, from
    torch.distributed or from inside DDP's backward; their text names the transport."""
    if isinstance(error, dist.DistError) or re.search(r"gloo|nccl|c10d", str(error), re.I):
        return True
    frames = traceback.extract_tb(error.__traceback__)
    return any(f"torch{os.sep}distributed{os.sep}" in frame.filename for frame in frames[-3:])


if __name__ == "__main__":
    main()
