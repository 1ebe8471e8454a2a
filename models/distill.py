"""The student of feature distillation: an image tower and a linear projection to the
teacher's width (lightly-train's ``distillation``)."""

from __future__ import annotations

from torch import nn

from models.image import ImageModel


class DistillStudent(ImageModel):
    """``projection_head(encoder(x))``, a ``Linear`` from the tower's width to
    ``teacher_dim``: what the distillation loss compares with the teacher's features.
    ``final/`` keeps both; the encoder is what is deployed.

    Example::

        student = DistillStudent(backbone="mlp", image_size=8, teacher_dim=512)
        loss = DistillationLoss()(student(images), teacher(images))
    """

    def __init__(
        self,
        backbone: str = "resnet18",
        image_size: int = 32,
        in_channels: int = 3,
        teacher_dim: int = 512,
        dropout: float = 0.0,
        drop_path: float = 0.0,
        encoder: nn.Module | None = None,
    ) -> None:
        super().__init__()
        _, width = self.add_tower(
            backbone, image_size, in_channels, dropout, drop_path, encoder=encoder
        )
        self.projection_head = nn.Linear(width, teacher_dim)
