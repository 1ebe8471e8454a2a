"""Image-text pairs (CLIP, SigLIP) through trainer.py on 1, 2 and 3 processes.

20 labelled images, each with a list of captions (one drawn per (seed, epoch, index)),
an mlp image tower with dropout and a tiny BERT text tower with dropout, both keyed by
sample, float64, global batches of 6: the last batch of each epoch is 2 rows, which 3
processes split 1 + 1 + 0. Each negative control removes one mechanism.
"""

from __future__ import annotations

import json
import math
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from launch import (
    TrainerRuns,
    final_files_difference,
    one_chunk,
    one_line_errors,
    train_pooled,
)

pytest.importorskip("transformers")
EXACT = 1e-9  # float64: only the summation order differs between the world sizes
# AdamW (the pairs' default) at 1e-3: at 0.1 its steps amplify float64 rounding.
COMMON = ["--dtype", "float64", "--batch-size", "6", "--lr", "1e-3", "--max-steps", "5",
          "--columns", "image,caption", "--model", "mlp", "--image-size", "8", "--dropout",
          "0.1", "--knn-k", "0", "--num-workers", "0", "--max-length", "8"]  # fmt: skip
SIGLIP = ("--loss", "siglip")
# Local negatives need 2 rows per rank: the 3 full batches of the first epoch.
BEFORE_THE_SHORT_BATCH = ("--max-steps", "3")


@pytest.fixture(scope="module")
def data(captioned_images, tiny_bert) -> dict[str, str]:
    return {"dataset": captioned_images, "model": tiny_bert}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data):
    return TrainerRuns(
        tmp_path_factory, *COMMON, "--dataset", data["dataset"], "--text-model", data["model"]
    )


@pytest.mark.parametrize(
    "flags, processes",
    [
        ((), 2),
        ((), 3),
        (("--accumulation-chunks", "3"), 3),
        (SIGLIP, 2),
        (SIGLIP, 3),
        ((*SIGLIP, "--accumulation-chunks", "3"), 2),
    ],
    ids=["infonce-W2", "infonce-W3", "infonce-W3-K3", "siglip-W2", "siglip-W3", "siglip-W2-K3"],
)
def test_one_process_and_n_processes_train_the_same_towers(runs, flags, processes):
    reference = runs(1, *one_chunk(flags))
    error = final_files_difference(reference, runs(processes, *flags))
    print(f"image-text {' '.join(flags) or 'infonce'}, 1 vs {processes}: {error:.1e}")
    assert error <= EXACT


@pytest.mark.parametrize(
    "control",
    [
        ("--no-gather", *BEFORE_THE_SHORT_BATCH),
        ("--dropout-masks", "per-process"),
        ("--augmentation-seeding", "per-process"),
    ],
    ids=["local-negatives", "per-process-dropout", "per-process-augmentation"],
)
def test_control_each_mechanism_removed_breaks_it(runs, control):
    reference = runs(1, *(BEFORE_THE_SHORT_BATCH if "--no-gather" in control else ()))
    error = final_files_difference(reference, runs(2, *control))
    print(f"image-text control {' '.join(control)}, 1 vs 2: {error:.1e}")
    assert error > 1e3 * EXACT


def test_a_mid_epoch_resume_ends_where_the_straight_run_does(runs, data, tmp_path):
    straight = runs(1, *SIGLIP, "--save-every", "4")
    resumed = tmp_path / "resumed"
    train_pooled(1, *COMMON, "--dataset", data["dataset"], "--text-model", data["model"], *SIGLIP,
                 "--output-dir", str(resumed),
                 "--resume-from", str(straight / "checkpoint-4"))  # fmt: skip
    error = final_files_difference(straight, resumed)
    print(f"image-text resumed at step 4 of 5 (epoch 2): {error:.1e}")
    assert error == 0.0


def test_final_holds_both_towers_the_scale_and_the_bias(runs):
    final = runs(1, *SIGLIP) / "final"
    weights = load_file(final / "model.safetensors")
    assert {"log_logit_scale", "logit_bias"} <= set(weights)
    assert any(name.startswith("image.") for name in weights)
    assert (final / "tower0" / "tokenizer.json").exists()
    assert json.loads((final / "config.json").read_text())["towers"][0]["projection"] == 128


def test_the_logit_scale_is_clamped_at_100_after_each_step(tmp_path):
    """CLIP's clamp: a scale pushed above 100 is back at 100 after ``after_step``; the
    control is the scale before it."""
    from contrastive_accelerate.methods import METHODS
    from trainer import TrainConfig

    config = TrainConfig(columns="image,caption", text_model="scratch", model="mlp",
                         knn_k=0, output_dir=str(tmp_path)).resolved()  # fmt: skip
    data = METHODS["pairs"].load(config)
    method = METHODS["pairs"].build(config, data, 1, print)
    with torch.no_grad():
        method.model.log_logit_scale.fill_(5.0)  # e^5 = 148
    before = method.model.log_logit_scale.item()
    method.after_step(0)
    after = method.model.log_logit_scale.item()
    print(f"log scale before the step's clamp {before:.3f}, after {after:.3f}")
    assert before == 5.0
    assert after == pytest.approx(math.log(100.0), abs=1e-7)


