"""DINOv2's model (Oquab et al., 2024): DINO's model on a ViT, with a learnable mask token
for the patches the student does not see and iBOT's head on the patch tokens."""

from __future__ import annotations

import torch
from torch import nn

from losses.ibot import masked_rows
from models.dino import DINOHead, DINOModel


class DINOv2Model(DINOModel):
    """DINO's model on a ViT (ours, ``models.towers.MultiResolutionViT``, or a pretrained
    ``transformers`` or timm one: any tower with ``tokens`` and a ``patch_size``) that also
    returns iBOT's logits of the masked patches: the mask token (zeros at first, as
    DINOv2's) replaces their embeddings in the student's input, and iBOT's head is DINO's
    own (DINOv2's default) or, with ``separate_ibot_head``, another of the same shape.

    Example::

        model = DINOv2Model(backbone="vit_small", image_size=224, dino_out_dim=65536)
        classes, patches = model(crops, masks)   # (n, K) and (masked patches, K)
        logits = model(local_crops)              # (n, K): DINO's forward
    """

    def __init__(
        self,
        backbone: str = "vit_small",
        image_size: int = 224,
        in_channels: int = 3,
        projection_hidden_dim: int = 512,
        projection_dim: int = 128,
        dino_out_dim: int = 1024,
        dropout: float = 0.0,
        drop_path: float = 0.0,
        encoder: nn.Module | None = None,
        class_features: bool = False,
        separate_ibot_head: bool = False,
    ) -> None:
        super().__init__(
            backbone, image_size, in_channels, projection_hidden_dim, projection_dim,
            dino_out_dim, dropout, drop_path, encoder, class_features,
        )  # fmt: skip
        if getattr(self.encoder, "patch_size", None) is None:  # no ViT: a ResNet, a ConvNeXt
            inner = getattr(encoder, "encoder", encoder)  # a pretrained tower's library model
            tower = backbone if encoder is None else type(inner).__name__
            raise ValueError(f"DINOv2 masks the patches of a ViT; {tower} has none")
        self.mask_token = nn.Parameter(torch.zeros(self.feature_dim))
        self.ibot_head = (
            DINOHead(self.feature_dim, dino_out_dim, projection_hidden_dim, projection_dim)
            if separate_ibot_head
            else None
        )

    def patch_grid(self, image_size: int) -> int:
        """The side of the tower's grid of patches at ``image_size`` (what a mask covers)."""
        patch = self.encoder.patch_size
        if image_size % patch:
            raise ValueError(
                f"DINOv2 masks whole patches: --image-size {image_size} is not a multiple of "
                f"the tower's patch size {patch}"
            )
        return image_size // patch

    def forward(
        self,
        images: torch.Tensor,
        masks: torch.Tensor | None = None,
        masked: int | None = None,
        mask_input: bool = True,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """DINO's outputs (``DINOModel.forward``); with ``masks`` (``(n, patches)``
        boolean) also iBOT's head on the masked patches' tokens, in ``masks``' order,
        with those patches masked in the input (the student) or not (``mask_input=False``:
        the teacher). ``masked``, the number of masked patches where the caller knows it
        (the loader counts them), spares the host a read of the device."""
        if masks is None:
            return super().forward(images)
        tokens = self.encoder.tokens(images, masks if mask_input else None, self.mask_token)
        features = tokens[:, 0]
        logits = self.projection_head(features)
        head = self.projection_head if self.ibot_head is None else self.ibot_head
        patches = tokens[:, 1:].flatten(0, 1).index_select(0, masked_rows(masks, masked))
        classes = torch.cat([features, logits], dim=1) if self.class_features else logits
        return classes, head(patches)
