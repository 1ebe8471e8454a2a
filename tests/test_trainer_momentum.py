"""MoCo, BYOL and DINO through trainer.py on 1, 2 and 3 processes: the student and the
method's state (teacher, queue, center) in final/.

float64, augmentations and (mlp) dropout keyed by sample on, and 20 images in global
batches of 6: every epoch ends with a batch of 2, which 3 processes split 1 + 1 + 0, so
one rank idles. The queue holds 10 keys while each step pushes 12, so it is never a
multiple of the batch and wraps mid-batch. Each negative control removes one mechanism.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from contrastive_accelerate.ckpt_diff import max_abs_diff
from contrastive_accelerate.data import load_image_dataset
from contrastive_accelerate.knn import knn_data, knn_top1
from models import PredictorModel

from launch import (
    LAUNCHER_BF16,
    TrainerRuns,
    make_image_folder,
    one_line_errors,
    train_pooled,
)

EXACT = 1e-9  # float64: only the summation order differs between the world sizes
COMMON = ["--dtype", "float64", "--batch-size", "6", "--augment", "--lr", "0.1",
          "--knn-k", "0", "--log-every", "4", "--max-steps", "8", "--save-every", "3"]  # fmt: skip
MLP = ["--model", "mlp", "--image-size", "8", "--dropout", "0.1"]
# 16 px, as tests/test_invariance.py explains for ResNet-18 on short batches. The large
# models stop after step 5, past the first epoch's idle rank, and save no checkpoints.
SHORT = ["--max-steps", "5", "--save-every", "0"]
RESNET = ["--model", "resnet18", "--image-size", "16", *SHORT]
MOCO = ["--method", "moco", "--queue-size", "10", *MLP]
BYOL_RESNET = ["--method", "byol", *RESNET]
DINO = ["--method", "dino", "--dino-out-dim", "64", "--teacher-temperature", "0.07",
        "--teacher-temperature-warmup-steps", "4"]  # fmt: skip
# Two local crops of 8 px beside the 16 px global crops: one forward per resolution.
DINO_MULTI_CROP = [*DINO, *RESNET, "--local-crops", "2", "--local-crop-size", "8"]
# DINO's ViT recipe: local crops through interpolated position embeddings, drop path.
DINO_VIT_MULTI_CROP = [*DINO, "--model", "vit_tiny", "--image-size", "8", "--local-crops", "2",
                       "--local-crop-size", "4", "--drop-path", "0.1", *SHORT]  # fmt: skip
DINO_MLP = [*DINO, *MLP]


@pytest.fixture(scope="module")
def images(image_folder) -> str:
    return image_folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory, images):
    return TrainerRuns(tmp_path_factory, *COMMON, "--dataset", images)


def differences(a: Path, b: Path) -> tuple[float, float]:
    """Max abs difference of the final students, and of the final method states."""
    return (
        max_abs_diff(str(a / "final"), str(b / "final")),
        max_abs_diff(
            str(a / "final" / "method.safetensors"), str(b / "final" / "method.safetensors")
        ),
    )


@pytest.mark.parametrize(
    "flags, processes",
    [
        (MOCO, 2),
        (BYOL_RESNET, 3),
        (DINO_MULTI_CROP, 3),
        (DINO_VIT_MULTI_CROP, 3),
    ],
    ids=[
        "moco+queue-2",
        "byol-resnet18-syncbn-3",
        "dino-resnet18-syncbn-multi-crop-3",
        "dino-vit-multi-crop-drop-path-3",
    ],  # fmt: skip
)
def test_momentum_methods_are_world_size_invariant(runs, flags, processes):
    student, state = differences(runs(1, *flags), runs(processes, *flags))
    name = " ".join(flags[:2])
    print(f"{name}, 1 vs {processes} processes: student {student:.1e}, method state {state:.1e}")
    assert student <= EXACT and state <= EXACT


def test_the_method_state_holds_the_teacher_and_the_whole_queue(runs):
    state = load_file(str(runs(1, *MOCO) / "final" / "method.safetensors"))
    assert state["queue"].shape == (10, 128)  # full: 8 steps pushed 12 keys each
    assert torch.allclose(state["queue"].norm(dim=1), torch.ones(10, dtype=torch.float64))
    assert any(name.startswith("teacher.encoder.") for name in state)
    assert not any("predictor" in name for name in state)


def test_control_a_per_rank_queue_is_not_invariant(runs):
    """lightly's default: each rank queues only its own keys."""
    student, state = differences(runs(1, *MOCO), runs(2, *MOCO, "--queue-keys", "per-rank"))
    print(f"per-rank queue, 1 vs 2 processes: student {student:.1e}, state {state:.1e}")
    assert student > 1e3 * EXACT


