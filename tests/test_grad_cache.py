"""Gradient caching (``cached_backward``) against one pass over the whole batch, float64.

The reference is computed here: the same model, loss and per-sample dropout keys, one
forward and one backward on the whole batch. Negative controls: plain accumulation
(each chunk's loss sees only its own negatives) and a recompute whose dropout draws
fresh masks (torch's ``nn.Dropout``); both must miss by orders of magnitude.
"""

from __future__ import annotations

import contextlib
import copy
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from contrastive_accelerate.data import TwoViewBatch, load_image_dataset
from contrastive_accelerate.grad_cache import cached_backward
from contrastive_accelerate.methods import SIMCLR_LOSSES, SimCLRMethod
from contrastive_accelerate.testing import run_on_ranks
from losses import InfoNCELoss, NTXentLoss
from models import SimCLR, convert_sample_dropout, sample_keys, sample_randomness
from trainer import TrainConfig

EXACT = 1e-10  # float64: only the order of the per-chunk sums differs
MISSES = 1e-6  # a control must be at least this far off (they land at 1e-3 and above)
CHUNKS = 4
PAIRS = 12


def _model(backbone: str, per_sample: bool = True, logit_scale: bool = True) -> SimCLR:
    torch.manual_seed(0)
    scale = 1 / 0.07 if logit_scale else None
    model = SimCLR(backbone, image_size=8, dropout=0.1, logit_scale=scale).double()
    return convert_sample_dropout(model) if per_sample else model


