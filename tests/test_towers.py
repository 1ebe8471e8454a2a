"""Each row of the image towers table (``models.towers.IMAGE_TOWERS``) is what it says:
built at the sizes the methods use, its width, its BatchNorm, the options it reads
(dropout layers, stochastic depth, checkpointable blocks) and the input sizes it takes.
A new row is tested here by being in the table."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torchvision.ops import StochasticDepth

from contrastive_accelerate.compat import BatchNormBase
from models.checkpointing import checkpoint_image_encoder
from models.towers import IMAGE_TOWERS, TOWER_OPTIONS

ROWS = list(IMAGE_TOWERS)


def layers(module: nn.Module, kind: type) -> list[nn.Module]:
    return [layer for layer in module.modules() if isinstance(layer, kind)]


@pytest.mark.parametrize("name", ROWS)
@pytest.mark.parametrize("size", [8, 32])
def test_a_tower_gives_its_width_and_holds_what_its_row_says(name, size):
    row = IMAGE_TOWERS[name]
    torch.manual_seed(0)
    encoder, width = row.build(size, 3, 0.1, 0.1 if "drop_path" in row.options else 0.0)
    assert encoder(torch.randn(2, 3, size, size)).shape == (2, width)
    assert bool(layers(encoder, BatchNormBase)) == row.batch_norm
    assert bool(layers(encoder, nn.Dropout)) == ("dropout" in row.options)
    assert bool(layers(encoder, StochasticDepth)) == ("drop_path" in row.options)
    assert set(row.options) <= set(TOWER_OPTIONS)
    assert (row.patch_size is not None) == ("drop_path" in row.options)


@pytest.mark.parametrize("name", ROWS)
def test_gradient_checkpointing_applies_where_the_row_reads_it(name):
    encoder, _ = IMAGE_TOWERS[name].build(8, 3, 0.0, 0.0)
    if "gradient_checkpointing" in IMAGE_TOWERS[name].options:
        checkpoint_image_encoder(encoder)
    else:
        with pytest.raises(ValueError):
            checkpoint_image_encoder(encoder)


@pytest.mark.parametrize("name", ROWS)
def test_a_tower_takes_other_input_sizes_where_its_row_says(name):
    row = IMAGE_TOWERS[name]
    encoder, width = row.build(16, 3, 0.0, 0.0)
    other = 16 // 2  # a local crop: half the size, which the ViTs' 2-px patches divide
    if row.any_input_size:
        assert encoder(torch.randn(2, 3, other, other)).shape == (2, width)
    else:
        with pytest.raises(RuntimeError):
            encoder(torch.randn(2, 3, other, other))
