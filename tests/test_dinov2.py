"""DINOv2 (``--method dinov2``): the model's masked forward, and the method's masks, heads
and centers in training. Its 1 vs 2 vs 3 processes runs on every source, its mid-epoch
resume on another number of processes and its per-process dropout control are
``test_composition``'s; the iBOT loss against lightly's and over ranks, and the masks'
draw against DINOv2's ``MaskingGenerator``, are ``test_ibot``'s.

- Model: the masked patches are selected in order without a read of the device (the
  loader counts them); with no patch masked the student's outputs are DINO's; a masked patch's
  embedding is the mask token (the class output moves, the mask token gets a gradient),
  and the teacher's view (``mask_input=False``) is DINO's forward.
- Pretrained ViTs (transformers' and CLIP's, timm's at its size and at any size): a
  masked patch's pixels reach nothing, the mask token sits where transformers' own
  ``bool_masked_pos`` puts it (the peer), and a tower without patches is refused.
- Trained, the choices that the composition matrix leaves aside (iBOT's own head, DINO's
  EMA center and the patch center beside it, no KoLeo) on 1 process and on 2 with
  ``--fsdp`` and gradient caching's chunks (an empty one in the last batch): the same
  model within 1e-9 (float64), the patch center moved from zero. Controls: masks drawn
  per process (seed + rank, DINOv2's per-rank ``random``, with augmentation and dropout
  off so that nothing else differs) train another model on 2 processes; without iBOT's
  loss (``--ibot-weight 0``) the model is another one.
- Under bf16 autocast on 2 processes it trains finite, its teacher and centers float32.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from contrastive_accelerate.config import ConfigError, parse_args
from contrastive_accelerate.testing import HostSyncs
from losses.ibot import masked_rows
from models import DINOv2Model
from models.timm_tower import TimmTower
from models.vision import VisionTower
from trainer import TrainConfig

from launch import TrainerRuns, final_files_difference, train_pooled

EXACT = 1e-9  # float64: only the summation order differs between the world sizes
COMMON = ["--dtype", "float64", "--batch-size", "6", "--max-steps", "4", "--knn-k", "0",
          "--num-workers", "0", "--log-every", "4", "--image-size", "8", "--lr", "0.1",
          "--method", "dinov2", "--model", "vit_micro", "--dino-out-dim", "32"]  # fmt: skip
#: The choices that the composition matrix's cells (DINOv2's Sinkhorn-Knopp and KoLeo, a
#: head shared with DINO's) leave aside.
OTHER_CHOICES = ("--separate-ibot-head", "--dino-center", "global", "--koleo-weight", "0")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, image_folder):
    return TrainerRuns(tmp_path_factory, *COMMON, "--dataset", image_folder)


def model_and_masks() -> tuple[DINOv2Model, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = DINOv2Model("vit_micro", image_size=8, dino_out_dim=16).double().eval()
    with torch.no_grad():
        model.mask_token.normal_()  # zeros at first, as DINOv2's: any value is a token
    masks = torch.zeros(3, 16, dtype=torch.bool)  # vit_micro's 4 x 4 patches at 8 px
    masks[0, :5], masks[2, 10:13] = True, True
    return model, torch.randn(3, 3, 8, 8, dtype=torch.float64), masks


def test_the_masked_rows_are_nonzeros_without_a_read_of_the_device():
    _, _, masks = model_and_masks()
    expected = masks.flatten().nonzero().squeeze(1)
    assert torch.equal(masked_rows(masks, int(masks.sum())), expected)
    with HostSyncs() as syncs:
        masked_rows(masks, 13)
    assert syncs.seen == []


def test_the_student_sees_the_mask_token_and_the_teacher_the_whole_crop():
    model, images, masks = model_and_masks()
    dino = model(images)
    classes, patches = model(images, masks)
    assert patches.shape == (int(masks.sum()), 16)
    unmasked = masks.any(dim=1).logical_not()
    assert torch.equal(classes[unmasked], dino[unmasked])  # no patch masked: DINO's
    assert (classes[~unmasked] - dino[~unmasked]).abs().min() > 1e-6  # the token moved it
    teacher, _ = model(images, masks, mask_input=False)
    assert torch.equal(teacher, dino)
    (classes.sum() + patches.sum()).backward()
    assert model.mask_token.grad.abs().sum() > 0


def pretrained_vit(kind: str) -> torch.nn.Module:
    """A tiny pretrained ViT tower (random weights, float64, eval) of each layout its patch
    embedding gives: transformers' ViT (tokens, NLC), CLIP's vision tower (a convolution's
    NCHW), timm's ViT at its own size (NLC) and taking any size (NHWC)."""
    torch.manual_seed(0)
    sizes = {"image_size": 8, "patch_size": 4, "hidden_size": 16, "num_hidden_layers": 2,
             "num_attention_heads": 2, "intermediate_size": 32}  # fmt: skip
    if kind.startswith("timm"):
        import timm

        arguments = {"img_size": 8, "patch_size": 4, "depth": 2, "embed_dim": 16,
                     "num_heads": 2, "dynamic_img_size": kind == "timm any size"}  # fmt: skip
        encoder = timm.create_model("vit_tiny_patch16_224", num_classes=0, **arguments)
        return TimmTower(encoder, "vit_tiny_patch16_224", arguments).double().eval()
    from transformers import CLIPVisionConfig, CLIPVisionModel, ViTConfig, ViTModel

    encoder = (
        ViTModel(ViTConfig(**sizes), use_mask_token=True)
        if kind == "transformers"
        else CLIPVisionModel(CLIPVisionConfig(**sizes))
    )
    return VisionTower(encoder, "pooled").double().eval()