def test_the_offline_digits_example_prints_a_zero_shot_accuracy_computed_from_final(tmp_path):
    """The README's command, shortened: digits with captions from their labels, a tower
    from scratch. Its zero-shot figure equals the one this test computes from final/."""
    from contrastive_accelerate.data.pairs import load_pair_dataset
    from contrastive_accelerate.knn import knn_data
    from models.text import ImageTextModel

    output = tmp_path / "run"
    result = train_pooled(1, "--columns", "image,caption", "--text-model", "scratch",
                          "--model", "mlp", "--max-steps", "20", "--optimizer", "adamw",
                          "--lr", "1e-3", "--zero-shot-template", "a handwritten {}",
                          "--no-linear-probe", "--output-dir", str(output))  # fmt: skip
    logged = [json.loads(line) for line in (output / "metrics.jsonl").open()]
    (printed,) = [r["zero_shot_top1"] for r in logged if "zero_shot_top1" in r]
    assert f"zero-shot top-1 (360 held-out images): {printed:.1%}" in result.stdout

    data = load_pair_dataset(None, ("image", "caption"))
    weights = load_file(output / "final" / "model.safetensors")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(output / "final" / "tower0")
    model = _load_image_text(output / "final", weights)
    assert isinstance(model, ImageTextModel)
    knn = knn_data(data.train, data.evaluation, "image", "label", 8, False)
    names = data.train.features["label"].names
    tokens = tokenizer([f"a handwritten {n}" for n in names], padding=True, return_tensors="pt")
    with torch.no_grad():
        classes = torch.nn.functional.normalize(model.text(**tokens), dim=1)
        images = torch.stack([_image(data.evaluation, i) for i in range(len(data.evaluation))])
        projected = torch.nn.functional.normalize(model.image(images), dim=1)
    accuracy = ((projected @ classes.T).argmax(1) == knn.query_labels).double().mean().item()
    print(f"digits zero-shot after 20 steps: printed {printed:.4f}, recomputed {accuracy:.4f}")
    assert accuracy == pytest.approx(printed, abs=1e-9)


def _image(dataset, index: int) -> torch.Tensor:
    from contrastive_accelerate.data import evaluation_images

    images, _ = evaluation_images(dataset, "image", 8, indices=[index])
    return images[0]


def _load_image_text(final: Path, weights: dict) -> torch.nn.Module:
    from transformers import AutoModel

    from models import SimCLR
    from models.text import ImageTextModel, TextTower

    image = SimCLR(backbone="mlp", image_size=8, projection_layers=2, projection_hidden_dim=512,
                   projection_dim=128)  # fmt: skip
    encoder = AutoModel.from_pretrained(final / "tower0")
    model = ImageTextModel(image, TextTower(encoder, "mean", 128))
    model.load_state_dict(weights)
    return model.eval()


def test_a_text_pair_option_with_image_text_is_one_line_on_every_rank(data, tmp_path):
    result = train_pooled(2, *COMMON, "--dataset", data["dataset"], "--text-model",
                          data["model"], "--two-towers", "--output-dir", str(tmp_path),
                          check=False)  # fmt: skip
    one_line_errors(result, "--two-towers does not apply to image-text pairs", 2)


# A pretrained transformers vision tower (--image-model): a tiny ViT with dropout 0.1 and
# its processor's normalisation, the tiny BERT, the same data and batches.
VIT = ["--dtype", "float64", "--batch-size", "6", "--lr", "1e-3", "--max-steps", "5",
       "--columns", "image,caption", "--knn-k", "0", "--num-workers", "0", "--max-length",
       "8"]  # fmt: skip


@pytest.fixture(scope="module")
def vit_runs(tmp_path_factory, data, tiny_vit):
    return TrainerRuns(tmp_path_factory, *VIT, "--dataset", data["dataset"], "--text-model",
                       data["model"], "--image-model", tiny_vit)  # fmt: skip


@pytest.mark.parametrize(
    "flags, processes",
    [
        ((), 2),
        (("--accumulation-chunks", "3"), 3),
        (("--image-pooling", "mean", *SIGLIP), 3),
        (("--gradient-checkpointing", "--image-pooling", "cls"), 2),
    ],
    ids=["pooled-W2", "pooled-W3-K3", "mean-siglip-W3", "checkpointing-cls-W2"],
)
def test_a_pretrained_vision_tower_trains_alike_on_n_processes(vit_runs, flags, processes):
    reference = vit_runs(1, *one_chunk(flags))
    error = final_files_difference(reference, vit_runs(processes, *flags))
    print(f"image-text, a ViT tower {' '.join(flags)}, 1 vs {processes}: {error:.1e}")
    assert error <= EXACT


