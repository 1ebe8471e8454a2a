"""``--accumulation-chunks`` and per-sample dropout under a real ``accelerate launch``.

ViT-Tiny with dropout 0.1, stochastic depth 0.2 (``--drop-path``) and augmentations,
float64, on 4-pixel images (17 tokens: what is checked is where each mask comes from,
not the sequence length), the same command line on
(processes, chunks) = (1, 1), (1, 4), (2, 2) and (3, 1): one model. 14 images in global
batches of 12 make the second batch 2 pairs, so (3, 1) has an idle rank and (1, 4),
(2, 2) have empty chunks. The negative controls keep torch's nn.Dropout and
torchvision's StochasticDepth, whose masks depend on the process.
"""

from __future__ import annotations

import pytest

from contrastive_accelerate.ckpt_diff import max_abs_diff

from launch import make_image_folder, train_pooled

EXACT = 1e-9  # float64; the same tolerance as the other invariance tests
VIT = [
    "--model",
    "vit_tiny",
    "--dropout",
    "0.1",
    "--drop-path",
    "0.2",
    "--image-size",
    "4",
    "--dtype",
    "float64",
    "--batch-size",
    "12",
    "--max-steps",
    "3",
    "--lr",
    "0.1",
    "--knn-k",
    "0",
    "--log-every",
    "1",
]
SETUPS = [(1, 1), (1, 4), (2, 2), (3, 1)]


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return str(make_image_folder(tmp_path_factory.mktemp("images"), count=14, size=10))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, images):
    root = tmp_path_factory.mktemp("chunk_runs")
    outputs = {}
    for processes, chunks in SETUPS:
        output = root / f"p{processes}_k{chunks}"
        # (1, 4) also saves every step: the resume test continues from its step 1.
        saves = ["--save-every", "1"] if (processes, chunks) == (1, 4) else []
        train_pooled(
            processes,
            *VIT,
            "--dataset",
            images,
            "--accumulation-chunks",
            str(chunks),
            "--output-dir",
            str(output),
            *saves,
        )
        outputs[processes, chunks] = output
    return outputs


@pytest.mark.parametrize("setup", SETUPS[1:], ids=lambda s: f"{s[0]}proc_{s[1]}chunks")
def test_vit_with_dropout_is_the_same_model_for_any_processes_and_chunks(runs, setup):
    diff = max_abs_diff(runs[1, 1] / "final", runs[setup] / "final")
    print(f"ViT-Tiny, dropout 0.1, drop path 0.2: (1, 1) vs {setup}: {diff:.2e}")
    assert diff <= EXACT


def test_mid_epoch_resume_with_chunks_equals_the_straight_run(runs, images, tmp_path):
    # Step 1 of 3 is inside the first epoch (2 batches per epoch).
    train_pooled(
        1,
        *VIT,
        "--dataset",
        images,
        "--accumulation-chunks",
        "4",
        "--resume-from",
        str(runs[1, 4] / "checkpoint-1"),
        "--output-dir",
        str(tmp_path / "resumed"),
    )
    diff = max_abs_diff(runs[1, 4] / "final", tmp_path / "resumed" / "final")
    print(f"resume at step 1 with 4 chunks vs straight: {diff:.2e}")
    assert diff == 0.0


@pytest.mark.parametrize(
    "random", [["--dropout", "0.1"], ["--dropout", "0"]], ids=["dropout", "drop-path-only"]
)
def test_negative_control_torch_dropout_depends_on_the_processes(runs, images, tmp_path, random):
    outputs = {}
    for processes in (1, 2):
        outputs[processes] = tmp_path / f"p{processes}"
        result = train_pooled(
            processes,
            *VIT,
            *random,
            "--dataset",
            images,
            "--dropout-masks",
            "per-process",
            "--output-dir",
            str(outputs[processes]),
        )
    assert "not world-size invariant" in result.stdout + result.stderr
    diff = max_abs_diff(outputs[1] / "final", outputs[2] / "final")
    print(f"torch's masks ({' '.join(random)}, --drop-path 0.2), 1 vs 2 processes: {diff:.2e}")
    assert diff > 1e3 * EXACT


def test_batchnorm_model_with_chunks_runs_and_says_it_is_not_exact(images, tmp_path):
    result = train_pooled(
        2,
        "--model",
        "resnet18",
        "--image-size",
        "8",
        "--batch-size",
        "8",
        "--max-steps",
        "1",
        "--knn-k",
        "0",
        "--dataset",
        images,
        "--accumulation-chunks",
        "2",
        "--output-dir",
        str(tmp_path / "bn"),
    )
    warnings = [line for line in result.stdout.splitlines() if "each chunk" in line]
    assert len(warnings) == 1, result.stdout
    assert "BatchNorm normalises each chunk with that chunk's statistics" in warnings[0]
