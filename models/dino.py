"""DINO's model (Caron et al., 2021): an image tower under DINO's head (``DINOHead``), an
MLP, L2 normalisation, and a weight-normalised last layer whose rows all have norm 1
(``norm_last_layer=True``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.image import ImageModel, tower_projection_head


class DINOHead(nn.Module):
    """``x -> W normalize(mlp(x))`` with ``W``'s rows of norm 1.

    The MLP is Linear-GELU-Linear-GELU-Linear (``layers`` linear layers) into
    ``bottleneck_dim``, with ``batch_norm`` Linear-BN-GELU (DINO's ``use_bn_in_head``),
    initialised as DINO does (truncated normal, std 0.02, zero biases); the last layer
    is ``weight_norm`` of a bias-free ``nn.Linear`` with its magnitude fixed at 1,
    written out as ``v / ||v||`` per output row, so the state holds one plain tensor
    ``last_layer`` that an EMA and safetensors treat like any other.

    Example::

        head = DINOHead(512, out_dim=1024)
        logits = head(encoder(images))        # (batch, 1024): DINOLoss's input
    """

    def __init__(
        self,
        in_dim: int,
        out_dim: int,
        hidden_dim: int = 512,
        bottleneck_dim: int = 128,
        layers: int = 3,
        batch_norm: bool = False,
    ) -> None:
        super().__init__()
        self.batch_norm = batch_norm
        dims = [in_dim] + [hidden_dim] * (layers - 1)
        modules: list[nn.Module] = []
        for fan_in, fan_out in zip(dims[:-1], dims[1:], strict=True):
            modules.append(nn.Linear(fan_in, fan_out))
            modules += [nn.BatchNorm1d(fan_out)] if batch_norm else []
            modules.append(nn.GELU())
        modules.append(nn.Linear(dims[-1], bottleneck_dim))
        self.mlp = nn.Sequential(*modules)
        for module in self.mlp:
            if isinstance(module, nn.Linear):
                nn.init.trunc_normal_(module.weight, std=0.02)
                nn.init.zeros_(module.bias)
        self.last_layer = nn.Parameter(nn.Linear(bottleneck_dim, out_dim, bias=False).weight.data)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.normalize(self.mlp(x), dim=-1)
        return x @ F.normalize(self.last_layer, dim=1).T


class DINOModel(ImageModel):
    """An image tower under DINO's head: ``projection_hidden_dim`` wide, into
    ``projection_dim``, then ``dino_out_dim`` logits; BatchNorm in its MLP for the
    ResNets, as in every head of theirs. A ViT tower takes local crops at other sizes.
    With ``class_features`` the tower's features come first, beside the logits
    (``forward``).

    Example::

        model = DINOModel(backbone="vit_small", image_size=224, dino_out_dim=65536)
        logits = model(crops)                    # (batch, dino_out_dim): DINOLoss's input
    """

    def __init__(
        self,
        backbone: str = "resnet18",
        image_size: int = 32,
        in_channels: int = 3,
        projection_hidden_dim: int = 512,
        projection_dim: int = 128,
        dino_out_dim: int = 1024,
        dropout: float = 0.0,
        drop_path: float = 0.0,
        encoder: nn.Module | None = None,
        class_features: bool = False,
    ) -> None:
        super().__init__()
        tower, width = self.add_tower(
            backbone, image_size, in_channels, dropout, drop_path, encoder=encoder
        )
        self.class_features, self.feature_dim = class_features, width
        # SimCLR's head is drawn and dropped, as earlier versions did before replacing it:
        # a seed gives the weights it gave them.
        tower_projection_head(tower, width, projection_hidden_dim, projection_dim, 2)
        self.projection_head = DINOHead(
            width, dino_out_dim, projection_hidden_dim, projection_dim,
            batch_norm=tower.batch_norm,
        )  # fmt: skip

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """The head's logits; with ``class_features``, the tower's features before them,
        side by side (DINOv2's KoLeo reads the student's class tokens)."""
        features = self.encoder(images)
        logits = self.projection_head(features)
        return torch.cat([features, logits], dim=1) if self.class_features else logits
