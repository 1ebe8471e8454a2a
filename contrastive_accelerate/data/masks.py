"""iBOT's and DINOv2's patch masks, drawn per sample: a sample's mask of a view is a
function of (seed, epoch, index, view) alone, so it is the same on any number of
processes and loader workers, as its augmentation is. The loader draws them
(``PatchMasking``, which ``data.MultiCrop`` takes), as DINOv2's collate does, so the step
reads nothing of them from the device.

DINOv2 draws them per batch (``collate_data_and_cast``): the first half of a batch's
samples get masking ratios spread evenly over ``[min, max]``, the rest none, then the
batch is shuffled, all from the process's global ``random``: a sample's mask depends
on which batch, which rank and which worker it lands in. Here each sample is masked
with probability ``probability`` at a ratio drawn uniformly from ``[min, max]``, as
blocks placed by BEiT's and DINOv2's ``MaskingGenerator`` (``block_mask``), every draw
from a generator keyed by the sample.

    masks = patch_masks(seed=0, epoch=3, indices=[17, 4], grid=(14, 14))  # (2, 14, 14) bool
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from contrastive_accelerate.data.sampler import derive_seed

#: ``derive_seed``'s stream for the patch masks.
MASK_STREAM = 5


def patch_masks(
    seed: int,
    epoch: int,
    indices: Sequence[int],
    grid: tuple[int, int],
    probability: float = 0.5,
    ratio: tuple[float, float] = (0.1, 0.5),
    view: int = 0,
) -> torch.Tensor:
    """``(len(indices), height, width)`` boolean masks, True where a patch is masked:
    sample ``i``'s mask of view ``view`` drawn from (seed, epoch, i, view) alone (DINOv2's
    defaults: half the samples masked, at ratios from 0.1 to 0.5)."""
    height, width = grid
    masks = torch.zeros((len(indices), height, width), dtype=torch.bool)
    for row, index in enumerate(indices):
        draws = random.Random(derive_seed(seed, MASK_STREAM, epoch, int(index), view))
        if draws.random() < probability:
            count = int(height * width * draws.uniform(*ratio))
            masks[row] = block_mask(grid, count, draws)
    return masks


@dataclass(frozen=True)
class PatchMasking:
    """How a sample's views are masked: the patch grid, the chance that a view is masked
    and the range of a masked view's share of patches (DINOv2's defaults)."""

    grid: tuple[int, int]
    probability: float = 0.5
    ratio: tuple[float, float] = (0.1, 0.5)

    def draw(self, seed: int, epoch: int, index: int, views: int) -> tuple[torch.Tensor, list[int]]:
        """``(views, patches)`` boolean masks of sample ``(epoch, index)``'s first ``views``
        views, and each one's count of masked patches, as host integers."""
        masks = torch.cat([
            patch_masks(seed, epoch, [index], self.grid, self.probability, self.ratio, view)
            for view in range(views)
        ]).flatten(1)  # fmt: skip
        return masks, [int(count) for count in masks.sum(dim=1)]


def block_mask(
    grid: tuple[int, int],
    count: int,
    draws: random.Random,
    min_patches: int = 4,
    min_aspect: float = 0.3,
) -> torch.Tensor:
    """About ``count`` patches of a ``grid`` masked in rectangular blocks, BEiT's and
    DINOv2's ``MaskingGenerator(grid, max_num_patches=0.5 * h * w)`` with ``draws`` for
    its ``random``: blocks of ``min_patches`` or more, aspect ratios from ``min_aspect``
    to its inverse, each adding only unmasked patches, until ``count`` are masked or
    no block fits."""
    height, width = grid
    mask = torch.zeros(grid, dtype=torch.bool)
    most = int(0.5 * height * width)
    log_aspect = (math.log(min_aspect), math.log(1 / min_aspect))
    masked = 0
    while masked < count:
        added = _one_block(mask, min(count - masked, most), draws, min_patches, log_aspect)
        if added == 0:
            break
        masked += added
    return mask


def _one_block(mask, limit: int, draws, min_patches: int, log_aspect) -> int:
    """DINOv2's ``MaskingGenerator._mask``: up to 10 tries at one block; the patches added."""
    height, width = mask.shape
    added = 0
    for _ in range(10):
        area = draws.uniform(min_patches, limit)
        aspect = math.exp(draws.uniform(*log_aspect))
        h, w = int(round(math.sqrt(area * aspect))), int(round(math.sqrt(area / aspect)))
        if w < width and h < height:
            top, left = draws.randint(0, height - h), draws.randint(0, width - w)
            already = int(mask[top : top + h, left : left + w].sum())
            if 0 < h * w - already <= limit:
                added += h * w - already
                mask[top : top + h, left : left + w] = True
            if added > 0:
                break
    return added
