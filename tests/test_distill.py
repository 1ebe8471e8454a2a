"""Distillation from a frozen teacher (``--method distill``): its loss exact on any
number of processes, and the teacher loaded as it was saved. Its 1 vs 2 vs 3 processes
on every student tower and source, with a timm ResNet teacher (BatchNorm, in eval mode),
and its mid-epoch resume on another number of processes, are ``test_composition``'s.

- Loss: against its formulas computed here (cosine: ``1 - F.cosine_similarity``; l2:
  ``nn.MSELoss``, lightly-train v2's), and on 2 and 3 ranks with uneven shares and an
  idle rank the single process's value and gradients (``assert_loss_invariant``).
  Control: each rank's own mean (``gather_distributed=False``) is not.
- Teacher: one of our ``final/`` folders gives the encoder that was saved (0.0); a
  transformers folder and a timm one load; bad folders are one line.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from contrastive_accelerate.launch import TrainerError
from contrastive_accelerate.methods.distill import probe_teacher
from contrastive_accelerate.testing import assert_loss_invariant
from losses import DistillationLoss
from models.frozen_tower import FrozenTowerError, load_frozen_tower

from launch import make_teacher, make_timm_model

#: One uneven split is enough for a control to fail.
UNEVEN = {2: [[5, 4]]}


def features(rows: int = 9, dim: int = 6) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randn(rows, dim, generator=generator, dtype=torch.float64) for _ in range(2)]


@pytest.mark.parametrize("distance", ["cosine", "l2"])
def test_the_loss_is_its_formula(distance):
    student, teacher = features()
    reference = (1 - F.cosine_similarity(student, teacher)).mean() if distance == "cosine" else (
        torch.nn.MSELoss()(student, teacher)
    )  # fmt: skip
    error = abs(DistillationLoss(distance)(student, teacher).item() - reference.item())
    print(f"DistillationLoss({distance!r}) vs its formula: {error:.1e}")
    assert error <= 1e-15


class CosineDistillation(DistillationLoss):
    def __init__(self) -> None:
        super().__init__("cosine")


class L2Distillation(DistillationLoss):
    def __init__(self) -> None:
        super().__init__("l2")


class PerRankMean(DistillationLoss):
    """The control: each rank's own mean, the global one only for equal shares."""

    def __init__(self) -> None:
        super().__init__("l2", gather_distributed=False)


@pytest.mark.parametrize("loss", [CosineDistillation, L2Distillation], ids=["cosine", "l2"])
def test_the_loss_is_exact_on_any_number_of_processes(loss):
    report = assert_loss_invariant(loss, features)
    print(f"{loss.__name__}, 2 and 3 ranks: worst difference {report.worst:.1e}")


def test_control_each_ranks_own_mean_is_another_loss():
    with pytest.raises(AssertionError, match="not exact"):
        assert_loss_invariant(PerRankMean, features, world_sizes=(2,), splits=UNEVEN)


def test_the_loss_computes_in_float32_under_bf16_autocast():
    student, teacher = (x.float() for x in features())
    reference = DistillationLoss()(student, teacher)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = DistillationLoss()(student, teacher)
    assert autocast.dtype == torch.float32
    assert autocast.item() == pytest.approx(reference.item(), abs=1e-6)


def test_a_final_folder_of_ours_is_the_encoder_it_saved(tmp_path):
    saved = make_teacher(tmp_path / "final", double=True)
    teacher = load_frozen_tower(str(tmp_path / "final"), torch.float64, "--distill-teacher")
    images = torch.randn(4, 3, 8, 8, dtype=torch.float64)
    error = (teacher.tower(images) - saved.embed(images)).abs().max().item()
    other = make_teacher(tmp_path / "other", seed=1, double=True).embed(images)
    control = (teacher.tower(images) - other).abs().max().item()
    print(f"teacher from final/ vs the saved encoder: {error:.1e}; another seed's: {control:.1e}")
    assert error == 0.0 and control > 1e-3
    assert teacher.width == 256 and not any(p.requires_grad for p in teacher.tower.parameters())
    assert not teacher.tower.training


def test_a_transformers_and_a_timm_folder_load(tiny_vit, tmp_path):
    timm_folder = make_timm_model(tmp_path / "timm", "test_resnet", dropout=0.0)
    for folder in (tiny_vit, str(timm_folder)):
        teacher = load_frozen_tower(folder, torch.float32, "--distill-teacher")
        assert teacher.tower(torch.zeros(2, 3, 8, 8)).shape == (2, teacher.width)


def test_a_bad_teacher_folder_is_one_line(tmp_path):
    make_teacher(tmp_path / "good")
    cases = {"missing": "no readable config.json"}
    (tmp_path / "unknown").mkdir()
    (tmp_path / "unknown" / "config.json").write_text(json.dumps({"backbone": "resnet9"}))
    cases["unknown"] = "is not one of"
    (tmp_path / "huge").mkdir()
    (tmp_path / "huge" / "config.json").write_text(
        json.dumps({"backbone": ["mlp"], "image_size": 10**9})
    )
    cases["huge"] = "is not one of"
    (tmp_path / "neither").mkdir()
    (tmp_path / "neither" / "config.json").write_text("{}")
    cases["neither"] = "none of ours"
    (tmp_path / "shapes").mkdir()
    config = json.loads((tmp_path / "good" / "config.json").read_text())
    (tmp_path / "shapes" / "config.json").write_text(json.dumps({**config, "backbone": "resnet18"}))
    (tmp_path / "shapes" / "model.safetensors").write_bytes(
        (tmp_path / "good" / "model.safetensors").read_bytes()
    )
    cases["shapes"] = "does not hold a resnet18 encoder"
    for name, problem in cases.items():
        with pytest.raises(FrozenTowerError, match=problem) as raised:
            load_frozen_tower(str(tmp_path / name), torch.float32, "--distill-teacher")
        assert "\n" not in str(raised.value) and "--distill-teacher" in str(raised.value)


def test_crops_the_teacher_cannot_embed_are_one_line_before_any_step(tmp_path):
    """A timm ViT of 8 px with patches of 4 takes no 6-px crop: refused where it loads."""
    folder = str(make_timm_model(tmp_path / "vit"))
    teacher = load_frozen_tower(folder, torch.float32, "--distill-teacher")
    probe_teacher(teacher.tower, 8, "--image-size", folder)  # its own size
    with pytest.raises(TrainerError, match="--image-size 6: --distill-teacher") as raised:
        probe_teacher(teacher.tower, 6, "--image-size", folder)
    assert "\n" not in str(raised.value)
