"""The image methods on pretrained towers as a domain adaptation trains them: LoRA
adapters (``--lora-rank``) on a tiny transformers ViT and a tiny timm ViT, their blocks
checkpointed (``--gradient-checkpointing``), DINO with its local crops at another size
than the global ones (the towers interpolate their position embeddings: transformers'
``interpolate_pos_encoding``, timm's ``dynamic_img_size``).

- Each method on each tower trains the same model on 1 and 3 processes: float64, 20
  images in global batches of 6, so each epoch ends with a batch of 2 that 3 processes
  split 1 + 1 + 0 (an uneven batch and an idle rank); every file of ``final/`` within
  ``EXACT``.
- Controls: the adapters' dropout drawn per process, and DINO's crops drawn per process
  (``--augmentation-seeding per-process``: its local crops unkeyed), break it.
- ``final/image`` is the adapted tower merged, as its own library loads it, and
  ``final/image_adapter`` the adapter, which peft puts back on the pretrained tower: both
  embed as the trained model does.
- A resume needs the pretrained tower that the checkpoint was trained from: another
  file of the same weights continues it, other weights are refused in one line.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from launch import (
    TrainerRuns,
    final_files_difference,
    make_timm_model,
    make_vision_model,
    train_pooled,
)

pytest.importorskip("peft")
pytest.importorskip("timm")
EXACT = 1e-9  # float64: only the summation order differs between the world sizes
COMMON = ["--dtype", "float64", "--batch-size", "6", "--max-steps", "5", "--save-every", "2",
          "--knn-k", "0", "--num-workers", "0", "--log-every", "5", "--image-size", "8",
          "--lr", "0.1"]  # fmt: skip
ADAPTED = ("--lora-rank", "2", "--lora-alpha", "4", "--lora-dropout", "0.1",
           "--gradient-checkpointing")  # fmt: skip
#: Each method's own flags; DINO takes its default local crops (6 of 4 px beside 2 of 8).
METHOD_FLAGS = {
    "simclr": ("--method", "simclr"),
    "moco": ("--method", "moco", "--queue-size", "10"),
    "byol": ("--method", "byol"),
    "dino": ("--method", "dino", "--dino-out-dim", "64"),
}


@pytest.fixture(scope="module")
def towers(tmp_path_factory, tiny_vit) -> dict[str, tuple[str, str]]:
    """Each kind of pretrained tower: its option and a tiny one with dropout 0.1."""
    timm_vit = make_timm_model(tmp_path_factory.mktemp("timm"), img_size=8, patch_size=4,
                               depth=2, embed_dim=16, num_heads=2, proj_drop_rate=0.1)  # fmt: skip
    return {"transformers": ("--image-model", tiny_vit), "timm": ("--timm-model", str(timm_vit))}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, image_folder):
    return TrainerRuns(tmp_path_factory, *COMMON, "--dataset", image_folder)


def adapted(method: str, tower: tuple[str, str]) -> tuple[str, ...]:
    return (*METHOD_FLAGS[method], *tower, *ADAPTED)


@pytest.mark.parametrize("tower", ["transformers", "timm"])
@pytest.mark.parametrize("method", list(METHOD_FLAGS))
def test_an_adapted_checkpointed_pretrained_tower_trains_alike_on_1_and_3_processes(
    runs, towers, method, tower
):
    flags = adapted(method, towers[tower])
    error = final_files_difference(runs(1, *flags), runs(3, *flags))
    print(f"{method} on a {tower} ViT with LoRA and checkpointing, 1 vs 3 processes: {error:.1e}")
    assert error <= EXACT


@pytest.mark.parametrize("kind", ["convnext", "resnet"])
def test_a_convolutional_transformers_tower_trains_alike_on_1_and_3_processes(
    tmp_path_factory, image_folder, kind
):
    """SimCLR on a tiny transformers ConvNeXt and ResNet (--image-model, their pooled
    output): an idle rank runs its no rows through the ResNet's BatchNorm, synchronised,
    where one stand-in image would have counted in the global statistics (the timm
    ResNet's 1 vs 3 was 0.37 so, tests/test_composition.py)."""
    tower = make_vision_model(tmp_path_factory.mktemp(kind), kind=kind, image_size=16)
    runs = TrainerRuns(tmp_path_factory, *COMMON, "--dataset", image_folder, "--image-size",
                       "16", "--method", "simclr", "--image-model", str(tower))  # fmt: skip
    error = final_files_difference(runs(1), runs(3))
    print(f"simclr on a transformers {kind}, 1 vs 3 processes: {error:.1e}")
    assert error <= EXACT


def test_control_the_adapters_dropout_drawn_per_process_breaks_it(runs, towers):
    flags = adapted("simclr", towers["timm"])
    error = final_files_difference(runs(1, *flags),
                                   runs(3, *flags, "--dropout-masks", "per-process"))  # fmt: skip
    print(f"simclr on a timm ViT with LoRA, per-process dropout, 1 vs 3: {error:.1e}")
    assert error > 1e3 * EXACT


@pytest.mark.parametrize("tower", ["transformers", "timm"])
def test_control_dinos_crops_drawn_per_process_break_it(runs, towers, tower):
    flags = adapted("dino", towers[tower])
    error = final_files_difference(
        runs(1, *flags), runs(3, *flags, "--augmentation-seeding", "per-process")
    )
    print(f"dino on a {tower} ViT, crops drawn per process, 1 vs 3: {error:.1e}")
    assert error > 1e3 * EXACT


def test_an_adapted_timm_tower_exports_merged_and_as_an_adapter(runs, towers):
    """timm builds final/image (the adapters merged) and peft puts final/image_adapter on
    the pretrained tower: both embed alike (float32, the dtype timm builds and loads
    the weights in, within 1e-6)."""
    import timm
    from peft import PeftModel

    from models.timm_tower import load_timm_tower

    final = runs(1, *adapted("simclr", towers["timm"])) / "final"
    ours = load_timm_tower(towers["timm"][1], None, torch.float32)
    ours = PeftModel.from_pretrained(ours.encoder, final / "image_adapter")
    config = json.loads((final / "image" / "config.json").read_text())
    merged = timm.create_model(
        config["architecture"], pretrained=True, num_classes=0, **config["model_args"],
        pretrained_cfg_overlay={"file": str(final / "image" / "model.safetensors")},
    ).eval()  # fmt: skip
    pixels = torch.rand(4, 3, 8, 8)
    with torch.no_grad():
        error = (ours.eval()(pixels) - merged(pixels)).abs().max().item()
    print(f"timm: the pretrained tower with final/image_adapter vs final/image: {error:.1e}")
    assert error <= 1e-6  # float32: (W + s B A) x against W x + s B (A x)


def test_an_adapted_transformers_tower_exports_merged_and_as_an_adapter(runs, towers):
    """AutoModel loads final/image (merged), and peft puts final/image_adapter on the
    pretrained ViT: their pooled outputs agree (float64)."""
    from peft import PeftModel
    from transformers import AutoModel

    final = runs(1, *adapted("dino", towers["transformers"])) / "final"
    base = AutoModel.from_pretrained(towers["transformers"][1], dtype="float64")
    ours = PeftModel.from_pretrained(base, final / "image_adapter").eval()
    merged = AutoModel.from_pretrained(final / "image", dtype="float64").eval()
    pixels = torch.rand(4, 3, 8, 8, dtype=torch.float64)
    with torch.no_grad():
        error = (ours(pixel_values=pixels).pooler_output
                 - merged(pixel_values=pixels).pooler_output).abs().max().item()  # fmt: skip
    print(f"transformers: the ViT with final/image_adapter vs final/image: {error:.1e}")
    assert error <= 1e-12


@pytest.mark.parametrize("tower", ["transformers", "timm"])
def test_a_resume_needs_the_weights_the_checkpoint_was_trained_from(
    runs, towers, image_folder, tower, tmp_path
):
    option, path = towers[tower]
    flags = adapted("byol", (option, path))
    trained = runs(1, *flags)
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    resumed = [*COMMON, "--dataset", image_folder, *adapted("byol", (option, str(copy))),
               "--resume-from", str(trained / "checkpoint-2")]  # fmt: skip
    train_pooled(1, *resumed, "--output-dir", str(tmp_path / "same"))
    assert final_files_difference(trained, tmp_path / "same") <= EXACT
    weights = load_file(copy / "model.safetensors")
    first = next(iter(weights))
    save_file({**weights, first: weights[first] + 1}, copy / "model.safetensors")
    result = train_pooled(1, *resumed, "--output-dir", str(tmp_path / "other"), check=False)
    last = (result.stdout + result.stderr).strip().splitlines()[-1]
    assert result.returncode != 0 and "differs from the checkpoint's in" in last, last
    assert f"--{option[2:]}'s weights" in last, last


def test_a_timm_export_embeds_the_data_as_the_trained_tower_does(runs, towers):
    """final/image through timm alone, on pixels normalised as its config.json's
    ``pretrained_cfg`` says, embeds what the trained tower (final/model.safetensors'
    weights in our ``TimmTower``) embeds from the data's [-1, 1] images: float32, the
    dtype timm builds, within 1e-6."""
    import timm

    from models.timm_tower import load_timm_tower

    final = runs(1, *METHOD_FLAGS["simclr"], *towers["timm"]) / "final"
    ours = load_timm_tower(towers["timm"][1], None, torch.float32)
    prefix = "encoder.encoder."
    trained = {name[len(prefix):]: tensor.float()
               for name, tensor in load_file(final / "model.safetensors").items()
               if name.startswith(prefix)}  # fmt: skip
    ours.encoder.load_state_dict(trained)
    config = json.loads((final / "image" / "config.json").read_text())
    theirs = timm.create_model(
        config["architecture"], pretrained=True, num_classes=0, **config["model_args"],
        pretrained_cfg_overlay={"file": str(final / "image" / "model.safetensors")},
    ).eval()  # fmt: skip
    images = torch.rand(4, 3, 8, 8, generator=torch.Generator().manual_seed(0)) * 2 - 1
    mean, std = (torch.tensor(config["pretrained_cfg"][key]).view(1, 3, 1, 1)
                 for key in ("mean", "std"))  # fmt: skip
    with torch.no_grad():
        error = (ours.eval()(images) - theirs(((images + 1) / 2 - mean) / std)).abs().max().item()
    print(f"timm: final/image on normalised pixels vs the trained tower on the data: {error:.1e}")
    assert error <= 1e-6
