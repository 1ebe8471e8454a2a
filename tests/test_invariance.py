"""The full SimCLR (ResNet-18 + BatchNorm + random augmentations) on 1, 2 and 3 processes.

Everything that usually makes the result depend on the world size is on: BatchNorm
in the backbone and the projection head, random crops/flips/colour jitter, shuffling,
momentum, and a dataset whose last global batch is short. float64, because a deep
BatchNorm network amplifies the float32 rounding of a sum split 12 vs 6+6 to ~1e-1
within a few steps (see README); in float64 the same amplification stays far below
the 1e-9 tolerance. Each negative control removes one mechanism and must miss it by
orders of magnitude.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from contrastive_accelerate.ckpt_diff import max_abs_diff

from launch import train_pooled

EXACT = 1e-9
FULL_MODEL = [
    "--model",
    "resnet18",
    "--image-size",
    "8",
    "--dtype",
    "float64",
    "--optimizer",
    "sgd",
    "--momentum",
    "0.9",
    "--lr",
    "0.1",
    "--augment",
    "--knn-k",
    "0",
    "--log-every",
    "4",
    "--max-steps",
    "8",
]
# 16 px for the short batches: at 8 px layer4 is 1x1, so the 2-sample batch normalises
# over 4 values per channel and float64 rounding grows to ~4e-9 (relative 2e-11).
UNEVEN_IMAGE_SIZE = ["--image-size", "16"]


@pytest.fixture(scope="module")
def uneven_images(image_folder):
    # 20 images, global batch 6: batches of 6, 6, 6, 2 per epoch; on 3 processes the
    # short batch splits 1 + 1 + 0, so one rank has nothing to do in that step.
    return image_folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory, uneven_images):
    cache: dict[tuple, str] = {}

    def get(processes: int, data: str, *flags: str) -> str:
        key = (processes, data, flags)
        if key not in cache:
            output = tmp_path_factory.mktemp("run")
            data_args = (
                ["--batch-size", "12"]
                if data == "digits"
                else ["--batch-size", "6", "--dataset", uneven_images, *UNEVEN_IMAGE_SIZE]
            )
            train_pooled(processes, *FULL_MODEL, *data_args, *flags, "--output-dir", str(output))
            cache[key] = str(output / "final")
        return cache[key]

    return get


@pytest.mark.parametrize("processes", [2, 3])
def test_full_simclr_is_world_size_invariant(runs, processes):
    diff = max_abs_diff(runs(1, "digits"), runs(processes, "digits"))
    print(f"ResNet-18 float64, 1 vs {processes} processes: max abs diff {diff:.3e}")
    assert diff <= EXACT


def test_uneven_last_batch_with_an_idle_rank(runs):
    diff = max_abs_diff(runs(1, "uneven"), runs(3, "uneven"))
    print(f"uneven batches, 1 vs 3 processes: max abs diff {diff:.3e}")
    assert diff <= EXACT
    # All 20 images train (nothing held out with --knn-k 0), so the last global batch of
    # each epoch has 2 samples and the third rank really is idle in that step.
    start = json.loads((Path(runs(3, "uneven")).parent / "metrics.jsonl").open().readline())
    assert start["train_samples"] == 20


@pytest.mark.parametrize(
    ("data", "processes", "flag"),
    [
        ("digits", 2, "--no-sync-batchnorm"),
        ("digits", 2, "--augmentation-seeding=per-process"),
        ("uneven", 3, "--data-sharding=accelerate"),
    ],
    ids=["per-process-batchnorm", "per-process-augmentation-seed", "accelerate-padded-batches"],
)
def test_negative_control_breaks_invariance(runs, data, processes, flag):
    diff = max_abs_diff(runs(1, data), runs(processes, data, flag))
    print(f"{flag}: 1 vs {processes} processes max abs diff {diff:.3e}")
    assert diff > 1e3 * EXACT


def test_checkpointed_blocks_train_the_same_model(runs):
    """``--gradient-checkpointing``: each ResNet block recomputed in backward, its
    SyncBatchNorm exchanging statistics again there, its running statistics kept (the
    unit tests' control shows them move without that): the plain run's model on 1
    process, and on 3 with an idle rank."""
    plain, one = runs(1, "digits"), runs(1, "digits", "--gradient-checkpointing")
    idle = runs(3, "uneven", "--gradient-checkpointing")
    diffs = (max_abs_diff(plain, one), max_abs_diff(runs(1, "uneven"), idle))
    print(f"ResNet-18 checkpointed: vs plain on 1 process {diffs[0]:.1e}, uneven 1 vs 3 "
          f"processes {diffs[1]:.1e}")  # fmt: skip
    assert max(diffs) <= EXACT
