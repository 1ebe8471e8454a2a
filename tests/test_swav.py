"""SwAV (``--method swav``): its loss against lightly's, exact on any number of
processes with a queue held whole on every rank, and the method's queue and frozen
prototypes in training. Its 1 vs 2 vs 3 processes runs on every tower and source, and
its mid-epoch resume on another number of processes, are ``test_composition``'s.

- One process: lightly's ``SwaVLoss`` (global and local crops, with and without a
  queue), float64: value and gradients.
- 2 and 3 ranks, even, uneven and with an idle rank, a queue split among them: value
  and every input's gradient equal one process's (``assert_loss_invariant``, 1e-10).
  Control: the per-rank codes (lightly's and SwAV's ``local rows x W``) are not.
- Trained: the queue of global keys trains the same model on 1 and 2 processes
  (``test_composition``); the control here, each rank queueing its own keys (SwAV's
  per-rank queue), does not. The prototypes do not move while frozen, whatever the
  learning rate; unfrozen (the control), they do.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from contrastive_accelerate.testing import assert_loss_invariant
from losses import SwAVLoss
from models import SwAVModel

from launch import TrainerRuns, final_files_difference

#: float64: the same sums in another order.
EXACT = 1e-12
PROTOTYPES, ROWS, QUEUE = 5, 9, 4


#: One uneven split is enough for a control to fail.
UNEVEN = {2: [[5, 4]]}


def crops(count: int = 3, rows: int = ROWS) -> list[torch.Tensor]:
    """Scores of unit vectors against unit prototypes: in [-1, 1], as the model's."""
    generator = torch.Generator().manual_seed(3)
    return [torch.tanh(torch.randn(rows, PROTOTYPES, generator=generator, dtype=torch.float64))
            for _ in range(count)]  # fmt: skip


@pytest.mark.parametrize("queue", [False, True], ids=["no queue", "queue"])
def test_one_process_is_lightlys_swav_loss(queue):
    lightly_swav = pytest.importorskip("lightly.loss.swav_loss")
    ours_in = [crop.requires_grad_() for crop in crops()]
    theirs_in = [crop.detach().clone().requires_grad_() for crop in ours_in]
    queued = crops(2, QUEUE) if queue else None
    ours = SwAVLoss()(ours_in[:2], ours_in[2:], queued)
    theirs = lightly_swav.SwaVLoss()(theirs_in[:2], theirs_in[2:], queued)
    ours.backward()
    theirs.backward()
    pairs = zip(ours_in, theirs_in, strict=True)
    gradient = max((a.grad - b.grad).abs().max().item() for a, b in pairs)
    value = abs(ours.item() - theirs.item())
    print(f"SwAVLoss vs lightly's ({'queue' if queue else 'no queue'}): value {value:.1e}, "
          f"gradients {gradient:.1e}")  # fmt: skip
    assert value <= EXACT and gradient <= EXACT


class CropsSwAVLoss(torch.nn.Module):
    """SwAVLoss on tensors (the harness splits tensors of the batch's rows, and hands the
    queue, of another length, whole to every rank, which takes its share)."""

    def __init__(self, per_rank: bool = False) -> None:
        super().__init__()
        self.loss = SwAVLoss(sinkhorn_gather_distributed=not per_rank)

    def forward(self, g0, g1, local, queue0, queue1, *, sizes=None):
        queues, queue_sizes = [queue0, queue1], None
        if torch.distributed.is_initialized() and self.loss.gather_distributed:
            world_size, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
            shares = [queue.tensor_split(world_size) for queue in queues]
            queues = [share[rank] for share in shares]
            queue_sizes = [len(share) for share in shares[0]]
        return self.loss([g0, g1], [local], queues, sizes=sizes, queue_sizes=queue_sizes)


class PerRankSwAVLoss(CropsSwAVLoss):
    """The control: each rank's codes from its own rows (and its own queue)."""

    def __init__(self) -> None:
        super().__init__(per_rank=True)


def swav_inputs() -> list[torch.Tensor]:
    return [*crops(), *crops(2, QUEUE)]


def test_swav_loss_is_exact_on_any_number_of_processes():
    report = assert_loss_invariant(CropsSwAVLoss, swav_inputs)
    print(f"SwAVLoss with a queue, 2 and 3 ranks: worst difference {report.worst:.1e}")


def test_control_per_rank_codes_are_another_loss():
    with pytest.raises(AssertionError, match="not exact"):
        assert_loss_invariant(PerRankSwAVLoss, swav_inputs, world_sizes=(2,), splits=UNEVEN)


def test_swav_loss_computes_in_float32_under_bf16_autocast():
    float32 = [x.float() for x in swav_inputs()]
    reference = CropsSwAVLoss()(*float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = CropsSwAVLoss()(*float32)
    assert autocast.dtype == torch.float32
    assert autocast.item() == pytest.approx(reference.item(), abs=1e-6)


def test_the_model_gives_unit_projections_and_their_scores_on_unit_prototypes():
    torch.manual_seed(0)
    model = SwAVModel(backbone="mlp", image_size=4, projection_dim=6, prototypes=PROTOTYPES)
    z, scores = model(torch.randn(3, 3, 4, 4)).split([6, PROTOTYPES], dim=1)
    norms = model.prototypes.weight.norm(dim=1)
    assert torch.allclose(norms, torch.ones_like(norms))
    assert torch.allclose(z.norm(dim=1), torch.ones(3, dtype=z.dtype))
    assert torch.allclose(scores, z @ model.prototypes.weight.T)


COMMON = ["--method", "swav", "--model", "mlp", "--dtype", "float64", "--batch-size", "6",
          "--image-size", "8", "--lr", "0.1", "--prototypes", "8", "--num-workers", "0",
          "--knn-k", "0", "--log-every", "5"]  # fmt: skip
QUEUED = ("--queue-size", "10", "--max-steps", "5", "--freeze-prototypes-steps", "0")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, image_folder):
    return TrainerRuns(tmp_path_factory, *COMMON, "--dataset", image_folder)


def test_control_each_rank_queueing_its_own_keys_trains_another_model(runs):
    one = runs(1, *QUEUED)
    exact = final_files_difference(one, runs(2, *QUEUED))
    per_rank = final_files_difference(one, runs(2, *QUEUED, "--queue-keys", "per-rank"))
    print(f"queue of global keys, 1 vs 2 processes: {exact:.1e}; per-rank keys {per_rank:.1e}")
    assert exact <= 1e-9 < 1e-4 < per_rank


def prototypes(run) -> torch.Tensor:
    return load_file(str(run / "final" / "model.safetensors"))["prototypes.weight"]


def test_frozen_prototypes_stay_whatever_the_learning_rate(runs):
    frozen = ("--max-steps", "2", "--freeze-prototypes-steps", "2")
    slow, fast = runs(1, *frozen), runs(1, *frozen, "--lr", "0.5")
    unfrozen = runs(1, "--max-steps", "2", "--freeze-prototypes-steps", "1", "--lr", "0.5")
    still = (prototypes(slow) - prototypes(fast)).abs().max().item()
    moved = (prototypes(fast) - prototypes(unfrozen)).abs().max().item()
    encoder = final_files_difference(slow, fast)
    print(f"frozen prototypes at lr 0.1 vs 0.5: {still:.1e} (the models: {encoder:.1e}); "
          f"unfrozen for the last step: {moved:.1e}")  # fmt: skip
    assert still == 0.0 and encoder > 1e-3 and moved > 1e-3