def _resume(images: str, processes: int, checkpoint: Path, output: Path, flags=MOCO) -> Path:
    train_pooled(processes, *COMMON, "--dataset", images, *flags, "--output-dir", str(output),
           "--resume-from", str(checkpoint))  # fmt: skip
    return output


def test_mid_epoch_resume_with_teacher_and_queue_in_flight_is_exact(runs, images, tmp_path):
    """Step 3 of 4-step epochs: the queue is full and has wrapped, the teacher has moved."""
    straight = runs(1, *MOCO)
    resumed = _resume(images, 1, straight / "checkpoint-3", tmp_path / "resumed")
    student, state = differences(straight, resumed)
    print(f"moco resumed at step 3: student {student:.1e}, state {state:.1e}")
    assert student == 0.0 and state == 0.0


def test_resume_on_another_number_of_processes(runs, images, tmp_path):
    straight = runs(2, *MOCO)
    resumed = _resume(images, 3, straight / "checkpoint-3", tmp_path / "resumed")
    student, state = differences(straight, resumed)
    print(f"moco 2 processes resumed on 3: student {student:.1e}, state {state:.1e}")
    assert student <= EXACT and state <= EXACT


def test_control_a_queue_left_out_of_the_checkpoint(runs, images, tmp_path):
    """The checkpoint's queue emptied, as a bank saved with ``persistent=False`` would be."""
    straight = runs(1, *MOCO)
    checkpoint = tmp_path / "checkpoint-3"
    shutil.copytree(straight / "checkpoint-3", checkpoint)
    state = load_file(str(checkpoint / "method.safetensors"))
    state["queue"] = state["queue"][:0].contiguous()
    save_file(state, str(checkpoint / "method.safetensors"))
    student, _ = differences(straight, _resume(images, 1, checkpoint, tmp_path / "resumed"))
    print(f"queue left out of the checkpoint: student {student:.1e}")
    assert student > 1e3 * EXACT


def test_a_queue_option_for_byol_is_one_line_on_every_rank(tmp_path):
    result = train_pooled(2, "--method", "byol", "--queue-size", "8", "--output-dir",
                          str(tmp_path), check=False)  # fmt: skip
    one_line_errors(result, "--queue-size does not apply to --method byol", 2)


def test_gradient_caching_chunks_leave_moco_unchanged(runs):
    """The teacher sees each rank's whole share once per step, whatever the chunks."""
    student, state = differences(runs(2, *MOCO), runs(2, *MOCO, "--accumulation-chunks", "3"))
    print(f"moco on 2 processes, K=3 vs K=1: student {student:.1e}, method state {state:.1e}")
    assert student <= EXACT and state <= EXACT


def test_the_teacher_stays_float32_under_bf16_mixed_precision(images, tmp_path):
    train_pooled(1, *COMMON, "--dataset", images, *MOCO, "--dtype", "float32", "--output-dir",
                 str(tmp_path), environment=LAUNCHER_BF16)  # fmt: skip
    state = load_file(str(tmp_path / "final" / "method.safetensors"))
    assert {tensor.dtype for tensor in state.values() if tensor.is_floating_point()} == {
        torch.float32
    }
    assert all(torch.isfinite(tensor).all() for tensor in state.values())


