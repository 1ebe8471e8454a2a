"""SimCLR pre-training with HuggingFace Accelerate, identical on 1 or N processes.

    accelerate launch trainer.py                                    # one process, digits
    accelerate launch --config_file accelerate_configs/cpu_2_processes.yaml trainer.py
    from trainer import TrainConfig, train                          # inside your own pipeline

``--batch-size`` is the *global* batch: the same command line trains the same
model on any number of processes (see README for the measured tolerances).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.tracking import GeneralTracker
from accelerate.utils import DataLoaderConfiguration, set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from contrastive_accelerate.data import (
    DataError,
    GlobalBatchSampler,
    TwoViews,
    batches_per_epoch,
    evaluation_images,
    load_image_dataset,
)
from contrastive_accelerate.lars import LARS
from losses import NTXentLoss
from models import BACKBONES, SimCLR, convert_sync_batchnorm

OPTIMIZERS = ("sgd", "adamw", "lars")
DTYPES = {"float32": torch.float32, "float64": torch.float64}
STATE_FILE = "trainer_state.json"


class TrainerError(ValueError):
    """A configuration or input problem: reported as one line on every rank."""


@dataclass
class TrainConfig:
    dataset: str | None = None  # hub name or local path for datasets.load_dataset; None: digits
    image_column: str | None = None  # None: the first of image / img / pixel_values
    image_size: int | None = None  # None: 8 for the default digits (their size), else 32
    model: str = "resnet18"
    batch_size: int = 128  # global: split across processes
    epochs: int = 30
    max_steps: int | None = None  # overrides epochs
    drop_last: bool = False
    optimizer: str = "sgd"
    lr: float = 0.03  # SGD: 0.06 x batch / 256 (lightly's CIFAR-10 recipe)
    momentum: float = 0.9
    weight_decay: float = 5e-4
    warmup_steps: int = 10
    temperature: float = 0.5
    augment: bool = True
    # RandomResizedCrop's smallest area fraction. None: 0.5 for the 8x8 digits (a 20% crop
    # keeps ~3x3 of their pixels, and kNN fell below the random-init encoder), else 0.2
    # (SimCLR's CIFAR setting).
    crop_min_scale: float | None = None
    dtype: str = "float32"
    seed: int = 0
    num_workers: int = 0
    output_dir: str = "runs/simclr"
    save_every: int = 0  # steps between checkpoints; 0: none
    resume_from: str | None = None
    eval_every: int = 0  # steps between kNN evaluations; 0: at start and end only
    knn_k: int = 20
    log_every: int = 10
    gather: bool = True  # False: each rank uses only local negatives (a different objective)
    loss_tile_rows: int | None = None  # None: dense until the logits pass 1 GiB, then tiled
    sync_batchnorm: bool = True  # BatchNorm statistics over the global batch when W > 1
    # The two below exist to reproduce what breaks world-size invariance elsewhere:
    augmentation_seeding: str = "per-sample"  # or "per-process": seed + rank, global RNG
    data_sharding: str = "exact"  # or "accelerate": Accelerate pads short batches (even_batches)


def train(config: TrainConfig) -> dict[str, float]:
    """Train SimCLR as ``config`` says; returns the final metrics."""
    # Without an accelerator, Accelerate launched with several processes reports
    # DistributedType.NO unless told to use the CPU: every process would train alone.
    accelerator = Accelerator(
        cpu=not torch.accelerator.is_available(),
        log_with=_trackers(config.output_dir),
        project_dir=config.output_dir,
        # Used only by --data-sharding accelerate: each rank takes a slice of a global batch.
        dataloader_config=DataLoaderConfiguration(split_batches=True),
    )
    digits = config.dataset is None
    if config.image_size is None:
        config = dataclasses.replace(config, image_size=8 if digits else 32)
    if config.crop_min_scale is None:
        config = dataclasses.replace(config, crop_min_scale=0.5 if digits else 0.2)
    _check_config(config, accelerator)
    world_size = accelerator.num_processes
    dtype = DTYPES[config.dtype]
    accelerator.init_trackers("simclr", config=dataclasses.asdict(config))
    set_seed(config.seed)  # identical initial weights on every rank

    # Data: the global batch and each sample's augmentation depend on (seed, epoch, index) only.
    train_set, eval_set, image_column, label_column = load_image_dataset(
        config.dataset, config.image_column
    )
    per_sample_seed = config.augmentation_seeding == "per-sample"
    views = TwoViews(
        train_set,
        image_column,
        config.image_size,
        config.seed,
        config.augment,
        per_sample_seed=per_sample_seed,
        crop_min_scale=config.crop_min_scale,
    )
    steps_per_epoch = batches_per_epoch(len(train_set), config.batch_size, config.drop_last)
    if steps_per_epoch == 0:
        raise TrainerError(
            f"--batch-size {config.batch_size} exceeds the {len(train_set)} training samples "
            "with --drop-last"
        )
    total_steps = config.max_steps or config.epochs * steps_per_epoch

    # Model, loss, optimizer
    model = SimCLR(backbone=config.model, image_size=config.image_size).to(dtype)
    if world_size > 1 and config.sync_batchnorm:
        model = convert_sync_batchnorm(model)
    if world_size > 1 and any(
        isinstance(m, torch.nn.modules.dropout._DropoutNd) for m in model.modules()
    ):
        accelerator.print(
            "warning: the model has dropout, whose masks depend on the process: "
            "training is not world-size invariant"
        )
    if not per_sample_seed:
        set_seed(config.seed, device_specific=True)  # the common practice: seed + rank
    criterion = NTXentLoss(
        temperature=config.temperature,
        gather_distributed=config.gather,
        tile_rows=config.loss_tile_rows,
    )
    optimizer = _optimizer(config, model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, _warmup_cosine(config.warmup_steps, total_steps)
    )
    model, optimizer = accelerator.prepare(model, optimizer)
    # Not prepared: Accelerate would step it once per process per step.
    accelerator.register_for_checkpointing(scheduler)

    step = 0
    if config.resume_from:
        step = _load_checkpoint(accelerator, config)
    # Every rank must agree on when to evaluate (it ends in a barrier); only the main
    # process evaluates, so only it prepares the images.
    evaluate = eval_set is not None and config.knn_k > 0
    knn_data = None
    if evaluate and accelerator.is_main_process:
        knn_data = _knn_data(eval_set, train_set, image_column, label_column, config)
    metrics: dict[str, float] = {}
    if step == 0 and evaluate:
        metrics["knn_top1_init"] = _evaluate(accelerator, model, knn_data, config, step)

    # Loop
    progress = tqdm(
        total=total_steps,
        initial=step,
        disable=not accelerator.is_main_process,
        desc="training",
        dynamic_ncols=True,
    )
    started, started_step = time.perf_counter(), step
    while step < total_steps:
        epoch, first_batch = divmod(step, steps_per_epoch)
        loader = _train_loader(views, accelerator, config, epoch, first_batch)
        for view0, view1 in loader:
            images = torch.cat([view0, view1]).to(accelerator.device, dtype)
            # One forward over both views: BatchNorm sees the whole batch, as in SimCLR.
            out0, out1 = model(images).split(len(view0))
            loss = criterion(out0, out1)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            progress.update(1)

            if step % config.log_every == 0 or step == total_steps:
                # Each rank's loss is W x its share of the global loss: the mean is the loss.
                metrics["loss"] = accelerator.reduce(loss.detach(), "mean").item()
                metrics["samples_per_s"] = (
                    (step - started_step) * config.batch_size / (time.perf_counter() - started)
                )
                lr = scheduler.get_last_lr()[0]
                progress.set_postfix(
                    loss=f"{metrics['loss']:.4f}",
                    lr=f"{lr:.3g}",
                    samples_per_s=f"{metrics['samples_per_s']:.0f}",
                )
                accelerator.log(
                    {
                        "loss": metrics["loss"],
                        "samples_per_s": metrics["samples_per_s"],
                        "lr": lr,
                        "epoch": epoch,
                    },
                    step=step,
                )
            if config.save_every and step % config.save_every == 0:
                _save_checkpoint(accelerator, config, step)
            if (
                evaluate
                and config.eval_every
                and step % config.eval_every == 0
                and step < total_steps
            ):
                _evaluate(accelerator, model, knn_data, config, step)
            if step == total_steps:
                break
    progress.close()

    # Save
    if evaluate:
        metrics["knn_top1"] = _evaluate(accelerator, model, knn_data, config, step)
    _save_final_model(accelerator, model, config)
    if accelerator.is_main_process:
        print(_summary(metrics, config, knn_data), flush=True)
    accelerator.end_training()
    return metrics


def _train_loader(
    views: TwoViews, accelerator: Accelerator, config: TrainConfig, epoch: int, first_batch: int
) -> DataLoader:
    """This rank's share of each global batch of ``epoch``, from batch ``first_batch`` on."""
    rank, world_size = accelerator.process_index, accelerator.num_processes
    if config.data_sharding == "accelerate":
        # Accelerate shards whole global batches and, with even_batches, pads a short
        # last batch with repeated samples: the padded-batches negative control.
        rank, world_size = 0, 1
    sampler = GlobalBatchSampler(
        len(views),
        config.batch_size,
        epoch,
        config.seed,
        rank,
        world_size,
        drop_last=config.drop_last,
        start_batch=first_batch,
    )
    loader = DataLoader(
        views, batch_sampler=sampler, collate_fn=views.collate, num_workers=config.num_workers
    )
    if config.data_sharding == "accelerate":
        loader = accelerator.prepare_data_loader(loader)
    return loader


