"""Models for contrastive pre-training."""

from models.dropout import (
    SampleDropout,
    SampleDropPath,
    convert_sample_dropout,
    sample_keys,
    sample_randomness,
)
from models.simclr import BACKBONES, SimCLR
from models.sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm

__all__ = [
    "BACKBONES",
    "SampleDropPath",
    "SampleDropout",
    "SimCLR",
    "SyncBatchNorm",
    "convert_sample_dropout",
    "convert_sync_batchnorm",
    "sample_keys",
    "sample_randomness",
]
