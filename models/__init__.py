"""Models for contrastive pre-training."""

from models.dino import DINOModel
from models.dinov2 import DINOv2Model
from models.distill import DistillStudent
from models.dropout import (
    SampleDropout,
    SampleDropPath,
    convert_sample_dropout,
    sample_keys,
    sample_randomness,
)
from models.image import ImageModel
from models.momentum import PredictorModel
from models.simclr import BACKBONES, SimCLR
from models.swav import SwAVModel
from models.sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm

__all__ = [
    "BACKBONES",
    "DINOModel",
    "DINOv2Model",
    "DistillStudent",
    "ImageModel",
    "PredictorModel",
    "SampleDropPath",
    "SampleDropout",
    "SimCLR",
    "SwAVModel",
    "SyncBatchNorm",
    "convert_sample_dropout",
    "convert_sync_batchnorm",
    "sample_keys",
    "sample_randomness",
]
