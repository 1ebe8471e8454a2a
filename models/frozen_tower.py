"""A frozen pretrained image tower, a distillation teacher: one of our image methods'
``final/`` folders, a timm folder or a ``transformers`` vision folder, told apart by
their ``config.json``; from safetensors and JSON only, in eval mode, without gradient."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from contrastive_accelerate.untrusted import read_json
from models.towers import IMAGE_TOWERS

#: The largest ``image_size`` a teacher's ``config.json`` may ask a tower to be built at.
MAX_IMAGE_SIZE = 1024


class FrozenTowerError(ValueError):
    """A teacher that cannot be loaded, in one line."""


@dataclass
class FrozenTower:
    """A loaded teacher: the tower (eval mode, no gradient), its feature width and its
    ``config.json`` (with its weights, what a resume digests and compares)."""

    tower: nn.Module
    width: int
    config: dict


def load_frozen_tower(path: str, dtype: torch.dtype, named: str) -> FrozenTower:
    """The teacher in the folder ``path`` (the option ``named`` gave it), by its
    ``config.json``: ``backbone`` (our image methods' ``final/``: the tower from scratch,
    its ``encoder.`` weights), ``architecture`` (timm's) or ``model_type``
    (``transformers``', pooled as ``--image-pooling``'s default)."""
    try:
        config = read_json(os.path.join(path, "config.json"))
    except (OSError, ValueError) as error:
        raise FrozenTowerError(f"{named} {path!r}: no readable config.json ({error})") from None
    if not isinstance(config, dict):
        raise FrozenTowerError(f"{named} {path!r}: config.json is not an object")
    try:
        if "backbone" in config:
            tower, width = _our_tower(path, config, named)
        elif "architecture" in config:
            from models.timm_tower import load_timm_tower

            tower = load_timm_tower(path, None, dtype)
            width = tower.output_dim
        elif "model_type" in config:
            from models.vision import VisionTower, load_vision_encoder

            encoder, processor = load_vision_encoder(path, dtype)
            tower = VisionTower(encoder, "pooled", processor.image_mean, processor.image_std)
            width = tower.output_dim
        else:
            raise FrozenTowerError(
                f"{named} {path!r}: config.json is none of ours (backbone), timm's "
                "(architecture) or transformers' (model_type)"
            )
    except ValueError as error:  # the loaders' one-line errors, named after this option
        message = str(error)
        for option in ("--timm-model", "--image-model"):
            message = message.replace(option, named)
        raise FrozenTowerError(message) from None
    tower = tower.to(dtype).eval().requires_grad_(False)
    return FrozenTower(tower, width, config)


def _our_tower(path: str, config: dict, named: str) -> tuple[nn.Module, int]:
    backbone, size = config["backbone"], config.get("image_size")
    channels = config.get("in_channels", 3)
    # Untrusted JSON: a name of the table, and sizes a tower can be built at.
    sizes_valid = all(type(value) is int and 1 <= value <= limit
                      for value, limit in ((size, MAX_IMAGE_SIZE), (channels, 4)))  # fmt: skip
    if not isinstance(backbone, str) or backbone not in IMAGE_TOWERS or not sizes_valid:
        raise FrozenTowerError(
            f"{named} {path!r}: config.json's backbone {backbone!r} is not one of "
            f"{', '.join(IMAGE_TOWERS)}, or its image_size or in_channels is not an integer "
            f"from 1 to {MAX_IMAGE_SIZE} and 4"
        )
    encoder, width = IMAGE_TOWERS[backbone].build(size, channels, 0.0, 0.0)
    try:
        weights = load_file(os.path.join(path, "model.safetensors"))
    except (OSError, SafetensorError) as error:
        raise FrozenTowerError(f"{named} {path!r}: model.safetensors: {error}") from None
    prefix = "encoder."
    own = {name[len(prefix) :]: value for name, value in weights.items() if name.startswith(prefix)}
    try:
        missing, unexpected = encoder.load_state_dict(own, strict=False)
    except RuntimeError:  # a weight of another shape
        missing, unexpected = ["shapes"], []
    if missing or unexpected:
        raise FrozenTowerError(
            f"{named} {path!r}: model.safetensors does not hold a {backbone} encoder "
            f"({len(missing)} missing or of other shapes, {len(unexpected)} unexpected)"
        )
    return encoder, width