def _batch(pairs: int = PAIRS, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    views = torch.randn(2, pairs, 3, 8, 8, generator=generator, dtype=torch.float64)
    return views[0], views[1], torch.arange(100, 100 + pairs)


def _embed(model, chunk, step: int = 3) -> torch.Tensor:
    view0, view1, indices = chunk
    keys = torch.cat([sample_keys(0, step, indices, view) for view in (0, 1)])
    with sample_randomness(keys):
        return model(torch.cat([view0, view1]))


def _loss_fn(name: str, model: SimCLR):
    criterion = NTXentLoss(0.5) if name == "ntxent" else InfoNCELoss()

    def loss(outputs: list[torch.Tensor]) -> torch.Tensor:
        out0 = torch.cat([o[: len(o) // 2] for o in outputs])
        out1 = torch.cat([o[len(o) // 2 :] for o in outputs])
        if name == "ntxent":
            return criterion(out0, out1)
        # The learnable logit scale is used by the loss directly, not by the forward.
        scale = model.log_logit_scale.exp()
        return criterion(F.normalize(out0, dim=1), F.normalize(out1, dim=1), scale)

    return loss


def _chunks(batch, count: int):
    return list(zip(*(part.tensor_split(count) for part in batch), strict=True))


def _gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _max_abs(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[name] - b[name]).abs().max().item() for name in a)


def _one_pass(model, batch, loss_name):
    model.zero_grad()
    loss = _loss_fn(loss_name, model)([_embed(model, batch)])
    loss.backward()
    return loss.detach(), _gradients(model)


def _cached(model, batch, loss_name, chunks=CHUNKS):
    model.zero_grad()
    loss = cached_backward(
        model,
        _chunks(batch, chunks),
        _loss_fn(loss_name, model),
        forward=lambda chunk: _embed(model, chunk),
    )
    return loss, _gradients(model)


@pytest.mark.parametrize("loss_name", ["ntxent", "infonce"])
@pytest.mark.parametrize("backbone", ["mlp", "vit_tiny"])
def test_cached_gradient_equals_one_pass_over_the_whole_batch(backbone, loss_name):
    model = _model(backbone)
    batch = _batch()
    loss, reference = _one_pass(model, batch, loss_name)
    cached_loss, cached = _cached(model, batch, loss_name)
    error = _max_abs(cached, reference)
    print(f"{backbone} {loss_name} K={CHUNKS}: gradient {error:.1e}, loss {loss - cached_loss:.1e}")
    assert abs(loss - cached_loss).item() <= EXACT
    assert error <= EXACT
    if loss_name == "infonce":
        assert "log_logit_scale" in cached  # the loss's own parameter got its gradient


def test_uneven_and_empty_chunks():
    """5 pairs in 4 chunks (2, 1, 1, 1), and 3 pairs in 4 chunks (one empty)."""
    model = _model("mlp")
    for pairs in (5, 3):
        batch = _batch(pairs)
        _, reference = _one_pass(model, batch, "ntxent")
        _, cached = _cached(model, batch, "ntxent")
        assert _max_abs(cached, reference) <= EXACT


def test_negative_control_plain_accumulation_sees_only_each_chunks_negatives():
    model = _model("mlp")
    batch = _batch()
    _, reference = _one_pass(model, batch, "ntxent")
    model.zero_grad()
    loss_fn = _loss_fn("ntxent", model)
    for chunk in _chunks(batch, CHUNKS):
        (loss_fn([_embed(model, chunk)]) / CHUNKS).backward()
    error = _max_abs(_gradients(model), reference)
    print(f"plain accumulation, K={CHUNKS}: {error:.2e}")
    assert error > MISSES


def test_negative_control_torch_dropout_draws_new_masks_in_the_recompute():
    model = _model("mlp", per_sample=False)
    batch = _batch()
    torch.manual_seed(5)
    _, reference = _one_pass(model, batch, "ntxent")
    torch.manual_seed(5)  # the first pass replays the reference's masks; the recompute cannot
    _, cached = _cached(model, batch, "ntxent")
    error = _max_abs(cached, reference)
    print(f"nn.Dropout in the recompute: {error:.2e}")
    assert error > MISSES


def test_batchnorm_running_statistics_count_each_chunk_once():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 6), nn.BatchNorm1d(6), nn.ReLU()).double()
    expected = copy.deepcopy(model)
    images = torch.randn(2, 8, 3, 2, 2, dtype=torch.float64)
    chunks = list(zip(images[0].tensor_split(CHUNKS), images[1].tensor_split(CHUNKS), strict=True))
    cached_backward(
        model,
        chunks,
        lambda outputs: torch.cat(outputs).pow(2).sum(),
        forward=lambda chunk: model(torch.cat(chunk)),
    )
    with torch.no_grad():
        for chunk in chunks:
            expected(torch.cat(chunk))
    batchnorm, reference = model[2], expected[2]
    assert batchnorm.num_batches_tracked.item() == CHUNKS
    assert torch.equal(batchnorm.running_mean, reference.running_mean)
    assert torch.equal(batchnorm.running_var, reference.running_var)
    assert batchnorm.track_running_stats


# On 2 gloo processes with DDP: the gradient is still the single-process one, and the
# gradients are all-reduced once per optimizer step.


def _count_synchronisations(synchronised_backwards: list, bucket):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    if bucket.index() == 0:  # one call per bucket; bucket 0 is in every synchronised pass
        synchronised_backwards.append(1)
    return allreduce_hook(None, bucket)


def ddp_worker(rank: int, world_size: int, use_no_sync: bool) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    # InfoNCE: its learnable scale's gradient must ride with the synchronised pass too.
    # The control uses NT-Xent: DDP would refuse a synchronised pass without the scale.
    loss_name = "infonce" if use_no_sync else "ntxent"
    model = _model("mlp", logit_scale=use_no_sync)
    single = copy.deepcopy(model)
    ddp = DistributedDataParallel(model)
    if not use_no_sync:
        ddp.no_sync = contextlib.nullcontext  # the control: what sentence-transformers does
    synchronised_backwards: list[int] = []
    ddp.register_comm_hook(synchronised_backwards, _count_synchronisations)
    counts, errors = [], []
    for step in range(2):
        view0, view1, indices = _batch(PAIRS, seed=step)
        share = torch.arange(PAIRS).tensor_split(world_size)[rank]
        local = view0[share], view1[share], indices[share]
        ddp.zero_grad()
        before = len(synchronised_backwards)
        cached_backward(
            ddp,
            _chunks(local, CHUNKS),
            _loss_fn(loss_name, model),
            forward=lambda chunk: _embed(ddp, chunk),
        )
        counts.append(len(synchronised_backwards) - before)
        _, reference = _one_pass(single, (view0, view1, indices), loss_name)
        errors.append(_max_abs(_gradients(model), reference))
    return {"synchronised_backwards_per_step": counts, "error": max(errors)}


@pytest.fixture(scope="module")
def ddp_results():
    return {use_no_sync: run_on_ranks(ddp_worker, 2, use_no_sync) for use_no_sync in (True, False)}


def test_one_gradient_all_reduce_per_optimizer_step(ddp_results):
    for result in ddp_results[True]:
        print(f"synchronised backward passes per step, K={CHUNKS}, 2 processes: {result}")
        assert result["synchronised_backwards_per_step"] == [1, 1]
        assert result["error"] <= EXACT  # DDP's average is the whole global batch's gradient


def test_negative_control_without_no_sync_every_chunk_all_reduces(ddp_results):
    for result in ddp_results[False]:
        assert result["synchronised_backwards_per_step"] == [CHUNKS, CHUNKS]


@pytest.fixture(scope="module")
def digits():
    return load_image_dataset(None)


@pytest.mark.parametrize("loss", list(SIMCLR_LOSSES))
def test_every_loss_through_the_methods_chunks(loss, digits):
    """The SimCLR method's own chunk embedding and loss assembly, K = 4 against K = 1."""
    temperature = {"temperature": 0.3} if "temperature" in SIMCLR_LOSSES[loss].options else {}
    config = TrainConfig(loss=loss, model="mlp", dtype="float64", dropout=0.1, **temperature)
    torch.manual_seed(0)
    method = SimCLRMethod(config.resolved(), digits, world_size=1, say=print)
    batch = TwoViewBatch(*_batch(), [])
    gradients = {}
    for chunks in (1, CHUNKS):
        method.model.zero_grad()
        cached_backward(
            method.model,
            batch.split(chunks),
            partial(method.loss, batch=batch, sizes=None, step=3),
            forward=partial(method.embed, method.model, step=3),
        )
        gradients[chunks] = _gradients(method.model)
    error = _max_abs(gradients[CHUNKS], gradients[1])
    print(f"--loss {loss}: K={CHUNKS} vs one pass {error:.1e}")
    assert error <= EXACT


def test_under_no_grad_it_says_so_in_one_line():
    model = nn.Linear(4, 2)
    with torch.no_grad(), pytest.raises(RuntimeError, match="called under torch.no_grad"):
        cached_backward(model, [torch.randn(3, 4)], lambda z: z[0].sum())
