"""Sinkhorn-Knopp over the global batch (``losses.sinkhorn_knopp``): SwAV's codes and
DINOv2's teacher centering, the same assignments on any number of processes.

- One process: DINOv2's ``SinkhornKnoppTeacher`` as its repository writes it
  (``references``) and lightly's ``sinkhorn`` give ours, float64.
- 2 and 3 ranks with uneven shares and an idle rank: each rank's rows of the
  single-process assignments. Controls: lightly's distributed ``sinkhorn`` (its batch
  size is the local rows times W) and the per-rank algorithm are not.
- bf16 scores under autocast: float32 assignments, within bf16's rounding of float64's.
"""

from __future__ import annotations

import pytest
import torch

from contrastive_accelerate.testing import run_on_ranks
from losses import sinkhorn_knopp

import references

#: float64, the same operations on the same numbers but for the order of a sum's terms.
EXACT = 1e-12
PROTOTYPES, TEMPERATURE = 6, 0.05
SPLITS = {2: [5, 2], 3: [3, 0, 4]}


def scores(count: int) -> torch.Tensor:
    """Cosine-like scores of ``count`` samples against the prototypes, in [-1, 1]."""
    generator = torch.Generator().manual_seed(11)
    return torch.tanh(torch.randn(count, PROTOTYPES, generator=generator, dtype=torch.float64))


def test_one_process_is_dinov2s_and_lightlys_sinkhorn():
    lightly_swav = pytest.importorskip("lightly.loss.swav_loss")
    batch = scores(7)
    ours = sinkhorn_knopp(batch, TEMPERATURE, 3)
    dinov2 = references.sinkhorn_knopp_teacher(batch.clone(), TEMPERATURE, 3)
    lightly = lightly_swav.sinkhorn(batch.clone(), iterations=3, epsilon=TEMPERATURE)
    errors = (ours - dinov2).abs().max().item(), (ours - lightly).abs().max().item()
    print(f"sinkhorn_knopp vs DINOv2's {errors[0]:.1e}, vs lightly's {errors[1]:.1e}")
    assert max(errors) <= EXACT
    assert (ours.sum(dim=1) - 1).abs().max() <= EXACT  # each sample's codes sum to 1


def sinkhorn_worker(rank: int, world_size: int, sizes: list[int]) -> dict[str, float]:
    from lightly.loss.swav_loss import sinkhorn

    batch = scores(sum(sizes))
    whole = sinkhorn_knopp(batch, TEMPERATURE, 3, gather_distributed=False)
    rows = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
    mine = batch[rows]
    candidates = {
        "ours": sinkhorn_knopp(mine, TEMPERATURE, 3),
        "ours, sizes given": sinkhorn_knopp(mine, TEMPERATURE, 3, sizes=sizes),
        "per rank": sinkhorn_knopp(mine, TEMPERATURE, 3, gather_distributed=False),
        "lightly": sinkhorn(mine.clone(), 3, TEMPERATURE, gather_distributed=True),
    }
    return {name: (codes - whole[rows]).abs().max().item() if len(mine) else 0.0
            for name, codes in candidates.items()}  # fmt: skip


@pytest.mark.parametrize("world_size", list(SPLITS))
def test_every_rank_gets_its_rows_of_the_single_process_codes(world_size):
    pytest.importorskip("lightly")
    per_rank = run_on_ranks(sinkhorn_worker, world_size, SPLITS[world_size])
    worst = {name: max(result[name] for result in per_rank) for name in per_rank[0]}
    print(f"{world_size} ranks {SPLITS[world_size]}: "
          + ", ".join(f"{name} {value:.1e}" for name, value in worst.items()))  # fmt: skip
    assert worst["ours"] <= EXACT and worst["ours, sizes given"] <= EXACT
    assert worst["per rank"] > 1e3 * EXACT and worst["lightly"] > 1e3 * EXACT  # the controls


def test_bf16_scores_under_autocast_give_float32_codes():
    batch = scores(9)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        codes = sinkhorn_knopp(batch.bfloat16(), TEMPERATURE, 3)
    reference = sinkhorn_knopp(batch.bfloat16().double(), TEMPERATURE, 3)
    error = (codes.double() - reference).abs().max().item()
    print(f"bf16 scores: {codes.dtype} codes, {error:.1e} from float64 on the same values")
    assert codes.dtype == torch.float32 and error <= 1e-5


def test_large_scores_do_not_overflow():
    """Scores / temperature up to 100, beyond exp's range in float32 (88): shifted by
    their maximum, the codes stay finite and equal float64's."""
    batch = scores(5) * 5
    codes = sinkhorn_knopp(batch.float(), TEMPERATURE, 3)
    error = (codes.double() - sinkhorn_knopp(batch, TEMPERATURE, 3)).abs().max().item()
    assert torch.isfinite(codes).all() and error <= 1e-5


def test_bad_arguments_are_one_line():
    with pytest.raises(ValueError, match="temperature > 0"):
        sinkhorn_knopp(scores(3), 0.0)