@pytest.fixture(scope="module")
def odd_images(tmp_path_factory) -> str:
    """21 images: each epoch ends with a batch of 3, shares of 2 and 1 on 2 processes,
    where DINO's center formula is not the mean (every other step is even)."""
    return str(make_image_folder(tmp_path_factory.mktemp("odd"), 21, size=10))


@pytest.fixture(scope="module")
def odd_runs(tmp_path_factory, odd_images):
    """The mlp's DINO runs on the 21 images, so that 2 processes hold uneven shares."""
    return TrainerRuns(tmp_path_factory, *COMMON, "--dataset", odd_images)


def test_dino_center_on_uneven_shares(odd_runs):
    student, state = differences(odd_runs(1, *DINO_MLP), odd_runs(2, *DINO_MLP))
    control, control_state = differences(
        odd_runs(1, *DINO_MLP), odd_runs(2, *DINO_MLP, "--dino-center", "dino")
    )
    print(f"dino, shares 2 + 1: student {student:.1e}, state {state:.1e}; DINO's center "
          f"formula: student {control:.1e}, state {control_state:.1e}")  # fmt: skip
    assert student <= EXACT and state <= EXACT
    assert control_state > 1e3 * EXACT


def test_dinov2s_sinkhorn_centering_on_uneven_shares(odd_runs):
    """``--dino-center sinkhorn``: the teacher's targets are DINOv2's Sinkhorn-Knopp codes
    of the global batch (every rank's rows counted), the same on 1 and 2 processes; the
    control, each rank's own codes (``--no-gather``), trains another model."""
    sinkhorn = [*DINO_MLP, "--dino-center", "sinkhorn"]
    student, state = differences(odd_runs(1, *sinkhorn), odd_runs(2, *sinkhorn))
    control, _ = differences(odd_runs(1, *sinkhorn), odd_runs(2, *sinkhorn, "--no-gather"))
    centered, _ = differences(odd_runs(1, *sinkhorn), odd_runs(1, *DINO_MLP))
    print(
        f"dino, Sinkhorn-Knopp centering, shares 2 + 1: student {student:.1e}, state "
        f"{state:.1e}; per-rank codes: {control:.1e}; vs the EMA center: {centered:.1e}"
    )
    assert student <= EXACT and state <= EXACT
    assert control > 1e3 * EXACT and centered > 1e3 * EXACT


def test_dinov2s_koleo_on_the_global_batch_trains_alike_on_uneven_shares(odd_runs):
    """``--koleo-weight``: DINOv2's KoLeo on the student's global-crop features, each
    sample's neighbour searched in the global batch, the same on 1 and 2 processes (with
    the Sinkhorn-Knopp centering beside it, DINOv2's); without it (the control) another
    model."""
    dinov2 = [*DINO_MLP, "--dino-center", "sinkhorn"]
    koleo = [*dinov2, "--koleo-weight", "0.1"]
    student, state = differences(odd_runs(1, *koleo), odd_runs(2, *koleo))
    without, _ = differences(odd_runs(1, *koleo), odd_runs(1, *dinov2))
    print(f"dino with KoLeo 0.1, shares 2 + 1, 1 vs 2: student {student:.1e}, state "
          f"{state:.1e}; without KoLeo: {without:.1e}")  # fmt: skip
    assert student <= EXACT and state <= EXACT and without > 1e3 * EXACT


def test_dino_mid_epoch_resume_with_the_center_in_flight_is_exact(odd_runs, odd_images, tmp_path):
    """Step 3 of 4-step epochs: the center has moved, the last layer is still frozen."""
    straight = odd_runs(1, *DINO_MLP)
    resumed = _resume(odd_images, 1, straight / "checkpoint-3", tmp_path / "resumed", DINO_MLP)
    student, state = differences(straight, resumed)
    print(f"dino resumed at step 3: student {student:.1e}, state {state:.1e}")
    assert student == 0.0 and state == 0.0