def _check_config(config: TrainConfig, accelerator: Accelerator) -> None:
    world_size = accelerator.num_processes
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and world_size == 1:
        raise TrainerError(
            f"launched with WORLD_SIZE={launched} but Accelerate runs one process "
            f"({accelerator.distributed_type}): each process would train alone"
        )
    if config.batch_size < 2 or config.batch_size % world_size:
        raise TrainerError(
            f"--batch-size {config.batch_size} is the global batch: it must be >= 2 and "
            f"divisible by the {world_size} processes"
        )
    if config.model not in BACKBONES:
        raise TrainerError(f"--model {config.model!r}: choose one of {', '.join(BACKBONES)}")
    if config.optimizer not in OPTIMIZERS:
        raise TrainerError(
            f"--optimizer {config.optimizer!r}: choose one of {', '.join(OPTIMIZERS)}"
        )
    if config.dtype not in DTYPES:
        raise TrainerError(f"--dtype {config.dtype!r}: choose one of {', '.join(DTYPES)}")
    if config.dtype == "float64" and accelerator.mixed_precision != "no":
        raise TrainerError("--dtype float64 cannot be combined with mixed precision")
    if not (config.temperature > 0 and config.lr > 0):
        raise TrainerError("--temperature and --lr must be positive")
    if config.max_steps is not None and config.max_steps < 1:
        raise TrainerError("--max-steps must be >= 1")
    if config.augmentation_seeding not in ("per-sample", "per-process"):
        raise TrainerError("--augmentation-seeding: choose per-sample or per-process")
    if config.data_sharding not in ("exact", "accelerate"):
        raise TrainerError("--data-sharding: choose exact or accelerate")


