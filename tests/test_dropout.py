"""SampleDropout: each row's mask is a function of its key, the layer and the position only."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torchvision.ops import StochasticDepth

import models.dropout as dropout_module
from models import (
    SampleDropout,
    SampleDropPath,
    SimCLR,
    convert_sample_dropout,
    sample_keys,
    sample_randomness,
)


def _dropout(layer: nn.Module, x: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    with sample_randomness(keys):
        return layer(x)


def test_a_rows_mask_does_not_depend_on_the_batch_around_it():
    """What world-size invariance and the gradient-caching recompute rely on: a sample's
    mask is the same whatever batch, position or chunk it arrives in."""
    layer = SampleDropout(0.3, salt=1)
    keys = sample_keys(seed=0, step=7, indices=torch.arange(100, 164))
    x = torch.ones(64, 5, 6)
    whole = _dropout(layer, x, keys)
    permutation = torch.randperm(64)
    shuffled = _dropout(layer, x[permutation], keys[permutation])
    chunks = torch.cat(
        [_dropout(layer, c, k) for c, k in zip(x.split(5), keys.split(5), strict=True)]
    )
    assert torch.equal(shuffled, whole[permutation])
    assert torch.equal(chunks, whole)


def test_masks_differ_by_sample_step_view_seed_and_layer():
    x = torch.ones(256, 40)
    indices = torch.arange(256)
    base = _dropout(SampleDropout(0.5, salt=1), x, sample_keys(0, 0, indices)) != 0
    variants = {
        "step": _dropout(SampleDropout(0.5, salt=1), x, sample_keys(0, 1, indices)),
        "view": _dropout(SampleDropout(0.5, salt=1), x, sample_keys(0, 0, indices, view=1)),
        "seed": _dropout(SampleDropout(0.5, salt=1), x, sample_keys(1, 0, indices)),
        "layer": _dropout(SampleDropout(0.5, salt=2), x, sample_keys(0, 0, indices)),
    }
    for name, output in variants.items():
        agreement = ((output != 0) == base).double().mean().item()
        # Independent masks at p = 0.5 agree on half the elements (sd 0.5/sqrt(10240) = 0.005).
        assert abs(agreement - 0.5) < 0.03, (name, agreement)
    rows_agree = ((base[1:] == base[:-1]).double().mean()).item()
    assert abs(rows_agree - 0.5) < 0.03  # neighbouring samples are independent too


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_drop_rate_and_scaling_match_nn_dropout(p):
    layer = SampleDropout(p, salt=3)
    x = torch.full((1000, 100), 2.0, dtype=torch.float64)
    out = _dropout(layer, x, sample_keys(0, 0, torch.arange(1000)))
    kept = (out != 0).double().mean().item()
    # Binomial(1e5, 1-p): 5 standard deviations.
    assert abs(kept - (1 - p)) < 5 * math.sqrt(p * (1 - p) / 1e5)
    assert torch.allclose(out[out != 0], torch.tensor(2.0 / (1 - p), dtype=torch.float64))


def test_gradient_is_the_mask_times_the_scale():
    layer = SampleDropout(0.25, salt=1)
    x = torch.randn(32, 8, dtype=torch.float64, requires_grad=True)
    keys = sample_keys(0, 0, torch.arange(32))
    out = _dropout(layer, x, keys)
    out.backward(torch.ones_like(out))
    expected = layer.mask(keys, x.shape).double() / 0.75
    assert torch.equal(x.grad, expected)


def test_under_bf16_autocast_the_mask_is_the_same():
    layer = SampleDropout(0.2, salt=1)
    keys = sample_keys(0, 0, torch.arange(16))
    x = torch.randn(16, 24)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = _dropout(layer, x.bfloat16(), keys)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out != 0, _dropout(layer, x, keys) != 0)


def test_eval_mode_is_the_identity_and_needs_no_keys():
    layer = SampleDropout(0.5).eval()
    x = torch.randn(4, 3)
    assert layer(x) is x


def test_training_forward_without_keys_or_with_the_wrong_number_fails_clearly():
    layer = SampleDropout(0.5)
    with pytest.raises(RuntimeError, match="sample_randomness"):
        layer(torch.randn(4, 3))
    with pytest.raises(RuntimeError, match="4 rows and 3 keys"):
        _dropout(layer, torch.randn(4, 3), sample_keys(0, 0, torch.arange(3)))


def test_converter_swaps_every_dropout_of_the_vit_with_distinct_salts():
    model = convert_sample_dropout(SimCLR("vit_tiny", image_size=8, dropout=0.1))
    layers = [m for m in model.modules() if isinstance(m, SampleDropout)]
    assert not any(type(m) is nn.Dropout for m in model.modules())
    assert len(layers) == 1 + 12 * 3  # after the embedding; per block: attention out, 2 in MLP
    assert len({layer.salt for layer in layers}) == len(layers)
    assert all(layer.p == 0.1 for layer in layers)


@pytest.mark.parametrize(
    "module, message",
    [
        (nn.MultiheadAttention(8, 2, dropout=0.1), "attention dropout"),
        (nn.Sequential(nn.Dropout2d(0.1)), "Dropout2d cannot be made per-sample"),
        (nn.Sequential(StochasticDepth(0.1, "batch")), "'batch' mode is not per-sample"),
    ],
)
def test_converter_refuses_randomness_it_cannot_key_by_sample(module, message):
    with pytest.raises(ValueError, match=message):
        convert_sample_dropout(module)


def test_in_place_int32_hash_equals_the_int64_reference():
    """int32 multiplication must wrap modulo 2**32 on this platform for the masks to be the
    hash of the docstring; the int64 version computes the same hash without wrapping."""
    values = torch.randint(0, 2**32, (100_000,), dtype=torch.int64)
    bits = dropout_module.as_int32(values)
    dropout_module.lowbias32_int32_(bits, torch.empty_like(bits))
    assert torch.equal(bits, dropout_module.as_int32(dropout_module.lowbias32(values)))


def test_the_cpu_blocks_do_not_change_the_mask(monkeypatch):
    layer = SampleDropout(0.3, salt=2)
    keys = sample_keys(0, 0, torch.arange(37))
    whole = layer.mask(keys, torch.Size((37, 5, 7)))
    monkeypatch.setattr(dropout_module, "CPU_BLOCK_ELEMENTS", 3 * 35)  # 3 rows per block
    assert torch.equal(layer.mask(keys, torch.Size((37, 5, 7))), whole)


def test_drop_path_keeps_or_drops_each_rows_whole_branch_by_its_key():
    layer = SampleDropPath(0.25, salt=3)
    keys = sample_keys(seed=0, step=2, indices=torch.arange(4000))
    x = torch.ones(4000, 5, 6)
    out = _dropout(layer, x, keys)
    kept = out[:, 0, 0] != 0
    assert torch.equal(out, kept[:, None, None] * x / 0.75)  # whole rows, scaled
    rate = 1 - kept.double().mean().item()
    assert abs(rate - 0.25) < 4 * math.sqrt(0.25 * 0.75 / 4000)  # 4 sigma
    half = _dropout(layer, x[2000:], keys[2000:])  # a row's decision is its own
    assert torch.equal(half, out[2000:])


def test_converter_keys_the_vits_stochastic_depth_by_sample():
    model = convert_sample_dropout(SimCLR("vit_tiny", image_size=8, drop_path=0.2))
    paths = [m for m in model.modules() if isinstance(m, SampleDropPath)]
    assert not any(isinstance(m, StochasticDepth) for m in model.modules())
    assert len(paths) == 2 * 12  # both residual branches of every block
    assert paths[0].p == 0.0 and paths[-1].p == pytest.approx(0.2)  # DINO's linear rates
    assert len({m.salt for m in model.modules() if isinstance(m, SampleDropout)}) == 1 + 12 * 5
