"""iBOT's parts, exact on any number of processes (for DINOv2's objective, issue 60): the
patch masks drawn per sample (``data.masks``) and the masked-patch loss
(``losses.IBOTPatchLoss``).

- Masks: ``block_mask`` is DINOv2's ``MaskingGenerator`` given the same draws; a
  sample's mask is the same on 1, 2 and 3 real processes. The control: DINOv2's per-batch
  draw, each rank's ``random`` seeded by seed + rank as DINOv2 seeds it, is not.
- Loss: on one process lightly's ``IBOTPatchLoss`` (the same center), float64; on 2 and
  3 ranks with uneven shares and an idle rank, the single-process value and gradients.
  The control: lightly's, dividing by each rank's own number of images, is not.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from contrastive_accelerate.collectives import all_gather_rows
from contrastive_accelerate.data.masks import block_mask, patch_masks
from contrastive_accelerate.testing import run_on_ranks
from losses import IBOTPatchLoss

import references

EXACT = 1e-12  # float64: the same terms, summed in another order
GRID, PROTOTYPES, SEED, EPOCH = (4, 4), 7, 3, 2
#: A teacher temperature that float32 holds exactly: lightly makes it a float32 tensor.
TEACHER_TEMPERATURE = 0.0625


@pytest.mark.parametrize("count", [0, 3, 6, 8, 12])
def test_block_masks_are_dinov2s_masking_generator(count):
    for seed in range(5):
        random.seed(seed)  # the peer draws from random's global generator
        theirs = references.MaskingGenerator(GRID, max_num_patches=0.5 * 16)(count)
        ours = block_mask(GRID, count, random.Random(seed))
        assert torch.equal(ours, theirs), (count, seed)
        assert int(ours.sum()) <= max(count, 0) + 16 // 2  # blocks may overshoot by one


def masks_worker(rank: int, world_size: int, count: int) -> dict[str, torch.Tensor]:
    """Each rank's contiguous share of ``count`` samples: ours, and DINOv2's per-batch
    draw from ``random`` seeded by seed + rank, gathered in rank order."""
    share = torch.arange(count).tensor_split(world_size)[rank].tolist()
    ours = patch_masks(SEED, EPOCH, share, GRID)
    random.seed(SEED + rank)
    theirs = references.dinov2_collate_masks(len(share), GRID)
    return {name: all_gather_rows(masks.flatten(1).to(torch.uint8)) if world_size > 1
            else masks.flatten(1).to(torch.uint8)
            for name, masks in (("ours", ours), ("dinov2", theirs))}  # fmt: skip


def test_a_samples_mask_is_the_same_on_any_number_of_processes():
    one = masks_worker(0, 1, 12)
    differences = {}
    for world_size in (2, 3):
        gathered = run_on_ranks(masks_worker, world_size, 12)[0]
        differences[world_size] = {name: int((gathered[name] != one[name]).any(1).sum())
                                   for name in one}  # fmt: skip
    print(f"samples whose mask differs from 1 process's, of 12: {differences}")
    assert one["ours"].any(1).sum() >= 3  # masks, not nothing
    assert all(counts["ours"] == 0 for counts in differences.values())
    assert all(counts["dinov2"] > 0 for counts in differences.values())  # the control


def batch(images: int, seed: int = 0):
    """Masks for ``images`` (the second left unmasked), and float64 student and teacher
    outputs of their masked patches. Each image's count of masked patches is a power of
    2: lightly weighs each patch by 1 / count in float32, which then holds it exactly."""
    generator = torch.Generator().manual_seed(seed)
    masks = torch.zeros(images, GRID[0] * GRID[1], dtype=torch.bool)
    for image in range(images):
        count = (2, 0, 4, 1, 8, 4, 2, 1)[image % 8]
        masks[image, torch.randperm(GRID[0] * GRID[1], generator=generator)[:count]] = True
    masks = masks.unflatten(1, GRID)
    count = int(masks.sum())
    student = torch.randn(count, PROTOTYPES, generator=generator, dtype=torch.float64)
    teacher = torch.randn(count, PROTOTYPES, generator=generator, dtype=torch.float64)
    # float32 values: lightly keeps its center in a float32 buffer
    center = (0.1 * torch.randn(1, PROTOTYPES, generator=generator)).double()
    return masks, student, teacher, center


def test_one_process_is_lightlys_ibot_patch_loss():
    lightly_ibot = pytest.importorskip("lightly.loss.ibot_loss")
    masks, student, teacher, center = batch(6)
    values, gradients = [], []
    peer = lightly_ibot.IBOTPatchLoss(PROTOTYPES, teacher_temp=TEACHER_TEMPERATURE)
    peer.center.value.copy_(center)
    for loss_fn in (
        lambda s: IBOTPatchLoss(0.1)(s, teacher, masks, TEACHER_TEMPERATURE, center),
        lambda s: peer(teacher, s, masks),
    ):
        leaf = student.clone().requires_grad_()
        value = loss_fn(leaf)
        value.backward()
        values.append(value.item())
        gradients.append(leaf.grad)
    errors = abs(values[0] - values[1]), (gradients[0] - gradients[1]).abs().max().item()
    print(f"IBOTPatchLoss vs lightly's: value {errors[0]:.1e}, gradients {errors[1]:.1e}")
    assert max(errors) <= EXACT


def loss_worker(rank: int, world_size: int, sizes: list[int]) -> dict[str, float]:
    """This rank's images of one global batch: ours and lightly's per-rank value, and our
    input gradients times W against one process's."""
    from lightly.loss.ibot_loss import IBOTPatchLoss as LightlyIBOT

    masks, student, teacher, center = batch(sum(sizes))
    whole = IBOTPatchLoss(0.1, gather_distributed=False)  # one process's view
    leaf = student.clone().requires_grad_()
    whole(leaf, teacher, masks, 0.04, center).backward()
    images = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
    counts = masks.flatten(1).sum(1)
    patches = slice(int(counts[: images.start].sum()), int(counts[: images.stop].sum()))
    mine = student[patches].clone().requires_grad_()
    value = IBOTPatchLoss(0.1)(mine, teacher[patches], masks[images], 0.04, center)
    value.backward()
    peer = LightlyIBOT(PROTOTYPES, teacher_temp=0.04, student_temp=0.1)
    peer.center.value.copy_(center)
    # Every rank calls it: its center's update is a collective. An idle rank's is 0 / 0.
    peer_value = peer(teacher[patches], student[patches], masks[images]).item()
    peer_value = peer_value if sizes[rank] else 0.0
    values = torch.tensor([value.item(), float(peer_value)], dtype=torch.float64)
    dist.all_reduce(values)
    single = whole(student, teacher, masks, 0.04, center).item()
    return {
        "value": abs(values[0].item() / world_size - single),
        "gradients": (mine.grad / world_size - leaf.grad[patches]).abs().max().item()
        if len(mine)
        else 0.0,
        "lightly": abs(values[1].item() / world_size - single),
    }


