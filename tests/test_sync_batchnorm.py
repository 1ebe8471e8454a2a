"""SyncBatchNorm on W gloo processes against nn.BatchNorm on the concatenated batch."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from contrastive_accelerate.testing import HostSyncs, run_on_ranks
from models import SyncBatchNorm, convert_sync_batchnorm

EXACT = 1e-10  # float64; only summation order differs from nn.BatchNorm
CHANNELS = 3
SHAPES = {1: (CHANNELS,), 2: (CHANNELS, 4, 3)}  # per-sample shape for BatchNorm1d / 2d
LAYERS = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d}


def _batch(sizes, dims, offset=0.0, dtype=torch.float64):
    generator = torch.Generator().manual_seed(dims)
    x = torch.randn(sum(sizes), *SHAPES[dims], generator=generator, dtype=torch.float64)
    return (x * 2 + offset).to(dtype)


def _reference_layer(dims: int, momentum) -> nn.Module:
    layer = LAYERS[dims](CHANNELS, momentum=momentum).double()
    with torch.no_grad():
        layer.weight.copy_(torch.linspace(0.5, 1.5, CHANNELS))
        layer.bias.copy_(torch.linspace(-1, 1, CHANNELS))
    return layer


def _row_weights(rank: int, rows: int, dims: int) -> torch.Tensor:
    """A different downstream function on every rank."""
    generator = torch.Generator().manual_seed(10 + rank)
    return torch.randn(rows, *SHAPES[dims], generator=generator, dtype=torch.float64)


def _max_abs(a, b) -> float:
    return (a - b).abs().max().item() if a.numel() else 0.0


def sync_bn_worker(
    rank: int, world_size: int, sizes: list[int], dims: int, momentum, synced: bool = True
) -> dict:
    x = _batch(sizes, dims)
    rows = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
    reference = _reference_layer(dims, momentum)
    layer = (
        convert_sync_batchnorm(_reference_layer(dims, momentum))
        if synced
        else (_reference_layer(dims, momentum))
    )

    errors = {"output": 0.0, "input_grad": 0.0, "weight_grad": 0.0, "bias_grad": 0.0}
    for _ in range(3):  # several steps: running statistics accumulate
        x_all = x.clone().requires_grad_()
        y_all = reference(x_all)
        target = sum(
            (y_all[sum(sizes[:r]) : sum(sizes[: r + 1])] * _row_weights(r, sizes[r], dims)).sum()
            for r in range(world_size)
        )
        target.backward()

        x_local = x[rows].clone().requires_grad_()
        y_local = layer(x_local)
        (y_local * _row_weights(rank, sizes[rank], dims)).sum().backward()
        # Parameter gradients are local sums; DDP would combine them across ranks.
        grads = torch.cat([layer.weight.grad, layer.bias.grad])
        dist.all_reduce(grads)
        weight_grad, bias_grad = grads.chunk(2)

        errors["output"] = max(errors["output"], _max_abs(y_local.detach(), y_all[rows].detach()))
        errors["input_grad"] = max(errors["input_grad"], _max_abs(x_local.grad, x_all.grad[rows]))
        errors["weight_grad"] = max(
            errors["weight_grad"], _max_abs(weight_grad, reference.weight.grad)
        )
        errors["bias_grad"] = max(errors["bias_grad"], _max_abs(bias_grad, reference.bias.grad))
        for module in (reference, layer):
            module.zero_grad()
        x = x * 1.1 + 0.3  # the next "step" sees a different batch

    errors["running_mean"] = _max_abs(layer.running_mean, reference.running_mean)
    errors["running_var"] = _max_abs(layer.running_var, reference.running_var)
    layer.eval()
    reference.eval()
    errors["eval_output"] = _max_abs(layer(x[rows]), reference(x)[rows])
    return errors


def stability_worker(rank: int, world_size: int) -> float:
    """float32 input with mean 1e4 and unit spread: E[x^2] - E[x]^2 would lose it all."""
    sizes = [5] * world_size
    x = _batch(sizes, 1, offset=1e4, dtype=torch.float32)
    rows = slice(5 * rank, 5 * (rank + 1))
    layer = SyncBatchNorm(CHANNELS, momentum=1.0)
    layer(x[rows])
    return _max_abs(layer.running_var.double(), x.double().var(0))


CASES = [
    pytest.param((2, [4, 3], 1, 0.1), id="W2-1d-uneven"),
    pytest.param((2, [3, 3], 2, 0.1), id="W2-2d-even"),
    pytest.param((3, [2, 0, 3], 2, 0.1), id="W3-2d-empty-rank"),
    pytest.param((3, [1, 2, 2], 1, None), id="W3-1d-cumulative-momentum"),
]
QUANTITIES = [
    "output",
    "input_grad",
    "weight_grad",
    "bias_grad",
    "running_mean",
    "running_var",
    "eval_output",
]


@pytest.fixture(scope="module", params=CASES)
def case(request):
    return request.param


@pytest.fixture(scope="module")
def synced_errors(case):
    world_size, *args = case
    return run_on_ranks(sync_bn_worker, world_size, *args)


@pytest.mark.parametrize("quantity", QUANTITIES)
def test_matches_batchnorm_on_concatenated_batch(synced_errors, quantity):
    worst = max(errors[quantity] for errors in synced_errors)
    print(f"{quantity}: {worst:.3e}")
    assert worst <= EXACT


@pytest.mark.parametrize("case", CASES[:2])  # plain BatchNorm cannot take an empty batch
def test_negative_control_per_process_batchnorm(case):
    """Plain per-process BatchNorm: statistics of the local batch only."""
    world_size, *args = case
    errors = run_on_ranks(sync_bn_worker, world_size, *args, False)
    worst = max(max(e["output"], e["input_grad"], e["running_mean"]) for e in errors)
    print(f"per-process BatchNorm: {worst:.3e}")
    assert worst > 1e3 * EXACT


def test_numerically_stable_with_large_mean():
    worst = max(run_on_ranks(stability_worker, 2))
    print(f"running_var error at mean 1e4 in float32: {worst:.3e}")
    assert worst <= 1e-3  # the true variance is ~4; cancellation would give O(1) or worse


def host_reads_worker(rank: int, world_size: int, sizes: list[int]) -> dict:
    layer = SyncBatchNorm(CHANNELS)
    x = torch.randn(sizes[rank], *SHAPES[2], requires_grad=True)
    with HostSyncs() as step:
        layer(x).square().sum().backward()
    with HostSyncs() as control:  # the detector sees a read when there is one
        bool(x.sum() > 0)
    return {"step": step.seen, "control": control.seen}


def test_no_host_device_synchronisation():
    """On a GPU each host read would stall the host until the device catches up, once per
    layer and step; on CPU the same operators are visible to a dispatch mode."""
    for record in run_on_ranks(host_reads_worker, 2, [3, 2]):
        print(f"host reads in a SyncBatchNorm step: {record['step']}")
        assert record["step"] == []
        assert record["control"] == ["aten._local_scalar_dense.default"]


def small_batch_worker(rank: int, world_size: int) -> str:
    layer = SyncBatchNorm(CHANNELS)
    try:
        layer(torch.randn(1 - rank, CHANNELS))  # one value per channel in the global batch
    except ValueError as error:
        return str(error)
    return "no error"


def test_global_batch_of_one_is_refused_on_every_rank():
    messages = run_on_ranks(small_batch_worker, 2)
    assert all("expected more than 1 value per channel" in m for m in messages), messages


def test_plain_batchnorm_without_process_group():
    x = _batch([6], 2)
    reference = _reference_layer(2, 0.1)
    layer = convert_sync_batchnorm(_reference_layer(2, 0.1))
    assert isinstance(layer, SyncBatchNorm)
    assert torch.equal(layer(x), reference(x))
    assert torch.equal(layer.running_var, reference.running_var)


def test_converter_replaces_nested_layers_and_keeps_state():
    model = nn.Sequential(
        nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.Sequential(nn.Flatten(), nn.BatchNorm1d(4 * 9))
    ).double()
    model[1].running_mean.fill_(0.25)
    converted = convert_sync_batchnorm(model)
    assert isinstance(converted[1], SyncBatchNorm) and isinstance(converted[2][1], SyncBatchNorm)
    assert converted[1].running_mean.dtype == torch.float64
    assert torch.all(converted[1].running_mean == 0.25)