def test_control_a_center_left_out_of_the_checkpoint(odd_runs, odd_images, tmp_path):
    straight = odd_runs(1, *DINO_MLP)
    checkpoint = tmp_path / "checkpoint-3"
    shutil.copytree(straight / "checkpoint-3", checkpoint)
    state = load_file(str(checkpoint / "method.safetensors"))
    state["center"] = torch.zeros_like(state["center"])  # where a fresh center starts
    save_file(state, str(checkpoint / "method.safetensors"))
    resumed = _resume(odd_images, 1, checkpoint, tmp_path / "resumed", DINO_MLP)
    _, state_difference = differences(straight, resumed)
    print(f"center left out of the checkpoint: method state {state_difference:.1e}")
    assert state_difference > 1e3 * EXACT


def test_control_per_process_crop_seeding(odd_runs):
    """Crops drawn from each process's RNG (seed + rank), as most pipelines draw them."""
    one = odd_runs(1, *DINO_MLP)
    per_process = odd_runs(2, *DINO_MLP, "--augmentation-seeding", "per-process")
    student, _ = differences(one, per_process)
    print(f"dino, per-process crop seeding, 1 vs 2 processes: student {student:.1e}")
    assert student > 1e3 * EXACT


def test_eval_teacher_evaluates_the_teachers_encoder(tmp_path):
    """The kNN figure of --eval-teacher is that of the teacher saved in final/; the
    student's of the same run (the control) differs."""
    # A teacher that barely leaves the initial weights, a student that does.
    digits = ["--method", "moco", "--model", "mlp", "--batch-size", "32", "--max-steps", "12",
              "--lr", "0.5", "--teacher-momentum", "0.999", "--knn-k", "1", "--no-linear-probe",
              "--log-every", "6", "--eval-teacher"]  # fmt: skip
    train_pooled(1, *digits, "--output-dir", str(tmp_path))
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    reported = [record["knn_top1"] for record in records if "knn_top1" in record][-1]
    student = PredictorModel.from_pretrained(str(tmp_path / "final"))
    teacher = PredictorModel.from_pretrained(str(tmp_path / "final"))
    teacher.predictor = None
    state = load_file(str(tmp_path / "final" / "method.safetensors"))
    teacher.load_state_dict({name[len("teacher.") :]: value for name, value in state.items()})
    data = load_image_dataset(None)
    knn = knn_data(data.train, data.evaluation, data.image_column, data.label_column, 8, False)
    teacher_accuracy = knn_top1(teacher.eval(), knn, k=1)
    student_accuracy = knn_top1(student.eval(), knn, k=1)
    print(f"kNN: reported {reported:.4f}, teacher {teacher_accuracy:.4f}, "
          f"student {student_accuracy:.4f}")  # fmt: skip
    assert reported == teacher_accuracy
    assert student_accuracy != teacher_accuracy


SIMCLR_QUEUE = ["--queue-size", "10", *MLP]


def test_simclr_with_a_queue_is_world_size_invariant_and_resumes(runs, images, tmp_path):
    """lightly's NTXentLoss(memory_bank_size=...): the negatives are a queue of past
    second views, here global and in the checkpoint."""
    student, state = differences(runs(1, *SIMCLR_QUEUE), runs(3, *SIMCLR_QUEUE))
    straight = runs(1, *SIMCLR_QUEUE)
    resumed = _resume(images, 1, straight / "checkpoint-3", tmp_path / "resumed", SIMCLR_QUEUE)
    resumed_student, resumed_state = differences(straight, resumed)
    print(f"simclr + queue, 1 vs 3 processes: student {student:.1e}, queue {state:.1e}; "
          f"resumed at step 3: {resumed_student:.1e}, {resumed_state:.1e}")  # fmt: skip
    assert student <= EXACT and state <= EXACT
    assert resumed_student == 0.0 and resumed_state == 0.0
