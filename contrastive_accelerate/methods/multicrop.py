"""Multi-crop (Caron et al., 2020): global crops and smaller local crops of each image,
which DINO, SwAV and distillation share: the options, the dataset, the forward crop by crop, and
their refusals."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from contrastive_accelerate.config import ConfigError, field_names, option
from contrastive_accelerate.data import MultiCrop, MultiCropBatch
from contrastive_accelerate.data.images import MixedImages, per_source
from contrastive_accelerate.data.masks import PatchMasking
from contrastive_accelerate.data.mixture import Mixture
from contrastive_accelerate.data.sources import ImageData
from contrastive_accelerate.methods.base import augmentation_options
from models import sample_keys, sample_randomness
from models.towers import scratch_tower


@dataclass
class MultiCropOptions:
    """The crops of the multi-crop methods, a section of ``TrainConfig``
    (``contrastive_accelerate.options``)."""

    global_crops: int = option(2, "dino, swav, distill: global crops per sample", at_least=1)
    local_crops: int | None = option(
        None, "dino, swav, distill: local crops per sample; none: the method's",
        at_least=0,
    )  # fmt: skip
    local_crop_size: int | None = option(
        None, "dino, swav, distill: local crop size; none: half of --image-size", at_least=1
    )


#: What the multi-crop methods read.
MULTICROP_OPTIONS = field_names(MultiCropOptions)


def multicrop_dataset(
    config, data: ImageData | MixedImages, masking: PatchMasking | None = None
) -> MultiCrop | Mixture:
    """Each image's global and local crops, drawn from (seed, epoch, index, crop), with
    the global crops' patch masks where ``masking`` says how; of each source, for a
    mixture."""
    return per_source(data, lambda rows, image_column: MultiCrop(
        rows, image_column, config.image_size, config.seed, config.global_crops,
        config.local_crops, config.local_crop_size, **augmentation_options(config),
        masking=masking,
    ))  # fmt: skip


def embed_crops(
    model: nn.Module,
    crops: torch.Tensor,
    indices: torch.Tensor,
    seed: int,
    step: int,
    first_view: int,
    **inputs: Any,
) -> Any:
    """``(crops, n, C, H, W)`` of one resolution in one forward, crop-major rows;
    dropout keyed by (seed, step, each sample's index, ``first_view`` + crop); ``inputs``
    are the model's other arguments (DINOv2's patch masks)."""
    parameter = next(model.parameters())
    images = crops.to(parameter.device, parameter.dtype, non_blocking=True).flatten(0, 1)
    views = range(first_view, first_view + len(crops))
    keys = torch.cat([sample_keys(seed, step, indices, view) for view in views])
    with sample_randomness(keys.to(parameter.device, non_blocking=True)):
        return model(images, **inputs)


def embed_multicrop(model: nn.Module, chunk: MultiCropBatch, seed: int, step: int) -> torch.Tensor:
    """Every crop of one chunk, crop-major: one forward per resolution (the global crops,
    then the local ones)."""
    first_local = len(chunk.global_crops)
    return torch.cat(
        [
            embed_crops(model, crops, chunk.indices, seed, step, first_view)
            for crops, first_view in ((chunk.global_crops, 0), (chunk.local_crops, first_local))
            if len(crops)
        ]
    )


def crop_outputs(outputs: list[torch.Tensor], batch: MultiCropBatch) -> list[torch.Tensor]:
    """The outputs of every chunk (``embed_multicrop``'s) as one tensor per crop, each
    with this rank's rows in sample order."""
    crops = len(batch.global_crops) + len(batch.local_crops)
    per_crop = [output.unflatten(0, (crops, len(output) // crops)) for output in outputs]
    return [torch.cat([output[crop] for output in per_crop]) for crop in range(crops)]


def crop_defaults(config) -> dict[str, int]:
    """Six local crops of half the size, as DINO and SwAV take; none for a tower of one
    input size (the mlp) or for the digits (a 4-px crop of a digit is a few pixels of
    stroke)."""
    return {
        "local_crops": 0 if not any_input_size(config) or config.digits else 6,
        "local_crop_size": max(1, config.image_size // 2),
    }


def any_input_size(config) -> bool:
    """Whether the tower takes local crops at another size than the global ones: a row of
    ``IMAGE_TOWERS`` that says so, or a pretrained tower (``--image-model``,
    ``--timm-model``: a ViT interpolates its position embeddings, a convolutional network
    takes any size; one that cannot embed ``--local-crop-size`` is refused where it
    loads, by its probe)."""
    tower = scratch_tower(config)
    return tower is None or tower.any_input_size


def check_crops(config) -> None:
    """Local crops that the tower cannot take, or larger than the global ones."""
    tower = scratch_tower(config)
    if config.local_crops and tower is not None and not tower.any_input_size:
        raise ConfigError(
            f"--local-crops: {config.model} takes one input size; use a resnet or a vit"
        )
    if config.local_crop_size and config.image_size and config.local_crop_size > config.image_size:
        raise ConfigError(
            f"--local-crop-size {config.local_crop_size} is larger than the global crops "
            f"(--image-size {config.image_size})"
        )
    patches = tower is not None and tower.patch_size is not None and config.local_crops != 0
    if patches and config.local_crop_size and config.image_size:
        patch = tower.patch_size(config.image_size)
        if config.local_crop_size % patch:
            raise ConfigError(
                f"--local-crop-size {config.local_crop_size}: {config.model} at --image-size "
                f"{config.image_size} has patches of {patch} px, which must divide it"
            )