def _optimizer(config: TrainConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    params = model.parameters()
    if config.optimizer == "sgd":
        return torch.optim.SGD(
            params, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay
        )
    if config.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    return LARS(params, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay)


def _warmup_cosine(warmup_steps: int, total_steps: int):
    warmup_steps = min(warmup_steps, total_steps)

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return factor


# Checkpoints. A checkpoint is written under a temporary name and renamed when
# complete, so a crash mid-write never leaves a directory that looks finished.


def _save_checkpoint(accelerator: Accelerator, config: TrainConfig, step: int) -> None:
    final = os.path.join(config.output_dir, f"checkpoint-{step}")
    partial = os.path.join(config.output_dir, f".checkpoint-{step}.partial")
    if accelerator.is_main_process and os.path.exists(partial):
        shutil.rmtree(partial)
    accelerator.wait_for_everyone()
    accelerator.save_state(partial)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        state = {
            "step": step,
            "batch_size": config.batch_size,
            "seed": config.seed,
            "dataset": config.dataset,
            "model": config.model,
            "dtype": config.dtype,
        }
        with open(os.path.join(partial, STATE_FILE), "w") as file:
            json.dump(state, file, indent=2)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(partial, final)
    accelerator.wait_for_everyone()


def _load_checkpoint(accelerator: Accelerator, config: TrainConfig) -> int:
    path = config.resume_from
    state_file = os.path.join(path, STATE_FILE)
    if not os.path.isdir(path):
        raise TrainerError(f"--resume-from {path!r}: no such checkpoint directory")
    try:
        with open(state_file) as file:
            state = json.load(file)
        step = int(state["step"])
    except (OSError, ValueError, KeyError, TypeError):
        raise TrainerError(
            f"--resume-from {path!r}: incomplete checkpoint (no valid {STATE_FILE})"
        ) from None
    for key in ("batch_size", "seed", "model", "dtype"):
        if state.get(key) != getattr(config, key):
            raise TrainerError(
                f"--resume-from {path!r}: checkpoint has {key}={state.get(key)!r}, "
                f"this run has {getattr(config, key)!r}"
            )
    try:
        accelerator.load_state(path)
    except Exception as error:  # torch/safetensors raise many types for a damaged file
        message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise TrainerError(f"--resume-from {path!r}: corrupt checkpoint: {message}") from None
    return step


def _save_final_model(accelerator: Accelerator, model, config: TrainConfig) -> None:
    final = os.path.join(config.output_dir, "final")
    partial = os.path.join(config.output_dir, ".final.partial")
    if accelerator.is_main_process:
        shutil.rmtree(partial, ignore_errors=True)
        accelerator.unwrap_model(model).save_pretrained(partial)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
    accelerator.wait_for_everyone()


# kNN evaluation: top-1 accuracy of a weighted k-nearest-neighbour classifier on
# encoder features (Wu et al., 2018), a standard probe of representation quality.


def _knn_data(eval_set, train_set, image_column, label_column, config: TrainConfig) -> dict:
    bank = train_set.select(range(min(len(train_set), 10_000)))
    return {
        "bank_images": evaluation_images(bank, image_column, config.image_size),
        "bank_labels": torch.tensor(bank[label_column]),
        "query_images": evaluation_images(eval_set, image_column, config.image_size),
        "query_labels": torch.tensor(eval_set[label_column]),
    }


@torch.no_grad()
def knn_top1(
    model: SimCLR,
    bank_images,
    bank_labels,
    query_images,
    query_labels,
    k: int = 20,
    temperature: float = 0.07,
    batch_size: int = 256,
) -> float:
    """Top-1 accuracy of a cosine-similarity kNN classifier with exp(sim / t) weighted votes."""
    parameter = next(model.parameters())

    def features(images: torch.Tensor) -> torch.Tensor:
        chunks = [
            model.embed(chunk.to(parameter.device, parameter.dtype))
            for chunk in images.split(batch_size)
        ]
        return F.normalize(torch.cat(chunks), dim=1)

    bank, queries = features(bank_images), features(query_images)
    bank_labels = bank_labels.to(bank.device)
    similarity, neighbours = (queries @ bank.T).topk(min(k, len(bank)), dim=1)
    votes = torch.zeros(
        len(queries), int(bank_labels.max()) + 1, device=bank.device, dtype=bank.dtype
    )
    votes.scatter_add_(1, bank_labels[neighbours], (similarity / temperature).exp())
    return (votes.argmax(1).cpu() == query_labels).double().mean().item()


def _evaluate(accelerator: Accelerator, model, knn_data, config: TrainConfig, step: int) -> float:
    accuracy = float("nan")
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model)
        unwrapped.eval()
        accuracy = knn_top1(unwrapped, **knn_data, k=config.knn_k)
        unwrapped.train()
        accelerator.log({"knn_top1": accuracy}, step=step)
    accelerator.wait_for_everyone()
    return accuracy