PRETRAINED_VITS = ["transformers", "clip", "timm", "timm any size"]


@pytest.mark.parametrize("kind", PRETRAINED_VITS)
def test_a_pretrained_vits_masked_patches_reach_nothing_but_through_the_mask_token(kind):
    """Masked, a patch's pixels change nothing (its embedding is the mask token wherever
    the library's patch embedding puts the patch: rows of a grid, a convolution's map or
    timm's channels-last one); an unmasked patch's change moves the output; the first
    token is the tower's own features, and no mask is no change."""
    tower = pretrained_vit(kind)
    images = torch.randn(3, 3, 8, 8, dtype=torch.float64)
    token = torch.randn(16, dtype=torch.float64, requires_grad=True)
    masks = torch.tensor([[True, False, False, True], [False] * 4, [False, True, False, False]])
    tokens = tower.tokens(images, masks, token)
    assert tokens.shape == (3, 5, 16)
    assert torch.equal(tower.tokens(images)[:, 0], tower(images))
    assert torch.equal(tower.tokens(images, torch.zeros_like(masks), token), tower.tokens(images))
    hidden = images.clone()
    hidden[0, :, :4, :4], hidden[0, :, 4:, 4:], hidden[2, :, :4, 4:] = 7.0, -7.0, 3.0
    assert torch.equal(tower.tokens(hidden, masks, token), tokens)
    shown = images.clone()
    shown[1, :, :4, :4] = 7.0  # sample 1 has no patch masked
    assert (tower.tokens(shown, masks, token)[1] - tokens[1]).abs().max() > 1e-3
    tokens.sum().backward()
    assert token.grad.abs().sum() > 0


def test_the_mask_token_goes_where_transformers_own_masking_puts_it():
    """Against the peer: ``ViTModel``'s ``bool_masked_pos`` with our token as its
    ``mask_token``. Float64, the same operations in the same order: equal within 1e-12
    (0.0 reached)."""
    tower = pretrained_vit("transformers")
    images = torch.randn(3, 3, 8, 8, dtype=torch.float64)
    masks = torch.tensor([[True, False, False, True], [False] * 4, [False, True, True, True]])
    token = torch.randn(16, dtype=torch.float64)
    with torch.no_grad():
        tower.encoder.embeddings.mask_token.copy_(token)
        theirs = tower.encoder(pixel_values=images, bool_masked_pos=masks).last_hidden_state
        ours = tower.tokens(
            images, masks, token
        )  # the tower's mean and std are 0.5: pixels as given
    error = (ours[:, 1:] - theirs[:, 1:]).abs().max().item()
    print(f"masked patch tokens vs transformers' bool_masked_pos: {error:.1e}")
    assert error <= 1e-12


