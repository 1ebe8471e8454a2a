"""Models for contrastive pre-training."""

from models.simclr import BACKBONES, SimCLR

__all__ = ["BACKBONES", "SimCLR"]
