"""Trainer throughput vs a minimal hand-written Accelerate loop; augmentation seeding cost.

Both loops train the same model (SimCLR ResNet-18) on the same data (digits, the
same SimCLR augmentation) with the same loss and optimizer, one process. The
baseline is what a user would write in ten lines: a shuffled DataLoader prepared
by Accelerate, augmentations from the global RNG. The runs alternate; each
reports samples/s from its first to its last step, the median is kept.
"""

from __future__ import annotations

import statistics
import tempfile
import time

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, Dataset

from contrastive_accelerate.data import (
    GlobalBatchSampler,
    TwoViews,
    derive_seed,
    load_image_dataset,
)
from losses import NTXentLoss
from models import SimCLR
from trainer import TrainConfig, train


class _IndexToItem(Dataset):
    """Plain integer indices for the baseline's ordinary shuffled DataLoader."""

    def __init__(self, views: TwoViews) -> None:
        self.views = views

    def __len__(self) -> int:
        return len(self.views)

    def __getitem__(self, index: int):
        return self.views[(0, index)]


def hand_written_loop(config: TrainConfig, accelerator: Accelerator | None = None) -> float:
    config = config.resolved()  # the same derived defaults as the trainer's (temperature)
    accelerator = accelerator or Accelerator(cpu=True)
    torch.manual_seed(config.seed)
    data = load_image_dataset(None)
    views = TwoViews(
        data.train, data.image_column, config.image_size, config.seed, per_sample_seed=False
    )
    loader = DataLoader(
        _IndexToItem(views), batch_size=config.batch_size, shuffle=True, drop_last=True
    )
    model = SimCLR(backbone=config.model, image_size=config.image_size, dropout=config.dropout)
    optimizer = torch.optim.SGD(
        model.parameters(), lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay
    )
    criterion = NTXentLoss(temperature=config.temperature)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    step, started = 0, time.perf_counter()
    while step < config.max_steps:
        for view0, view1, _ in loader:
            out0, out1 = model(torch.cat([view0, view1])).split(len(view0))
            loss = criterion(out0, out1)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step == config.max_steps:
                break
    loss.item()
    return config.max_steps * config.batch_size / (time.perf_counter() - started)


def trainer_throughput(
    steps: int = 20,
    batch_size: int = 64,
    image_size: int = 16,
    repeats: int = 3,
    model: str = "resnet18",
    num_workers: int | None = None,
) -> dict:
    """Median samples/s of the trainer and of ``hand_written_loop``, alternated, on
    ``model``; ``ratio`` is the trainer's over the loop's."""
    samples_per_s: dict[str, list[float]] = {"trainer": [], "hand_written": []}
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as output_dir:
            config = TrainConfig(
                model=model, lr=0.03, max_steps=steps, batch_size=batch_size,
                image_size=image_size, knn_k=0, log_every=steps, num_workers=num_workers,
                output_dir=output_dir,
            )  # fmt: skip
            samples_per_s["trainer"].append(train(config).metrics["samples_per_s"])
            samples_per_s["hand_written"].append(hand_written_loop(config))
    medians = {name: statistics.median(values) for name, values in samples_per_s.items()}
    return {
        "model": model,
        "samples_per_s": medians,
        "steps": steps,
        "batch_size": batch_size,
        "image_size": image_size,
        "ratio": medians["trainer"] / medians["hand_written"],
    }


def augmentation_cost(items: int = 1000, image_size: int = 32, repeats: int = 5) -> dict:
    """Seconds per two-view item, per-sample seeded vs the global RNG, and the seeding alone.

    End to end, the two variants draw different crops and jitters, whose cost varies
    (colour jitter dominates and applies with p=0.8), so their ratio carries that
    sampling noise; the seeding itself is timed in isolation too.
    """
    data = load_image_dataset(None)
    variants = {
        "per_sample_seed": TwoViews(data.train, data.image_column, image_size, 0),
        "global_rng": TwoViews(data.train, data.image_column, image_size, 0, per_sample_seed=False),
    }
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    for repeat in range(repeats):
        order = list(variants.items())
        for name, views in order if repeat % 2 else reversed(order):  # no position bias
            started = time.perf_counter()
            for index in range(items):
                views[(repeat, index % len(views))]
            seconds[name].append((time.perf_counter() - started) / items)
    medians = {name: statistics.median(values) for name, values in seconds.items()}

    generator = torch.default_generator
    started = time.perf_counter()
    for index in range(10_000):
        state = generator.get_state()
        generator.manual_seed(derive_seed(0, 0, 0, index))
        generator.set_state(state)
    seeding = (time.perf_counter() - started) / 10_000
    return {
        "seconds_per_item": medians,
        "image_size": image_size,
        "ratio": medians["per_sample_seed"] / medians["global_rng"],
        "seeding_seconds_per_item": seeding,
    }


def loader_throughput(
    epochs: int = 3, batch_size: int = 128, image_size: int = 32, repeats: int = 2
) -> dict:
    """Pairs per second that the training loader yields (digits, SimCLR augmentations):
    no workers, 2 workers started afresh every epoch (the trainer before), and 2
    persistent workers serving every epoch through ``GlobalBatchSampler.set_epoch``."""
    data = load_image_dataset(None)
    views = TwoViews(data.train, data.image_column, image_size, 0)
    variants = {"no_workers": (0, False), "2_workers": (2, False), "2_persistent": (2, True)}
    pairs_per_s: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, (workers, persistent) in variants.items():
            sampler = GlobalBatchSampler(len(views), batch_size, 0, 0)
            loader = DataLoader(
                views,
                batch_sampler=sampler,
                collate_fn=views.collate,
                num_workers=workers,
                persistent_workers=persistent,
            )
            started, pairs = time.perf_counter(), 0
            for epoch in range(epochs):
                sampler.set_epoch(epoch)
                epoch_loader = (
                    loader
                    if persistent or not workers
                    else DataLoader(
                        views, batch_sampler=sampler, collate_fn=views.collate, num_workers=workers
                    )
                )
                for view0, _, _, _ in epoch_loader:
                    pairs += len(view0)
            pairs_per_s[name].append(pairs / (time.perf_counter() - started))
            del loader
    return {
        "epochs": epochs,
        "batch_size": batch_size,
        "image_size": image_size,
        "pairs_per_s": {name: statistics.median(values) for name, values in pairs_per_s.items()},
    }
