"""SimCLR: an encoder followed by a projection head, saved HF-style (safetensors + config.json)."""

from __future__ import annotations

import torch
import torchvision
from huggingface_hub import PyTorchModelHubMixin
from torch import nn

BACKBONES = ("resnet18", "resnet34", "resnet50", "mlp")


class SimCLR(nn.Module, PyTorchModelHubMixin):
    """Encoder + projection head (Chen et al., 2020, "A Simple Framework for Contrastive Learning").

    ``backbone`` is a torchvision ResNet (randomly initialised: nothing downloads)
    with the projection head Linear-BN-ReLU-Linear, or ``"mlp"``: a small
    BatchNorm-free encoder and head for fast exactness checks. For images of at
    most ``small_image_max_size`` pixels the ResNet stem is the CIFAR one
    (3x3 stride-1 conv, no max-pool), as in the SimCLR paper's CIFAR-10 runs.

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
        small_image_max_size: int = 64,
    ) -> None:
        super().__init__()
        if backbone not in BACKBONES:
            raise ValueError(f"unknown backbone {backbone!r}; choose one of {', '.join(BACKBONES)}")
        if backbone == "mlp":
            hidden = 256
            self.encoder = nn.Sequential(
                nn.Flatten(),
                nn.Linear(in_channels * image_size * image_size, hidden),
                nn.ReLU(),
                nn.Linear(hidden, hidden),
            )
            self.projection_head = nn.Sequential(
                nn.ReLU(),
                nn.Linear(hidden, projection_hidden_dim),
                nn.ReLU(),
                nn.Linear(projection_hidden_dim, projection_dim),
            )
            return
        resnet = torchvision.models.get_model(backbone, weights=None)
        if image_size <= small_image_max_size:  # CIFAR stem: keep the few pixels there are
            resnet.conv1 = nn.Conv2d(
                in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False
            )
            resnet.maxpool = nn.Identity()
        elif in_channels != 3:
            resnet.conv1 = nn.Conv2d(
                in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False
            )
        feature_dim = resnet.fc.in_features
        resnet.fc = nn.Identity()
        self.encoder = resnet
        self.projection_head = nn.Sequential(
            nn.Linear(feature_dim, projection_hidden_dim, bias=False),
            nn.BatchNorm1d(projection_hidden_dim),
            nn.ReLU(),
            nn.Linear(projection_hidden_dim, projection_dim),
        )

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        """Encoder features: what downstream tasks and the kNN evaluation use."""
        return self.encoder(images)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.projection_head(self.encoder(images))
