"""Each row of the image towers table (``models.towers.IMAGE_TOWERS``) is what it says:
built at the sizes the methods use, its width, its BatchNorm, the options it reads
(dropout layers, stochastic depth, checkpointable blocks) and the input sizes it takes.
Each kind of tower (``TOWER_KINDS``) names options that exist and a loader that does,
and its refusals are its row's. A new row is tested here by being in the table."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch
from torch import nn
from torchvision.ops import StochasticDepth

from contrastive_accelerate.compat import BatchNormBase
from contrastive_accelerate.config import ConfigError, parse_args
from contrastive_accelerate.methods import composition
from contrastive_accelerate.options import TrainConfig
from models.checkpointing import checkpoint_image_encoder
from models.towers import IMAGE_TOWER_KINDS, IMAGE_TOWERS, TOWER_KINDS, TOWER_OPTIONS

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


@pytest.mark.parametrize("kind", list(TOWER_KINDS))
def test_a_kind_of_tower_names_options_that_exist_and_a_loader_that_does(kind):
    row = TOWER_KINDS[kind]
    fields = {field.name for field in dataclasses.fields(TrainConfig)}
    assert {row.option, *row.reads, *row.replaces} - {None} <= fields
    if row.loader is not None:
        module, name = row.loader.split(":")
        assert callable(getattr(importlib.import_module(module), name))
    assert (kind in composition.TOWERS) == ("images" in row.embeds)
    assert (kind in IMAGE_TOWER_KINDS) == (kind in composition.TOWERS)


def test_what_a_checkpoint_holds_is_refused_by_its_row_and_the_control(monkeypatch):
    """``--text-model`` beside ``--clip-model`` is refused because the clip row says its
    checkpoint holds its text tower; a row that does not say so lets it through."""
    flags = ["--columns", "image,caption", "--clip-model", "clip", "--text-model", "bert"]
    with pytest.raises(ConfigError, match="--text-model does not apply with --clip-model"):
        parse_args(TrainConfig, flags)
    row = TOWER_KINDS["clip"]
    kept = tuple(name for name in row.replaces if name != "text_model")
    monkeypatch.setitem(TOWER_KINDS, "clip", dataclasses.replace(row, replaces=kept))
    assert parse_args(TrainConfig, flags).text_model == "bert"


def test_a_timm_tower_reads_safetensors_only_and_says_what_does_not_fit(tmp_path):
    """A folder with only a pickle, a weights file that is not safetensors and weights of
    another shape are each one line; nothing is unpickled."""
    pytest.importorskip("timm")
    from models.timm_tower import TimmError, load_timm_tower

    from launch import make_timm_model

    folder = make_timm_model(tmp_path / "vit")
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    with pytest.raises(TimmError, match="no model.safetensors .only pytorch_model.bin, which"):
        load_timm_tower(str(folder), None, torch.float32)
    with pytest.raises(TimmError, match="only safetensors files are read"):
        load_timm_tower("test_vit", str(folder / "pytorch_model.bin"), torch.float32)
    other = make_timm_model(tmp_path / "resnet", "test_resnet", dropout=0.0)
    with pytest.raises(TimmError, match="does not fit the timm model: missing"):
        load_timm_tower("test_vit", str(other / "model.safetensors"), torch.float32)
    for flags, message in (
        (["--timm-weights", "w.safetensors"], "--timm-weights applies to --timm-model"),
        (["--timm-model", "t", "--model", "mlp"], "--model does not apply with --timm-model"),
    ):
        with pytest.raises(ConfigError, match=message):
            parse_args(TrainConfig, flags)