def _summary(metrics: dict[str, float], config: TrainConfig, knn_data) -> str:
    lines = [f"final model: {os.path.join(config.output_dir, 'final')}"]
    if "loss" in metrics:
        lines.append(f"final loss: {metrics['loss']:.4f}")
    if knn_data:
        held_out = len(knn_data["query_labels"])
        line = f"kNN top-1 (k={config.knn_k}, {held_out} held-out images):"
        if "knn_top1_init" in metrics:
            line += f" random init {metrics['knn_top1_init']:.1%} ->"
        lines.append(f"{line} trained {metrics['knn_top1']:.1%}")
    return "\n".join(lines)


class JSONLTracker(GeneralTracker):
    """Accelerate tracker writing one JSON object per ``accelerator.log`` call."""

    name = "jsonl"
    requires_logging_directory = True

    def __init__(self, logging_dir: str) -> None:
        super().__init__()
        self.path = os.path.join(logging_dir, "metrics.jsonl")

    @property
    def tracker(self):
        return self.path

    def start(self) -> None:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)

    def store_init_configuration(self, values: dict) -> None:
        self._write({"config": values})

    def log(self, values: dict, step: int | None = None, **kwargs) -> None:
        self._write({"step": step, **values})

    def _write(self, record: dict) -> None:
        with open(self.path, "a") as file:
            file.write(json.dumps(record) + "\n")


