"""NTXentLoss on one process: the brute-force reference, tiling, bad input.

On W processes it is checked with every other loss by the shared harness (test_losses).
"""

from __future__ import annotations

import math

import pytest
import torch

from losses import NTXentLoss

import references

FEATURES = 5
TEMPERATURE = 0.3
EXACT = 1e-10  # float64; only the summation order differs from the reference


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
    reference = _value_and_grads(lambda a, b: references.ntxent(a, b, TEMPERATURE), out0, out1)
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
