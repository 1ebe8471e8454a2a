"""NTXentLoss against a brute-force reference, on 1 process and on W gloo processes."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import losses.ntxent
from contrastive_accelerate.testing import run_on_ranks
from losses import NTXentLoss

from test_gather import GATHERS

FEATURES = 5
TEMPERATURE = 0.3
EXACT = 1e-10  # float64; only the summation order differs from the reference


def brute_force_ntxent(out0: torch.Tensor, out1: torch.Tensor, temperature: float) -> torch.Tensor:
    """SimCLR's NT-Xent written as plainly as possible: a loop over the 2N anchors."""
    z = torch.cat([out0, out1])
    z = z / z.norm(dim=1, keepdim=True)
    pairs = out0.shape[0]
    terms = []
    for i in range(2 * pairs):
        positive = (i + pairs) % (2 * pairs)
        similarities = [z[i] @ z[j] / temperature for j in range(2 * pairs)]
        denominator = sum(torch.exp(s) for j, s in enumerate(similarities) if j != i)
        terms.append(-similarities[positive] + torch.log(denominator))
    return torch.stack(terms).mean()


def _pairs(total: int, dtype=torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    out0 = torch.randn(total, FEATURES, generator=generator, dtype=torch.float64)
    out1 = out0 + 0.5 * torch.randn(total, FEATURES, generator=generator, dtype=torch.float64)
    return out0.to(dtype), out1.to(dtype)


def _value_and_grads(criterion, out0, out1):
    out0, out1 = out0.clone().requires_grad_(), out1.clone().requires_grad_()
    loss = criterion(out0, out1)
    loss.backward()
    return loss.detach(), out0.grad, out1.grad


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item() if a.numel() else 0.0


@pytest.mark.parametrize("tile_rows", [None, 1, 3, 7])
def test_single_process_matches_brute_force(tile_rows):
    out0, out1 = _pairs(6)
    reference = _value_and_grads(lambda a, b: brute_force_ntxent(a, b, TEMPERATURE), out0, out1)
    ours = _value_and_grads(NTXentLoss(TEMPERATURE, tile_rows=tile_rows), out0, out1)
    for got, expected in zip(ours, reference, strict=True):
        assert _max_abs(got, expected) <= EXACT


def test_tiled_equals_dense_in_float32():
    out0, out1 = _pairs(64, torch.float32)
    dense = _value_and_grads(NTXentLoss(0.1), out0, out1)
    tiled = _value_and_grads(NTXentLoss(0.1, tile_rows=16), out0, out1)
    for got, expected in zip(tiled, dense, strict=True):
        assert _max_abs(got, expected) <= 1e-5


def test_automatic_tiling_above_the_dense_budget():
    out0, out1 = _pairs(32)
    dense = _value_and_grads(NTXentLoss(TEMPERATURE), out0, out1)
    # 64 x 64 float64 logits are 32 KiB: a 4 KiB budget forces tiles.
    tiny_budget = _value_and_grads(NTXentLoss(TEMPERATURE, dense_max_bytes=4096), out0, out1)
    for got, expected in zip(tiny_budget, dense, strict=True):
        assert _max_abs(got, expected) <= EXACT


def test_backward_twice_with_retained_graph():
    out0, out1 = _pairs(4)
    out0.requires_grad_()
    loss = NTXentLoss(TEMPERATURE)(out0, out1)
    (first,) = torch.autograd.grad(loss, out0, retain_graph=True)
    (second,) = torch.autograd.grad(loss, out0)
    assert _max_abs(first, second) <= EXACT


@pytest.mark.parametrize(
    ("out0", "out1", "message"),
    [
        (torch.randn(4, 3), torch.randn(4, 2), "different shapes"),
        (torch.randn(4, 3, 1), torch.randn(4, 3, 1), "must be 2-D"),
        (torch.randn(1, 3), torch.randn(1, 3), "at least 2 are needed"),
        (torch.tensor([[1.0, math.nan], [0.0, 1.0]]), torch.randn(2, 2), "NaN or Inf"),
    ],
)
def test_bad_input_raises_value_error(out0, out1, message):
    with pytest.raises(ValueError, match=message):
        NTXentLoss()(out0, out1)


@pytest.mark.parametrize("temperature", [0.0, -1.0, math.nan])
def test_bad_temperature_raises(temperature):
    with pytest.raises(ValueError, match="temperature"):
        NTXentLoss(temperature)


def _distributed_gradient_errors(rank, world_size, sizes, **loss_kwargs) -> dict:
    """Max differences between this rank's W-process results and brute force on the whole batch."""
    out0, out1 = _pairs(sum(sizes))
    rows = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
    ref_loss, ref_grad0, ref_grad1 = _value_and_grads(
        lambda a, b: brute_force_ntxent(a, b, TEMPERATURE), out0, out1
    )
    loss, grad0, grad1 = _value_and_grads(
        NTXentLoss(TEMPERATURE, **loss_kwargs), out0[rows], out1[rows]
    )
    # The mean of the per-rank losses is the global loss; gradients arrive summed
    # over ranks and DDP divides them by W, hence the 1/W.
    mean_loss = loss.clone()
    dist.all_reduce(mean_loss)
    return {
        "loss": abs(mean_loss.item() / world_size - ref_loss.item()),
        "grad": max(
            _max_abs(grad0 / world_size, ref_grad0[rows]),
            _max_abs(grad1 / world_size, ref_grad1[rows]),
        ),
    }


def _raised(fn) -> str | None:
    try:
        fn()
    except ValueError as error:
        return str(error)
    return None


def ntxent_worker(rank: int, world_size: int, sizes: list[int]) -> dict:
    result = {
        "dense": _distributed_gradient_errors(rank, world_size, sizes),
        "tiled": _distributed_gradient_errors(rank, world_size, sizes, tile_rows=2),
    }
    for name in ("local_slice", "slice_all_reduce", "no_grad"):
        original = losses.ntxent.gather
        bad_layer = GATHERS[name]
        losses.ntxent.gather = lambda x, sizes, layer=bad_layer: layer.apply(x, sizes, None)
        try:
            result[name] = _distributed_gradient_errors(rank, world_size, sizes)
        finally:
            losses.ntxent.gather = original

    n = sizes[rank]
    last = world_size - 1
    criterion = NTXentLoss()
    good = torch.randn(n, 4)
    cases = {
        "shape_mismatch_on_last_rank": (good, torch.randn(n, 3) if rank == last else good),
        "feature_dims_differ": (torch.randn(n, 4 + rank), torch.randn(n, 4 + rank)),
        "nan_on_last_rank": (good, good.clone().fill_(math.nan) if rank == last else good),
        "not_2d_on_rank_0": (good[:, :, None] if rank == 0 else good,) * 2,
        "one_global_pair": (torch.randn(int(rank == 0), 4),) * 2,
    }
    for name, (out0, out1) in cases.items():
        result[name] = _raised(lambda out0=out0, out1=out1: criterion(out0, out1))
        dist.barrier()  # the group is still usable: nobody is stuck in a collective
    return result


CASES = [
    pytest.param((2, [3, 2]), id="W2-uneven"),
    pytest.param((3, [2, 0, 3]), id="W3-uneven-empty-rank"),
    pytest.param((3, [2, 2, 2]), id="W3-even"),
]


@pytest.fixture(scope="module", params=CASES)
def ntxent_results(request):
    world_size, sizes = request.param
    return run_on_ranks(ntxent_worker, world_size, sizes)


@pytest.mark.parametrize("path", ["dense", "tiled"])
def test_distributed_equals_brute_force_on_concatenated_batch(ntxent_results, path):
    loss_error = max(result[path]["loss"] for result in ntxent_results)
    grad_error = max(result[path]["grad"] for result in ntxent_results)
    print(f"{path}: loss error {loss_error:.3e}, grad error {grad_error:.3e}")
    assert loss_error <= EXACT
    assert grad_error <= EXACT


@pytest.mark.parametrize("bad_gather", ["local_slice", "slice_all_reduce", "no_grad"])
def test_known_bad_gather_breaks_the_loss_gradient(ntxent_results, bad_gather):
    grad_error = max(result[bad_gather]["grad"] for result in ntxent_results)
    print(f"{bad_gather}: grad error {grad_error:.3e}")
    assert grad_error > 1e3 * EXACT


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("shape_mismatch_on_last_rank", "different shapes"),
        ("feature_dims_differ", "disagree on trailing shape"),
        ("nan_on_last_rank", "NaN or Inf"),
        ("not_2d_on_rank_0", "2-D"),
        ("one_global_pair", "at least 2 are needed"),
    ],
)
def test_bad_input_raises_on_every_rank(ntxent_results, case, message):
    for rank, result in enumerate(ntxent_results):
        assert result[case] is not None, f"rank {rank} did not raise for {case}"
        assert message in result[case]
