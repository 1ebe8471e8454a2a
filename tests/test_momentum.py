"""Momentum teachers, queues, centers, multi-crop and their losses (MoCo, BYOL, DINO):
units, peers, exactness, bf16."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F
import torchvision
from lightly.loss import DINOLoss as DINOLossLightly
from lightly.loss import NegativeCosineSimilarity, NTXentLoss
from lightly.models.utils import update_momentum
from torch import nn

from contrastive_accelerate.data import MultiCrop, load_image_dataset
from contrastive_accelerate.methods import METHODS
from contrastive_accelerate.optim import make_optimizer
from contrastive_accelerate.testing import assert_loss_invariant, run_on_ranks
from losses import DINOLoss, MoCoLoss, NegativeCosineSimilarityLoss
from losses.dino import CENTER_FORMULAS, batch_center
from models import PredictorModel, SimCLR
from models.momentum import EMATeacher, KeyQueue, cosine_momentum
from trainer import TrainConfig

import references


def test_cosine_momentum_runs_from_the_base_to_one():
    assert cosine_momentum(0, 100, 0.99) == 0.99
    assert cosine_momentum(100, 100, 0.99) == 1.0
    assert cosine_momentum(50, 100, 0.99) == pytest.approx(0.995, abs=1e-15)
    assert cosine_momentum(250, 100, 0.99) == 1.0  # past the end (a resumed, longer run)


def _student(dtype=torch.float32) -> PredictorModel:
    torch.manual_seed(0)
    return PredictorModel(backbone="mlp", image_size=4, prediction_hidden_dim=16).to(dtype)


def _nudge(student: nn.Module, size: float) -> None:
    with torch.no_grad():
        for parameter in student.parameters():
            parameter.add_(size * torch.randn_like(parameter))


def test_teacher_update_is_lightlys_ema_without_the_predictor():
    student = _student(torch.float64)
    teacher = EMATeacher(student, without=("predictor",))
    reference = EMATeacher(student, without=("predictor",))  # updated by lightly's function
    assert teacher.network.predictor is None and teacher.dtype == torch.float64
    assert not any(parameter.requires_grad for parameter in teacher.parameters())
    _nudge(student, 0.1)
    teacher.update(student, 0.9)
    student_without_predictor = EMATeacher(student, without=("predictor",)).network
    update_momentum(student_without_predictor, reference.network, 0.9)
    for (name, ours), theirs in zip(
        teacher.network.state_dict().items(), reference.network.state_dict().values(), strict=True
    ):
        assert torch.equal(ours, theirs), name
    moved = [
        n
        for n, p in teacher.network.named_parameters()
        if not torch.equal(p, getattr_path(student, n))
    ]
    assert moved  # it moved towards the student, not onto it


def getattr_path(module: nn.Module, name: str) -> torch.Tensor:
    return dict(module.named_parameters())[name]


@pytest.mark.parametrize("autocast", [False, True])
def test_teacher_stays_float32_and_follows_the_exact_ema_where_bf16_does_not(autocast):
    """The control: the same updates to a bf16 copy are below its rounding step (an
    update of 0.004 x 1e-3 against an ulp of 0.4% of the weight), so it drifts away."""
    student = _student()
    teacher, bf16 = EMATeacher(student), EMATeacher(student, dtype=torch.bfloat16)
    exact = EMATeacher(student, dtype=torch.float64)
    start = [parameter.clone() for parameter in exact.network.parameters()]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        for _ in range(10):
            _nudge(student, 1e-3)
            for copy in (teacher, bf16, exact):
                copy.update(student, 0.996)
    assert all(p.dtype == torch.float32 for p in teacher.parameters())

    def error(copy: EMATeacher) -> float:
        pairs = zip(copy.network.parameters(), exact.network.parameters(), strict=True)
        return max((ours.double() - ideal).abs().max().item() for ours, ideal in pairs)

    moved = max(
        (ideal - first).abs().max().item()
        for ideal, first in zip(exact.network.parameters(), start, strict=True)
    )
    print(
        f"exact EMA moved {moved:.1e}; error float32 {error(teacher):.1e}, bf16 {error(bf16):.1e}"
    )
    # float32: ten updates, each a few roundings of weights below 1 (ulp <= 1.2e-7).
    assert error(teacher) < 1e-6
    assert error(bf16) > 100 * error(teacher)


def test_queue_is_a_fifo_of_whole_batches_in_sample_order():
    queue = KeyQueue(size=5, dim=1, dtype=torch.float64)
    assert queue.keys().shape == (0, 1)
    rows = torch.arange(20, dtype=torch.float64)[:, None]
    queue.push(rows[:3])  # 5 is not a multiple of 3: MoCo's assert is not needed
    assert queue.keys().flatten().tolist() == [0, 1, 2]
    queue.push(rows[3:6])
    assert queue.keys().flatten().tolist() == [1, 2, 3, 4, 5]
    queue.push(rows[6:7])  # a partial last batch, enqueued whole
    assert queue.keys().flatten().tolist() == [2, 3, 4, 5, 6]
    queue.push(rows[7:14])  # more than the queue: its newest 5
    assert queue.keys().flatten().tolist() == [9, 10, 11, 12, 13]
    restored = KeyQueue(size=5, dim=1, dtype=torch.float64)
    restored.load_state_dict(queue.state_dict())
    assert torch.equal(restored.keys(), queue.keys())
    with pytest.raises(ValueError, match="features"):
        KeyQueue(size=5, dim=2, dtype=torch.float64).load_state_dict(queue.state_dict())


def _pairs(rows: int = 12, dim: int = 8, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return (
        torch.randn(rows, dim, generator=generator, dtype=torch.float64),
        torch.randn(rows, dim, generator=generator, dtype=torch.float64),
    )


def _bank(rows: int = 7, dim: int = 8) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return F.normalize(torch.randn(rows, dim, generator=generator, dtype=torch.float64), dim=1)


def _moco_inputs():
    return (*_pairs(), _bank())


def _moco_reference(queries, keys, queue, temperature, batch_negatives=True):
    q, k = F.normalize(queries, dim=1), F.normalize(keys, dim=1)
    positive = (q * k).sum(1, keepdim=True)
    batch = q @ k.T if batch_negatives else positive
    logits = torch.cat([batch, q @ queue.T], dim=1) / temperature
    return F.cross_entropy(
        logits, torch.arange(len(q)) if batch_negatives else torch.zeros(len(q), dtype=torch.long)
    )


@pytest.mark.parametrize("batch_negatives", [True, False])
def test_moco_loss_is_cross_entropy_over_batch_keys_and_queue(batch_negatives):
    queries, keys, queue = _moco_inputs()
    ours = MoCoLoss(0.2, batch_negatives=batch_negatives)(queries, keys, queue)
    reference = _moco_reference(queries, keys, queue, 0.2, batch_negatives)
    assert ours.item() == pytest.approx(reference.item(), abs=1e-12)


def test_moco_loss_without_batch_negatives_is_lightlys_memory_bank_ntxent():
    """Peer parity: lightly's NT-Xent with a memory bank, value and the step's gradient."""
    queries, keys = _pairs()
    bank = _bank(16)
    theirs = NTXentLoss(0.2, memory_bank_size=(16, 8))
    theirs.memory_bank.bank = bank.clone()
    q_theirs, q_ours = queries.clone().requires_grad_(), queries.clone().requires_grad_()
    value_theirs = theirs(q_theirs, keys)
    value_ours = MoCoLoss(0.2, batch_negatives=False)(q_ours, keys, bank)
    value_theirs.backward()
    value_ours.backward()
    difference = (q_ours.grad - q_theirs.grad).abs().max().item()
    value = abs(value_ours - value_theirs).item()
    print(f"MoCoLoss vs lightly's memory-bank NTXentLoss: value {value:.1e}, grad {difference:.1e}")
    assert value_ours.item() == pytest.approx(value_theirs.item(), abs=1e-12)
    assert difference < 1e-12


def test_one_sample_needs_no_second_without_batch_negatives():
    """A global batch of 1: without batch negatives, the queue's M keys are its negatives
    (lightly's memory-bank NT-Xent, as above) and an empty queue gives 0; with batch
    negatives and no queue it has none, and is refused."""
    queries, keys = (x[:1] for x in _pairs())
    bank = _bank(16)
    theirs = NTXentLoss(0.2, memory_bank_size=(16, 8))
    theirs.memory_bank.bank = bank.clone()
    ours = MoCoLoss(0.2, batch_negatives=False)(queries, keys, bank)
    assert ours.item() == pytest.approx(theirs(queries, keys).item(), abs=1e-12)
    assert MoCoLoss(0.2, batch_negatives=False)(queries, keys, bank[:0]).item() == 0.0
    assert MoCoLoss(0.2)(queries, keys, bank).item() == pytest.approx(ours.item(), abs=1e-12)
    with pytest.raises(ValueError, match="at least 2 are needed so that every sample"):
        MoCoLoss(0.2)(queries, keys)


def test_negative_cosine_is_lightlys():
    x0, x1 = (x.requires_grad_() for x in _pairs())
    y0, y1 = (x.detach().clone().requires_grad_() for x in (x0, x1))
    ours, theirs = NegativeCosineSimilarityLoss()(x0, x1), NegativeCosineSimilarity()(y0, y1)
    (ours + 0).backward()
    theirs.backward()
    assert ours.item() == pytest.approx(theirs.item(), abs=1e-14)
    assert torch.allclose(x0.grad, y0.grad, atol=1e-14, rtol=0)


@pytest.mark.parametrize(
    "make_loss, make_inputs",
    [
        (partial(MoCoLoss, 0.2), _moco_inputs),
        (partial(MoCoLoss, 0.2, batch_negatives=False), _moco_inputs),
        (partial(MoCoLoss, 0.2), _pairs),
        (NegativeCosineSimilarityLoss, _pairs),
    ],
    ids=["moco+queue", "moco-v2", "moco-v3", "byol"],
)
def test_momentum_losses_are_exact_on_any_number_of_processes(make_loss, make_inputs):
    report = assert_loss_invariant(make_loss, make_inputs)
    print(f"worst difference {report.worst:.1e}")


def test_moco_with_local_keys_only_is_not_exact():
    """The control: without the gather each rank sees its own keys only."""
    with pytest.raises(AssertionError):
        assert_loss_invariant(
            partial(MoCoLoss, 0.2, gather_distributed=False), _moco_inputs, world_sizes=(2,)
        )


@pytest.mark.parametrize(
    "loss, inputs",
    [(MoCoLoss(0.2), _moco_inputs), (NegativeCosineSimilarityLoss(), _pairs)],
    ids=["moco", "byol"],
)
def test_momentum_losses_compute_in_float32_under_bf16_autocast(loss, inputs):
    float32 = [x.float() for x in inputs()]
    reference = loss(*float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = loss(*float32)
    bf16 = loss(*[x.bfloat16() for x in float32])
    assert autocast.dtype == torch.float32
    assert autocast.item() == pytest.approx(reference.item(), abs=1e-6)
    # bf16 inputs: only their own rounding (3 significant digits) is left.
    assert bf16.item() == pytest.approx(reference.item(), rel=2e-2)


def _dino_inputs(rows: int = 12, dim: int = 16):
    """Three student crops, two teacher crops (the global ones) and a center."""
    generator = torch.Generator().manual_seed(2)
    crops = [torch.randn(rows, dim, generator=generator, dtype=torch.float64) for _ in range(5)]
    return (*crops, 0.1 * torch.randn(1, dim, generator=generator, dtype=torch.float64))


class CropsDINOLoss(nn.Module):
    """DINOLoss on tensors (the harness splits tensors, not lists): 3 student crops."""

    def __init__(self, teacher_temperature: float = 0.04, local: bool = False) -> None:
        super().__init__()
        self.loss = DINOLoss(0.1, gather_distributed=not local)  # local: the control
        self.teacher_temperature = teacher_temperature

    def forward(self, s0, s1, s2, t0, t1, center, *, sizes=None):
        return self.loss([s0, s1, s2], [t0, t1], self.teacher_temperature, center, sizes=sizes)


def test_dino_loss_and_center_are_lightlys():
    """Peer parity: lightly's DINOLoss with the same center, value, gradient and center."""
    *crops, center = _dino_inputs()
    ours_in = [crop.clone().requires_grad_() for crop in crops]
    theirs_in = [crop.clone().requires_grad_() for crop in crops]
    theirs = DINOLossLightly(output_dim=16, teacher_temp=0.04, student_temp=0.1)
    theirs.center = center.clone()[None]
    value_theirs = theirs(theirs_in[3:], theirs_in[:3])
    # lightly holds the teacher temperature as a float32 tensor: give ours the same value.
    temperature = torch.tensor(0.04).item()
    value_ours = DINOLoss(0.1)(ours_in[:3], ours_in[3:], temperature, center)
    value_theirs.backward()
    value_ours.backward()
    gradient = max(
        (a.grad - b.grad).abs().max().item() for a, b in zip(ours_in, theirs_in, strict=True)
    )
    ours_center = 0.9 * center + 0.1 * batch_center(crops[3:])
    center_error = (ours_center - theirs.center[0]).abs().max().item()
    print(f"DINOLoss vs lightly: value {abs(value_ours - value_theirs).item():.1e}, "
          f"gradient {gradient:.1e}, center {center_error:.1e}")  # fmt: skip
    assert value_ours.item() == pytest.approx(value_theirs.item(), abs=1e-12)
    assert gradient < 1e-12 and center_error < 1e-15


def test_dino_loss_is_exact_on_any_number_of_processes():
    report = assert_loss_invariant(CropsDINOLoss, _dino_inputs)
    print(f"worst difference {report.worst:.1e}")


def centers_worker(rank: int, world_size: int, sizes: list[int]) -> dict:
    crops = [crop[sum(sizes[:rank]) : sum(sizes[: rank + 1])] for crop in _dino_inputs()[3:5]]
    return {formula: batch_center(crops, sizes, formula=formula) for formula in CENTER_FORMULAS} | {
        "unknown sizes": batch_center(crops, None)
    }


def test_the_center_is_the_global_mean_and_dinos_formula_is_not_on_uneven_shares():
    global_mean = batch_center(_dino_inputs()[3:5])
    for record in run_on_ranks(centers_worker, 2, [8, 4]):
        ours = max(
            (record[k] - global_mean).abs().max().item() for k in ("global", "unknown sizes")
        )
        dinos = (record["dino"] - global_mean).abs().max().item()
        print(f"center on [8, 4] rows: ours {ours:.1e}, DINO's formula {dinos:.1e}")
        assert ours < 1e-15
        assert dinos > 1e-3  # the control: DINO's all_reduce(sum) / (local rows x W)


def test_dino_loss_computes_in_float32_under_bf16_autocast():
    float32 = [x.float() for x in _dino_inputs()]
    reference = CropsDINOLoss()(*float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = CropsDINOLoss()(*float32)
    assert autocast.dtype == torch.float32
    assert autocast.item() == pytest.approx(reference.item(), abs=1e-6)


def test_multi_crop_draws_each_samples_crops_from_its_seed_epoch_and_index():
    images = [{"image": torch.randint(0, 256, (3, 12, 12), dtype=torch.uint8)} for _ in range(3)]
    crops = MultiCrop(images, "image", 8, seed=0, global_crops=2, local_crops=3, local_crop_size=4)
    first, again, other_epoch = crops[(0, 1)], crops[(0, 1)], crops[(1, 1)]
    assert [c.shape[-1] for c in first[0]] == [8, 8] and [c.shape[-1] for c in first[1]] == [4] * 3
    assert all(
        torch.equal(a, b) for a, b in zip(first[0] + first[1], again[0] + again[1], strict=True)
    )
    assert not torch.equal(first[1][0], other_epoch[1][0])
    batch = crops.collate([crops[(0, index)] for index in range(3)])
    assert batch.global_crops.shape == (2, 3, 3, 8, 8) and batch.local_crops.shape == (
        3,
        3,
        3,
        4,
        4,
    )
    pieces = batch.split(2)
    assert [len(piece.indices) for piece in pieces] == [2, 1]
    assert torch.equal(pieces[1].local_crops[2, 0], batch.local_crops[2, 2])
    empty = crops.collate([])
    assert empty.global_crops.shape == (2, 0, 3, 8, 8) and empty.local_crops.shape == (
        3,
        0,
        3,
        4,
        4,
    )


def test_an_empty_queue_adds_no_negatives():
    queries, keys = _pairs()
    empty = torch.empty(0, 8, dtype=torch.float64)
    assert MoCoLoss(0.2)(queries, keys, empty).item() == MoCoLoss(0.2)(queries, keys).item()
    assert MoCoLoss(0.2, batch_negatives=False)(queries, keys, empty).item() == 0.0


@pytest.mark.parametrize(
    "make_loss, make_inputs",
    [
        (partial(NegativeCosineSimilarityLoss, gather_distributed=False), _pairs),
        (partial(CropsDINOLoss, local=True), _dino_inputs),
    ],
    ids=["byol", "dino"],
)
def test_control_per_rank_means_are_not_exact_on_uneven_shares(make_loss, make_inputs):
    """Without the global normalisation, each rank's mean: exact only for equal shares."""
    with pytest.raises(AssertionError):
        assert_loss_invariant(make_loss, make_inputs, world_sizes=(2,))


@pytest.mark.parametrize(
    "frozen_epochs, frozen_steps", [(1, 0), (0, 1), (0, 0)],
    ids=["an-epoch", "a-step", "control-not-frozen"],
)  # fmt: skip
def test_dinos_last_layer_is_left_alone_during_the_frozen_epochs(frozen_epochs, frozen_steps):
    """DINO's ``cancel_gradients_last_layer``: no gradient, so SGD with weight decay and
    momentum leaves the last layer exactly as it was during the frozen epochs or steps
    (here one of each epoch); the rest of the model moves. The control (nothing frozen)
    moves it too."""
    config = TrainConfig(
        method="dino", model="mlp", dino_out_dim=16, freeze_last_layer=frozen_epochs,
        freeze_last_layer_steps=frozen_steps,
    ).resolved()  # fmt: skip
    method = METHODS["dino"].build(config, load_image_dataset(), 1, print, total_steps=4)
    optimizer = make_optimizer("sgd", method.model.parameters(), lr=0.1, momentum=0.9,
                               weight_decay=5e-4)  # fmt: skip
    batch = method.dataset.collate([method.dataset[(0, index)] for index in range(8)])
    head = method.model.projection_head
    for epoch in (0, 1):
        last_layer = head.last_layer.detach().clone()
        first_layer = head.mlp[0].weight.detach().clone()
        method.loss([method.embed(method.model, batch, epoch)], batch, None, epoch).backward()
        method.before_optimizer_step(epoch, epoch)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        method.after_step(epoch)
        assert not torch.equal(head.mlp[0].weight, first_layer)
        frozen = epoch < max(frozen_epochs, frozen_steps)
        assert torch.equal(head.last_layer, last_layer) == frozen


def test_the_vit_takes_local_crops_with_dinos_interpolated_position_embeddings():
    """At its own size the ViT is torchvision's; at a local crop's size its position
    embeddings are DINO's ``interpolate_pos_encoding`` bit for bit, where torchvision's
    own forward (the control) refuses the local crop."""
    torch.manual_seed(0)
    vit = SimCLR("vit_tiny", image_size=16).double().encoder  # patches of 2 px: an 8x8 grid
    images = torch.randn(3, 3, 16, 16, dtype=torch.float64)
    assert torch.equal(vit(images), torchvision.models.VisionTransformer.forward(vit, images))
    embedding = vit.encoder.pos_embedding
    for grid in (4, 6):
        expected = references.dino_interpolate_pos_encoding(embedding, 2 * grid, 2 * grid, 2)
        assert torch.equal(vit.position_embedding(grid), expected)
    local_crops = torch.randn(3, 3, 8, 8, dtype=torch.float64)
    with pytest.raises(AssertionError, match="Wrong image height"):
        torchvision.models.VisionTransformer.forward(vit, local_crops)
    local = vit(local_crops)
    local.sum().backward()  # the trained embeddings learn from the local crops too
    assert local.shape == (3, 192) and embedding.grad[:, 1:].abs().sum() > 0
    with pytest.raises(ValueError, match="square inputs divisible by 2 px"):
        vit(torch.randn(1, 3, 7, 7, dtype=torch.float64))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.isfinite(vit.float()(torch.randn(2, 3, 8, 8))).all()
