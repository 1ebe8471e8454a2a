"""lightly's own DINO and BYOL on the digits, beside ours: does their recipe learn where
ours does not?

Everything but the method is ours and the same as the README's first command with
``--method NAME``: the digits and their held-out split, the augmentations (two views;
DINO's multi-crop) in the same global batch order, the ResNet-18 encoder with the same
initial weights, SGD with the same learning rate, warm-up and cosine schedule, weight
decay and momentum, the budget in steps, and the kNN and linear-probe evaluation. The
method is lightly's (1.6): for DINO ``DINOProjectionHead``, ``DINOLoss`` (its center
and teacher temperature), ``cancel_last_layer_gradients``; for BYOL its projection and
prediction heads and ``NegativeCosineSimilarity``; for both ``update_momentum`` with
``cosine_schedule`` from the method's base momentum to 1. The heads have our sizes.

    python -m benchmarks.lightly_methods --method dino --seed 0     # one run, ~12 min
    python -m benchmarks.lightly_methods --quick                    # 3 steps each (smoke)
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import torch
from torch import nn

from contrastive_accelerate.data import batches_per_epoch
from contrastive_accelerate.data.sampler import GlobalBatchSampler
from contrastive_accelerate.knn import knn_data, knn_top1
from contrastive_accelerate.linear_probe import linear_probe_top1
from contrastive_accelerate.methods import METHODS
from contrastive_accelerate.optim import warmup_cosine
from trainer import TrainConfig

LIGHTLY_METHODS = ("dino", "byol")


class _Encoder(nn.Module):
    """The trained backbone as the evaluation takes it: ``embed`` gives its features."""

    def __init__(self, backbone: nn.Module) -> None:
        super().__init__()
        self.backbone = backbone

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        return self.backbone(images)


def _dino(backbone: nn.Module, config, ours) -> tuple[nn.Module, callable]:
    """lightly's DINO: student and teacher backbone + ``DINOProjectionHead``; returns the
    student's modules and one training step."""
    from lightly.loss import DINOLoss
    from lightly.models.modules import DINOProjectionHead
    from lightly.models.utils import deactivate_requires_grad, update_momentum
    from lightly.utils.scheduler import cosine_schedule

    head = ours.model.projection_head  # our DINOHead's sizes
    sizes = (head.mlp[0].in_features, head.mlp[0].out_features, head.mlp[-1].out_features,
             config.dino_out_dim)  # fmt: skip
    student = nn.ModuleDict({
        "backbone": backbone,
        "head": DINOProjectionHead(*sizes, batch_norm=head.batch_norm,
                                   freeze_last_layer=config.freeze_last_layer),
    })  # fmt: skip
    # As lightly's example builds it: the teacher's head is a head of its own (its weight
    # norm cannot be deep-copied), the backbone a copy of the student's.
    teacher = nn.ModuleDict(
        {
            "backbone": copy.deepcopy(backbone),
            "head": DINOProjectionHead(*sizes, batch_norm=head.batch_norm),
        }
    )
    deactivate_requires_grad(teacher)
    criterion = DINOLoss(output_dim=config.dino_out_dim, warmup_teacher_temp=0.04,
                         teacher_temp=config.teacher_temperature,
                         warmup_teacher_temp_epochs=0, student_temp=config.temperature,
                         center_momentum=config.center_momentum)  # fmt: skip

    def forward(modules: nn.ModuleDict, crops: torch.Tensor) -> list[torch.Tensor]:
        return list(modules["head"](modules["backbone"](crops.flatten(0, 1))).chunk(len(crops)))

    def step(batch, step_index: int, total: int, epoch: int) -> torch.Tensor:
        momentum = cosine_schedule(step_index, total, config.teacher_momentum, 1.0)
        update_momentum(student["backbone"], teacher["backbone"], m=momentum)
        update_momentum(student["head"], teacher["head"], m=momentum)
        with torch.no_grad():
            teacher_out = forward(teacher, batch.global_crops)
        student_out = forward(student, batch.global_crops)
        if len(batch.local_crops):
            student_out += forward(student, batch.local_crops)
        loss = criterion(teacher_out, student_out, epoch=epoch)
        loss.backward()
        student["head"].cancel_last_layer_gradients(current_epoch=epoch)
        return loss

    return student, step