def _trackers(output_dir: str) -> list:
    trackers: list = [JSONLTracker(output_dir)]
    try:
        import tensorboard  # noqa: F401

        trackers.append("tensorboard")
    except ImportError:
        pass
    return trackers


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    defaults = TrainConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add(
        "--dataset",
        default=defaults.dataset,
        help="hub name or local path (e.g. an image folder) for datasets.load_dataset; "
        "default: scikit-learn's digits, offline",
    )
    add("--image-column", default=defaults.image_column)
    add(
        "--image-size",
        type=int,
        default=defaults.image_size,
        help="default: 8 for the default digits (their native size), else 32",
    )
    add("--model", default=defaults.model, choices=BACKBONES)
    add(
        "--batch-size",
        type=int,
        default=defaults.batch_size,
        help="global batch size (pairs), split across processes",
    )
    add("--epochs", type=int, default=defaults.epochs)
    add("--max-steps", type=int, default=defaults.max_steps, help="overrides --epochs")
    add("--drop-last", action=argparse.BooleanOptionalAction, default=defaults.drop_last)
    add("--optimizer", default=defaults.optimizer, choices=OPTIMIZERS)
    add("--lr", type=float, default=defaults.lr)
    add("--momentum", type=float, default=defaults.momentum)
    add("--weight-decay", type=float, default=defaults.weight_decay)
    add("--warmup-steps", type=int, default=defaults.warmup_steps)
    add("--temperature", type=float, default=defaults.temperature)
    add("--augment", action=argparse.BooleanOptionalAction, default=defaults.augment)
    add(
        "--crop-min-scale",
        type=float,
        default=defaults.crop_min_scale,
        help="smallest crop area fraction; default: 0.5 for the default digits, else 0.2",
    )
    add(
        "--dtype",
        default=defaults.dtype,
        choices=tuple(DTYPES),
        help="float64 for exactness checks; mixed precision is Accelerate's --mixed_precision",
    )
    add("--seed", type=int, default=defaults.seed)
    add("--num-workers", type=int, default=defaults.num_workers)
    add("--output-dir", default=defaults.output_dir)
    add("--save-every", type=int, default=defaults.save_every)
    add("--resume-from", default=defaults.resume_from)
    add("--eval-every", type=int, default=defaults.eval_every)
    add("--knn-k", type=int, default=defaults.knn_k, help="0 disables the kNN evaluation")
    add("--log-every", type=int, default=defaults.log_every)
    add(
        "--gather",
        action=argparse.BooleanOptionalAction,
        default=defaults.gather,
        help="--no-gather: negatives from the local batch only (not the global objective)",
    )
    add(
        "--sync-batchnorm",
        action=argparse.BooleanOptionalAction,
        default=defaults.sync_batchnorm,
        help="BatchNorm statistics over the global batch when several processes run",
    )
    add(
        "--augmentation-seeding",
        default=defaults.augmentation_seeding,
        choices=("per-sample", "per-process"),
        help="per-sample (world-size invariant) or per-process (seed + rank, for comparison)",
    )
    add(
        "--data-sharding",
        default=defaults.data_sharding,
        choices=("exact", "accelerate"),
        help="exact (no padding) or accelerate (Accelerate's even_batches padding, for comparison)",
    )
    return TrainConfig(
        **{key.replace("-", "_"): value for key, value in vars(parser.parse_args(argv)).items()}
    )


def main(argv: list[str] | None = None) -> None:
    config = parse_args(argv)
    try:
        train(config)
    except (TrainerError, DataError, ValueError) as error:
        # Every rank validates the same inputs, so every rank exits here: no hang.
        # One write per line: the ranks share the launcher's stderr and must not interleave.
        sys.stderr.flush()
        os.write(sys.stderr.fileno(), f"error: {error}\n".encode())
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        sys.exit(2)


if __name__ == "__main__":
    main()
