"""Every ``--loss`` through the trainer: 1 and 2 processes, the same command line, the same model.

float64, SGD with momentum, random augmentations on, 4 steps of a global batch of 12
digits. The mlp for the losses that need no BatchNorm; ResNet-18 (with synchronised
BatchNorm in its 3-layer projector) for Barlow Twins and VICReg, whose projectors
have BatchNorm in the papers, with their default optimizer (their papers' LARS: their
losses are ~1e3, and SGD at a contrastive loss's lr blows the activations up to ~1e6,
where 1e-9 absolute is below float64 rounding). Tolerance 1e-9, as for the full SimCLR
(test_invariance):
only summation order differs between the runs; the logged losses agree to 1e-9
relative. One loss also runs on 3 processes with a short last batch that leaves one
rank idle.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from contrastive_accelerate.ckpt_diff import max_abs_diff
from contrastive_accelerate.methods import SIMCLR_LOSSES

from launch import make_image_folder, train_pooled

EXACT = 1e-9
COMMON = [
    "--dtype", "float64", "--batch-size", "12", "--max-steps", "4", "--knn-k", "0",
    "--log-every", "1",
]  # fmt: skip
MODELS = {
    "ntxent": ("mlp", "--lr", "0.05"),
    "dcl": ("mlp", "--lr", "0.05"),
    "dclw": ("mlp", "--lr", "0.05"),
    "supcon": ("mlp", "--lr", "0.05"),
    "infonce": ("mlp", "--lr", "0.05"),
    "siglip": ("mlp", "--lr", "0.05"),
    "barlowtwins": ("resnet18",),
    "vicreg": ("resnet18",),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cache: dict[tuple, Path] = {}

    def get(loss: str, processes: int, *extra: str) -> Path:
        key = (loss, processes, extra)
        if key not in cache:
            output = tmp_path_factory.mktemp(f"{loss}-{processes}")
            # The temperature where the loss reads one (elsewhere it is refused).
            temperature = (
                ["--temperature", "0.3"] if "temperature" in SIMCLR_LOSSES[loss].options else []
            )
            args = ["--loss", loss, "--model", *MODELS[loss], *COMMON, *temperature, *extra]
            train_pooled(processes, *args, "--output-dir", str(output))
            cache[key] = output
        return cache[key]

    return get


def _losses(output: Path) -> list[float]:
    records = [json.loads(line) for line in (output / "metrics.jsonl").open()]
    return [record["loss"] for record in records if "loss" in record]


@pytest.mark.parametrize("loss", list(MODELS))
def test_one_and_two_processes_train_the_same_model(runs, loss):
    one, two = runs(loss, 1), runs(loss, 2)
    diff = max_abs_diff(str(one / "final"), str(two / "final"))
    logged = max(
        abs(a - b) / max(1.0, abs(a)) for a, b in zip(_losses(one), _losses(two), strict=True)
    )
    print(f"--loss {loss}: 1 vs 2 processes max abs diff {diff:.3e} (logged losses {logged:.1e})")
    assert diff <= EXACT
    assert logged <= EXACT  # the logged loss is the global loss on any number of processes


def test_learnable_logit_scale_and_bias_are_trained_and_saved(runs):
    from safetensors.torch import load_file

    weights = load_file(str(runs("siglip", 2) / "final" / "model.safetensors"))
    assert {"log_logit_scale", "logit_bias"} <= weights.keys()
    assert weights["logit_bias"].item() != -10.0  # moved from its initial value


def test_supcon_on_three_processes_with_an_idle_rank(runs, tmp_path_factory):
    """20 labelled images, global batch 6: the last batch of 2 splits 1 + 1 + 0."""
    images = make_image_folder(tmp_path_factory.mktemp("supcon-images"), count=20, classes=3)
    data = ["--dataset", str(images), "--image-size", "12", "--batch-size", "6", "--max-steps", "8"]
    one, three = runs("supcon", 1, *data), runs("supcon", 3, *data)
    diff = max_abs_diff(str(one / "final"), str(three / "final"))
    print(f"--loss supcon, uneven batches: 1 vs 3 processes max abs diff {diff:.3e}")
    assert diff <= EXACT


def test_supcon_without_labels_is_a_one_line_error(tmp_path):
    images = make_image_folder(tmp_path / "images", count=8, classes=1)
    for path in (images / "train").rglob("*.png"):  # no class folders: no labels
        path.rename(images / "train" / path.name)
    result = train_pooled(
        1, "--loss", "supcon", "--model", "mlp", "--dataset", str(images), "--knn-k", "0",
        "--batch-size", "4", "--max-steps", "1", "--output-dir", str(tmp_path / "run"),
        check=False,
    )  # fmt: skip
    assert result.returncode != 0
    assert "error: --loss supcon needs labels" in result.stderr, result.stderr


@pytest.mark.parametrize("loss", ["supcon", "siglip"])
def test_two_processes_with_chunks_train_the_same_model(runs, loss):
    """Gradient caching through the launch: SupCon's labels follow each chunk's samples,
    SigLIP's learnable scale and bias get their gradient in the synchronised pass."""
    one, chunked = runs(loss, 1), runs(loss, 2, "--accumulation-chunks", "3")
    diff = max_abs_diff(str(one / "final"), str(chunked / "final"))
    print(f"--loss {loss}: 1 process vs 2 processes x 3 chunks max abs diff {diff:.3e}")
    assert diff <= EXACT
