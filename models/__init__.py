"""Models for contrastive pre-training."""

from models.simclr import BACKBONES, SimCLR
from models.sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm

__all__ = ["BACKBONES", "SimCLR", "SyncBatchNorm", "convert_sync_batchnorm"]