@pytest.mark.parametrize("sizes", [[4, 2], [3, 0, 4]], ids=["W2", "W3-idle"])
def test_every_split_over_ranks_is_one_process(sizes):
    pytest.importorskip("lightly")
    per_rank = run_on_ranks(loss_worker, len(sizes), sizes)
    worst = {name: max(result[name] for result in per_rank) for name in per_rank[0]}
    print(f"IBOTPatchLoss on shares {sizes}: value {worst['value']:.1e}, gradients "
          f"{worst['gradients']:.1e}; lightly's per-rank mean {worst['lightly']:.1e}")  # fmt: skip
    assert worst["value"] <= EXACT and worst["gradients"] <= EXACT
    assert worst["lightly"] > 1e3 * EXACT  # the control


def test_bf16_outputs_under_autocast_give_a_float32_loss():
    masks, student, teacher, center = batch(6)
    leaf = student.bfloat16().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        value = IBOTPatchLoss(0.1)(leaf, teacher.bfloat16(), masks, 0.04, center)
    value.backward()
    reference = IBOTPatchLoss(0.1)(student.bfloat16().double(), teacher.bfloat16().double(),
                                   masks, 0.04, center)  # fmt: skip
    error = abs(value.item() - reference.item())
    print(f"IBOTPatchLoss on bf16 outputs: {value.dtype}, {error:.1e} from float64")
    assert value.dtype == torch.float32 and leaf.grad.dtype == torch.bfloat16 and error <= 1e-5


def test_patch_rows_that_are_not_the_masked_patches_are_one_line():
    masks, student, teacher, center = batch(6)
    with pytest.raises(RuntimeError, match="not one for each masked patch"):
        IBOTPatchLoss()(student[1:], teacher[1:], masks, 0.04, center)