def _byol(backbone: nn.Module, config, ours) -> tuple[nn.Module, callable]:
    """lightly's BYOL: backbone, ``BYOLProjectionHead``, ``BYOLPredictionHead``, and a
    momentum copy of the first two; ``NegativeCosineSimilarity`` both ways."""
    from lightly.loss import NegativeCosineSimilarity
    from lightly.models.modules import BYOLPredictionHead, BYOLProjectionHead
    from lightly.models.utils import deactivate_requires_grad, update_momentum
    from lightly.utils.scheduler import cosine_schedule

    projection, prediction = ours.model.projection_head, ours.model.predictor
    width, hidden = projection[-1].out_features, projection[0].out_features
    student = nn.ModuleDict({
        "backbone": backbone,
        "projection": BYOLProjectionHead(projection[0].in_features, hidden, width),
        "prediction": BYOLPredictionHead(width, prediction[0].out_features, width),
    })  # fmt: skip
    teacher = nn.ModuleDict(
        {name: copy.deepcopy(student[name]) for name in ("backbone", "projection")}
    )
    deactivate_requires_grad(teacher)
    criterion = NegativeCosineSimilarity()

    def predict(view: torch.Tensor) -> torch.Tensor:
        return student["prediction"](student["projection"](student["backbone"](view)))

    def target(view: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return teacher["projection"](teacher["backbone"](view)).detach()

    def step(batch, step_index: int, total: int, epoch: int) -> torch.Tensor:
        momentum = cosine_schedule(step_index, total, config.teacher_momentum, 1.0)
        update_momentum(student["backbone"], teacher["backbone"], m=momentum)
        update_momentum(student["projection"], teacher["projection"], m=momentum)
        p0, p1 = predict(batch.view0), predict(batch.view1)
        loss = 0.5 * (criterion(p0, target(batch.view1)) + criterion(p1, target(batch.view0)))
        loss.backward()
        return loss

    return student, step


def lightly_run(method: str, seed: int, quick: bool = False) -> dict:
    """One lightly run of ``method`` with the README command's data, backbone, optimizer
    and budget; its kNN and linear-probe top-1. ``quick``: 3 steps of 16 images, and the
    evaluation on 256 training and 64 held-out digits (a smoke test)."""
    shortened = {"max_steps": 3, "batch_size": 16} if quick else {}
    config = TrainConfig(method=method, seed=seed, **shortened).resolved()
    data = METHODS[method].load(config)
    if quick:
        data.train, data.evaluation = (
            data.train.select(range(256)),
            data.evaluation.select(range(64)),
        )
    per_epoch = batches_per_epoch(len(data.train), config.batch_size, config.drop_last)
    total = config.max_steps or config.epochs * per_epoch
    torch.manual_seed(seed)  # the trainer's initial weights (set_seed before build)
    ours = METHODS[method].build(config, data, 1, lambda _: None, total_steps=total)
    backbone = ours.model.encoder
    student, train_step = (_dino if method == "dino" else _byol)(backbone, config, ours)
    optimizer = torch.optim.SGD(student.parameters(), lr=config.lr, momentum=config.momentum,
                                weight_decay=config.weight_decay)  # fmt: skip
    learning_rate = warmup_cosine(config.lr, config.warmup_steps, total)
    sampler = GlobalBatchSampler(len(ours.dataset), config.batch_size, 0, seed,
                                 drop_last=config.drop_last)  # fmt: skip
    loader = torch.utils.data.DataLoader(ours.dataset, batch_sampler=sampler,
                                         collate_fn=ours.dataset.collate)  # fmt: skip
    started, step = time.perf_counter(), 0
    student.train()
    while step < total:
        epoch = step // per_epoch
        sampler.set_epoch(epoch, step % per_epoch)
        for batch in loader:
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step)
            train_step(batch, step, total, epoch)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step == total:
                break
    knn = knn_data(data.train, data.evaluation, data.image_column, data.label_column,
                   config.image_size, False)  # fmt: skip
    encoder = _Encoder(backbone).eval()
    return {
        "implementation": "lightly",
        "method": method,
        "seed": seed,
        "steps": total,
        "knn_top1": knn_top1(encoder, knn, k=config.knn_k),
        "linear_probe_top1": linear_probe_top1(encoder, knn),
        "seconds": time.perf_counter() - started,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--method", choices=LIGHTLY_METHODS, action="append")
    parser.add_argument("--seed", type=int, action="append")
    parser.add_argument("--quick", action="store_true", help="3 small steps per run (smoke)")
    args = parser.parse_args()
    for method in args.method or LIGHTLY_METHODS:
        for seed in args.seed or [0]:
            row = lightly_run(method, seed, args.quick)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