def test_a_pretrained_tower_without_patches_is_refused():
    from transformers import ResNetConfig, ResNetModel

    tower = VisionTower(ResNetModel(ResNetConfig(hidden_sizes=[8, 16], depths=[1, 1])), "pooled")
    with pytest.raises(ValueError, match="DINOv2 masks the patches of a ViT; ResNetModel has none"):
        DINOv2Model(encoder=tower, image_size=8, dino_out_dim=16)


def test_bad_choices_are_refused_in_one_line(image_folder):
    for flags, message in (
        (["--model", "resnet18"], "masks the patches of a ViT"),
        (["--mask-ratio-min", "0.6"], "--mask-ratio-min 0.6 is above --mask-ratio-max 0.5"),
    ):
        with pytest.raises(ConfigError, match=message):
            parse_args(TrainConfig, [*COMMON, "--dataset", image_folder, *flags])


def test_the_other_choices_train_one_model_on_1_and_2_processes(runs):
    one = runs(1, *OTHER_CHOICES)
    chunked = runs(2, *OTHER_CHOICES, "--accumulation-chunks", "2", "--fsdp")
    error = final_files_difference(one, chunked)
    center = load_file(one / "final" / "method.safetensors")["patch_center"].abs().max()
    print(f"dinov2, its own iBOT head, EMA centers, no KoLeo, 1 vs 2 processes x 2 chunks "
          f"--fsdp: {error:.1e}; the patch center's largest entry {center:.1e}")  # fmt: skip
    assert error <= EXACT and center > 0


def test_control_masks_drawn_per_process_train_another_model(runs):
    quiet = ("--no-augment", "--dropout", "0")  # the masks are then the only draw
    same = final_files_difference(runs(1, *quiet), runs(2, *quiet))
    control = final_files_difference(
        runs(1, *quiet), runs(2, *quiet, "--augmentation-seeding", "per-process")
    )
    print(f"dinov2 without augmentation or dropout, 1 vs 2 processes: {same:.1e}; masks "
          f"drawn per process (seed + rank): {control:.1e}")  # fmt: skip
    assert same <= EXACT and control > 1e3 * EXACT


def test_control_without_ibots_loss_the_model_is_another(runs):
    error = final_files_difference(runs(1), runs(1, "--ibot-weight", "0"))
    print(f"dinov2 with iBOT vs --ibot-weight 0: {error:.1e}")
    assert error > 1e3 * EXACT


def test_under_bf16_it_trains_finite_with_its_teacher_and_centers_in_float32(tmp_path):
    """``--mixed_precision bf16`` on 2 processes, the EMA centers in use: the loss is
    finite, and the weights, the teacher and both centers stay float32."""
    train_pooled(2, "--method", "dinov2", "--model", "vit_micro", "--image-size", "8",
                 "--batch-size", "8", "--max-steps", "3", "--knn-k", "0", "--num-workers", "0",
                 "--dino-center", "global", "--log-every", "1", "--output-dir", str(tmp_path),
                 environment={"ACCELERATE_MIXED_PRECISION": "bf16"})  # fmt: skip
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [record["loss"] for record in records if "samples_per_s" in record]
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses)
    for name in ("model.safetensors", "method.safetensors"):
        tensors = load_file(tmp_path / "final" / name)
        assert {t.dtype for t in tensors.values() if t.is_floating_point()} == {torch.float32}
    assert load_file(tmp_path / "final" / "method.safetensors")["patch_center"].abs().max() > 0