def test_a_dinov2_tower_trains_alike_and_its_unkeyed_drop_path_is_refused(data, tmp_path):
    """A tiny DINOv2 (layer scale, register-free, mean of its patch tokens): 1 vs 2. With
    stochastic depth, which DINOv2 draws from the process's RNG in its own module, the
    two-seed probe finds randomness no sample key reaches: refused, on every rank."""
    from launch import make_vision_model

    dinov2 = make_vision_model(tmp_path / "dinov2", kind="dinov2")
    common = [*VIT, "--dataset", data["dataset"], "--text-model", data["model"],
              "--image-model", str(dinov2), "--image-pooling", "mean"]  # fmt: skip
    for processes in (1, 2):
        train_pooled(processes, *common, "--output-dir", str(tmp_path / str(processes)))
    error = final_files_difference(tmp_path / "1", tmp_path / "2")
    print(f"image-text, a DINOv2 tower, 1 vs 2: {error:.1e}")
    assert error <= EXACT
    drop_path = make_vision_model(tmp_path / "dinov2-drop-path", kind="dinov2", drop_path=0.2)
    common[common.index(str(dinov2))] = str(drop_path)
    result = train_pooled(2, *common, "--output-dir", str(tmp_path / "refused"), check=False)
    one_line_errors(result, "draws randomness that no sample key reaches", 2)


def test_control_the_vision_tower_with_per_process_dropout_is_not(vit_runs):
    error = final_files_difference(vit_runs(1), vit_runs(2, "--dropout-masks", "per-process"))
    print(f"image-text, a ViT tower with per-process dropout, 1 vs 2: {error:.1e}")
    assert error > 1e3 * EXACT


def test_final_image_loads_in_transformers_and_embeds_as_the_trained_tower(vit_runs):
    """final/image through ``AutoModel`` and ``AutoImageProcessor``: a PIL image the
    processor prepares embeds as the trained tower embeds the data's pixels."""
    from PIL import Image
    from transformers import AutoImageProcessor, AutoModel

    from contrastive_accelerate.data import NORMALIZE

    final = vit_runs(1) / "final"
    weights = load_file(final / "model.safetensors")
    model = AutoModel.from_pretrained(final / "image", dtype=torch.float64).eval()
    processor = AutoImageProcessor.from_pretrained(final / "image")
    picture = Image.fromarray(
        (torch.rand(8, 8, 3, generator=torch.Generator().manual_seed(0)) * 255).byte().numpy()
    )
    pixels = processor(picture, return_tensors="pt")["pixel_values"].double()
    theirs = model(pixel_values=pixels).pooler_output @ weights["image.projection.weight"].T
    from models.vision import PretrainedImageModel, VisionTower, save_vision_tower

    tower = VisionTower(model, "pooled", processor.image_mean, processor.image_std)
    ours = PretrainedImageModel(tower, 128, partial(save_vision_tower, processor=processor))
    ours = ours.double()
    ours.load_state_dict({k[len("image."):]: v for k, v in weights.items()
                          if k.startswith("image.")})  # fmt: skip
    data_pixels = NORMALIZE(torch.from_numpy(np.asarray(picture).copy()).permute(2, 0, 1))
    with torch.no_grad():
        error = (ours.eval()(data_pixels[None].double()) - theirs).abs().max().item()
    print(f"final/image through AutoModel vs the trained tower: {error:.1e}")
    assert error <= 1e-6  # the processor rescales by 1/255 in float32, the data in float32


@pytest.mark.parametrize(
    "flags, expected",
    [
        (("--image-model", "{bert}"), "takes no pixel_values: it is not a vision model"),
        (("--image-model", "{vit}", "--model", "mlp"), "--model does not apply with --image-model"),
        # 2 px: smaller than a patch (a larger size interpolates the position embeddings).
        (("--image-model", "{vit}", "--image-size", "2"), "--image-size 2: --image-model"),
    ],
    ids=["not-a-vision-model", "with-model", "image-size"],
)
def test_a_vision_tower_problem_is_one_line_on_every_rank(data, tiny_vit, tmp_path, flags,
                                                          expected):  # fmt: skip
    flags = [flag.format(bert=data["model"], vit=tiny_vit) for flag in flags]
    result = train_pooled(2, *VIT, "--dataset", data["dataset"], "--text-model", data["model"],
                          *flags, "--output-dir", str(tmp_path), check=False)  # fmt: skip
    one_line_errors(result, expected, 2)
