"""SimCLR's model (Chen et al., 2020): an image tower and a projection head, and the
CLIP-style losses' learnable scale and bias when SimCLR trains with them."""

from __future__ import annotations

import math

import torch
from torch import nn

from models.image import ImageModel, tower_projection_head
from models.towers import IMAGE_TOWERS, SMALL_IMAGE_MAX_SIZE

BACKBONES = tuple(IMAGE_TOWERS)


class SimCLR(ImageModel):
    """Encoder + projection head (Chen et al., 2020, "A Simple Framework for Contrastive Learning").

    ``backbone`` is a row of ``models.towers.IMAGE_TOWERS``: a torchvision ResNet
    (randomly initialised: nothing downloads; the CIFAR stem for images of at most 64
    px) with the projection head Linear-BN-ReLU-Linear (``projection_layers`` 3 gives
    Barlow Twins' and VICReg's Linear-BN-ReLU-Linear-BN-ReLU-Linear); a torchvision
    ``VisionTransformer`` (``"vit_tiny"``, ``"vit_small"``: LayerNorm, no batch
    statistics, the class token as feature) with a BatchNorm-free head; or ``"mlp"``: a
    small BatchNorm-free encoder and head for fast exactness checks. ``dropout`` applies
    to the ViT's and the mlp's ``nn.Dropout`` layers (attention dropout stays 0: see
    ``models.dropout``), ``drop_path`` to the ViT's blocks (DINO's linear rates from 0
    to ``drop_path`` at the last block). ``logit_scale`` and ``logit_bias`` add
    learnable parameters initialised to these values for the CLIP-style losses
    (InfoNCE, SigLIP): ``log_logit_scale``, the log of the scale, as CLIP learns it
    (pass ``log_logit_scale.exp()`` to the loss), and ``logit_bias``.

    Example::

        model = SimCLR(backbone="resnet18", image_size=32)
        projections = model(images)              # (batch, projection_dim), for the loss
        features = model.embed(images)           # (batch, feature_dim), for evaluation
    """

    def __init__(
        self,
        backbone: str = "resnet18",
        image_size: int = 32,
        in_channels: int = 3,
        projection_hidden_dim: int = 512,
        projection_dim: int = 128,
        projection_layers: int = 2,
        small_image_max_size: int = SMALL_IMAGE_MAX_SIZE,
        logit_scale: float | None = None,
        logit_bias: float | None = None,
        dropout: float = 0.0,
        drop_path: float = 0.0,
        encoder: nn.Module | None = None,
    ) -> None:
        super().__init__()
        # CLIP-style temperature as a learnable log-scale (and SigLIP's bias): parameters of
        # the model, so DDP synchronises them and checkpoints carry them.
        self.log_logit_scale = (
            nn.Parameter(torch.tensor(math.log(logit_scale))) if logit_scale is not None else None
        )
        self.logit_bias = (
            nn.Parameter(torch.tensor(float(logit_bias))) if logit_bias is not None else None
        )
        tower, width = self.add_tower(
            backbone, image_size, in_channels, dropout, drop_path, small_image_max_size, encoder
        )
        self.projection_head = tower_projection_head(
            tower, width, projection_hidden_dim, projection_dim, projection_layers
        )
