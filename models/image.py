"""What every image method's model shares: an image tower (a row of ``models.towers``)
under the heads of the method that trains it, saved HF-style (safetensors +
``config.json``).

``ImageModel`` holds the tower as ``encoder`` (``embed``: its features, what the kNN and
the linear probe evaluate) and computes ``projection_head(encoder(images))``; each
method's model adds its own heads: ``models.simclr.SimCLR`` (a projection head, and the
CLIP-style losses' learnable scale and bias), ``models.momentum.PredictorModel``
(SimCLR's head and BYOL's and MoCo v3's predictor), ``models.dino.DINOModel`` (DINO's
head). ``projection_head`` builds the MLP heads they share. A subclass registers its
modules in the order of earlier versions (heads drawn before the tower are drawn
first), so that a seed gives the same weights and a checkpoint's optimizer state, which
follows the parameters' order, the same parameters.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from huggingface_hub import PyTorchModelHubMixin
from torch import nn

from models.towers import PRETRAINED_TOWER, SMALL_IMAGE_MAX_SIZE, ImageTower, image_tower


class ImageModel(nn.Module, PyTorchModelHubMixin):
    """An image tower and a ``projection_head`` that a subclass sets."""

    encoder: nn.Module
    projection_head: nn.Module
    #: How a pretrained tower is saved in its own format (``--image-model``'s,
    #: ``--timm-model``'s): ``export_tower(encoder, directory)``; None: a tower from scratch.
    export_tower: Callable[[nn.Module, str], None] | None = None
    #: What a pretrained tower loaded, as content digests by option (a resume compares
    #: them: ``contrastive_accelerate.checkpoint``); empty for a tower from scratch.
    inputs: dict[str, dict[str, str]] = {}  # noqa: RUF012 - replaced, never mutated

    def add_tower(
        self,
        backbone: str,
        image_size: int,
        in_channels: int = 3,
        dropout: float = 0.0,
        drop_path: float = 0.0,
        small_image_max_size: int = SMALL_IMAGE_MAX_SIZE,
        encoder: nn.Module | None = None,
    ) -> tuple[ImageTower, int]:
        """Build the tower ``backbone`` (``models.towers.IMAGE_TOWERS``) as ``encoder``, or
        take a pretrained one (``models.vision.VisionTower``); its row and its width."""
        if encoder is not None:
            self.encoder = encoder
            return PRETRAINED_TOWER, encoder.output_dim
        if small_image_max_size != SMALL_IMAGE_MAX_SIZE:  # kept for saved config.json files
            raise ValueError(f"small_image_max_size is {SMALL_IMAGE_MAX_SIZE}")
        tower = image_tower(backbone)
        if tower.patch_size is None and drop_path:
            raise ValueError(f"drop_path applies to towers of patches, not {backbone}")
        self.encoder, width = tower.build(image_size, in_channels, dropout, drop_path)
        return tower, width

    def save_exports(
        self,
        directory: str,
        whole: Callable[[nn.Module], AbstractContextManager] = contextlib.nullcontext,
    ) -> None:
        """What ``final/`` holds besides the streamed ``model.safetensors``: for this
        one-tower model, the model itself (``save_pretrained``: its weights and
        ``config.json``), inside ``whole(self)`` (``models.text.TextPairModel``'s); a
        pretrained tower in its own format instead, in ``image/`` (``export_tower``:
        ``AutoModel`` or timm load it), the heads in the streamed weights."""
        with whole(self):
            if self.export_tower is None:
                self.save_pretrained(directory)
            else:
                self.export_tower(self.encoder, os.path.join(directory, "image"))

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        """Encoder features: what downstream tasks and the kNN evaluation use."""
        return self.encoder(images)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.projection_head(self.encoder(images))


def tower_projection_head(
    tower: ImageTower, width: int, hidden: int, out: int, layers: int
) -> nn.Sequential:
    """SimCLR's projection head on ``tower`` (``width`` features): BatchNorm where the
    tower has it, a leading ReLU where its output is a linear layer's."""
    if layers < 2:
        raise ValueError(f"projection_layers must be >= 2, got {layers}")
    return projection_head(width, hidden, out, layers, batch_norm=tower.batch_norm,
                           after_linear=tower.linear_output)  # fmt: skip


def projection_head(
    in_dim: int, hidden: int, out: int, layers: int, batch_norm: bool, after_linear: bool = True
) -> nn.Sequential:
    """``layers`` linear layers, each hidden one followed by BatchNorm (ResNets) and ReLU:
    SimCLR's head with 2 layers, Barlow Twins' and VICReg's projector with 3."""
    modules: list[nn.Module] = []
    if not batch_norm and after_linear:
        modules.append(nn.ReLU())  # the mlp encoder ends in a linear layer
    dims = [in_dim] + [hidden] * (layers - 1)
    for fan_in, fan_out in zip(dims[:-1], dims[1:], strict=True):
        modules.append(nn.Linear(fan_in, fan_out, bias=not batch_norm))
        if batch_norm:
            modules.append(nn.BatchNorm1d(fan_out))
        modules.append(nn.ReLU())
    modules.append(nn.Linear(dims[-1], out))
    return nn.Sequential(*modules)
