"""Momentum teachers, queues and their losses (MoCo, BYOL): units, peers, exactness, bf16."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F
from lightly.loss import NegativeCosineSimilarity, NTXentLoss
from lightly.models.utils import update_momentum
from torch import nn

from contrastive_accelerate.testing import assert_loss_invariant
from losses import MoCoLoss, NegativeCosineSimilarityLoss
from models import SimCLR
from models.momentum import EMATeacher, KeyQueue, cosine_momentum


def test_cosine_momentum_runs_from_the_base_to_one():
    assert cosine_momentum(0, 100, 0.99) == 0.99
    assert cosine_momentum(100, 100, 0.99) == 1.0
    assert cosine_momentum(50, 100, 0.99) == pytest.approx(0.995, abs=1e-15)
    assert cosine_momentum(250, 100, 0.99) == 1.0  # past the end (a resumed, longer run)


def _student(dtype=torch.float32) -> SimCLR:
    torch.manual_seed(0)
    return SimCLR(backbone="mlp", image_size=4, prediction_hidden_dim=16).to(dtype)


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
