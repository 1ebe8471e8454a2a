"""SwAV's model (Caron et al., 2020): an image tower under SimCLR's projection head, the
projection L2-normalised, and a bias-free linear layer of prototypes whose rows are
kept at norm 1."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.image import ImageModel, tower_projection_head


class SwAVModel(ImageModel):
    """``z = normalize(head(encoder(x)))`` and its scores ``z P^T`` against
    ``prototypes`` rows of ``P``; ``forward`` returns both side by side, ``(batch,
    projection_dim + prototypes)``: the scores are the loss's input, ``z`` is what the
    queue keeps (its scores are recomputed with each step's prototypes).

    SwAV normalises the prototypes' rows before each step, outside the gradient
    (``normalize_prototypes``, which the method calls after each optimizer step and
    which ``__init__`` calls once), not inside the forward as a weight norm.

    Example::

        model = SwAVModel(backbone="resnet18", image_size=32, prototypes=3000)
        z, scores = model(crops).split([128, 3000], dim=1)   # scores: SwAVLoss's input
        model.normalize_prototypes()                          # after optimizer.step()
    """

    def __init__(
        self,
        backbone: str = "resnet18",
        image_size: int = 32,
        in_channels: int = 3,
        projection_hidden_dim: int = 512,
        projection_dim: int = 128,
        projection_layers: int = 2,
        prototypes: int = 3000,
        dropout: float = 0.0,
        drop_path: float = 0.0,
        encoder: nn.Module | None = None,
    ) -> None:
        super().__init__()
        tower, width = self.add_tower(
            backbone, image_size, in_channels, dropout, drop_path, encoder=encoder
        )
        self.projection_head = tower_projection_head(
            tower, width, projection_hidden_dim, projection_dim, projection_layers
        )
        self.prototypes = nn.Linear(projection_dim, prototypes, bias=False)
        self.normalize_prototypes()

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        z = F.normalize(self.projection_head(self.encoder(images)), dim=1)
        return torch.cat([z, self.prototypes(z)], dim=1)

    @torch.no_grad()
    def normalize_prototypes(self) -> None:
        """Each prototype's row to norm 1, in place: a row-sharded weight (FSDP2's
        ``DTensor``, whose shards are whole rows) on its own rows."""
        weight = self.prototypes.weight
        rows = weight.to_local() if hasattr(weight, "to_local") else weight
        rows.copy_(F.normalize(rows, dim=1))
