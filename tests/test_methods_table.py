"""Every row of ``METHODS`` through trainer.py: its options, 1 vs 2 processes, and a
mid-epoch checkpoint of 2 processes resumed on 1.

A new method fails here until it has a row of ``CASES``: its command line at the
smallest size, float64, dropout keyed by sample, 20 rows in global batches of 6 (each
epoch ends with a batch of 2), 5 steps across the epoch boundary, a checkpoint at step
2. The control removes the per-sample dropout masks, which every method's towers have.
"""

from __future__ import annotations

import dataclasses

import pytest

from contrastive_accelerate.methods import METHOD_OPTIONS, METHODS
from trainer import TrainConfig

from launch import TrainerRuns, final_files_difference, train_pooled

EXACT = 1e-9  # float64: only the summation order differs between the world sizes
COMMON = ["--dtype", "float64", "--batch-size", "6", "--max-steps", "5", "--save-every", "2",
          "--knn-k", "0", "--num-workers", "0", "--log-every", "5"]  # fmt: skip
IMAGES = ["--model", "mlp", "--image-size", "8", "--dropout", "0.1", "--lr", "0.1"]
#: Each method's command line (the data are the fixtures'): one row per row of METHODS.
CASES = {
    "simclr": ("images", [*IMAGES, "--method", "simclr"]),
    "moco": ("images", [*IMAGES, "--method", "moco", "--queue-size", "10"]),
    "byol": ("images", [*IMAGES, "--method", "byol"]),
    "dino": ("images", [*IMAGES, "--method", "dino", "--dino-out-dim", "64"]),
    "pairs": (
        "text",
        ["--columns", "anchor,positive,negative_1", "--max-length", "8", "--lr", "1e-3"],
    ),  # fmt: skip
}
CONTROL = ("--dropout-masks", "per-process")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return TrainerRuns(tmp_path_factory, *COMMON)


@pytest.fixture(scope="module")
def data(image_folder, sentence_pairs, tiny_bert) -> dict[str, list[str]]:
    return {
        "images": ["--dataset", image_folder],
        "text": ["--dataset", sentence_pairs, "--text-model", tiny_bert],
    }


def flags(data, method: str, *extra: str) -> tuple[str, ...]:
    kind, arguments = CASES[method]
    return (*data[kind], *arguments, *extra)


def test_every_method_has_a_case_and_declares_its_options():
    assert set(CASES) == set(METHODS)
    fields = {field.name for field in dataclasses.fields(TrainConfig)}
    for name, row in METHODS.items():
        assert set(row.options) <= fields, name
        resolved = TrainConfig(method=name, columns="a,b" if name == "pairs" else None)
        assert resolved.resolved().method == name
    assert set(METHOD_OPTIONS) == {option for row in METHODS.values() for option in row.options}


@pytest.mark.parametrize("method", list(CASES))
def test_one_process_and_two_train_the_same_model(runs, data, method):
    error = final_files_difference(runs(1, *flags(data, method)), runs(2, *flags(data, method)))
    print(f"{method}, 1 vs 2 processes (model and method state): {error:.1e}")
    assert error <= EXACT


@pytest.mark.parametrize("method", list(CASES))
def test_control_per_process_dropout_masks_break_it(runs, data, method):
    error = final_files_difference(
        runs(1, *flags(data, method)), runs(2, *flags(data, method, *CONTROL))
    )
    print(f"{method}, per-process dropout masks, 1 vs 2 processes: {error:.1e}")
    assert error > 1e3 * EXACT


@pytest.mark.parametrize("method", list(CASES))
def test_a_mid_epoch_checkpoint_of_two_processes_resumes_on_one(runs, data, method, tmp_path):
    straight = runs(2, *flags(data, method))
    resumed = tmp_path / "resumed"
    train_pooled(
        1, *COMMON, *flags(data, method), "--output-dir", str(resumed),
        "--resume-from", str(straight / "checkpoint-2"),
    )  # fmt: skip
    error = final_files_difference(straight, resumed)
    print(f"{method}, resumed at step 2 on 1 process vs 2 straight: {error:.1e}")
    assert error <= EXACT
