"""Data for contrastive training that does not depend on the number of processes.

One module per concern:

- ``sources``: the dataset, its splits and columns (hub, local files, offline digits);
- ``formats``: each file format, read as a table, as shards of a stream, or both;
- ``decoding``: stored images as tensors, unreadable ones named;
- ``augmentation``: each sample's views drawn from (seed, epoch, index) alone;
- ``sampler``: the global batch from (seed, epoch) and each rank's contiguous share;
- ``streams``: shards read in order as streams, the same global batches on any W;
- ``loader``: one DataLoader for the run, its persistent workers stopped on exit.
- ``interfaces``: what a method's dataset, its batches and the loop's sampler are to
  each other, as ``Protocol``s.
"""

from contrastive_accelerate.data.augmentation import (
    AUGMENTATIONS,
    MultiCrop,
    MultiCropBatch,
    TwoViewBatch,
    TwoViews,
    simclr_augmentation,
)
from contrastive_accelerate.data.decoding import (
    NORMALIZE,
    UnreadableImage,
    evaluation_images,
    read_image,
)
from contrastive_accelerate.data.loader import train_loader, workers_stopped_on_exit
from contrastive_accelerate.data.sampler import (
    GlobalBatchSampler,
    batches_per_epoch,
    derive_seed,
    share_sizes,
)
from contrastive_accelerate.data.sources import (
    DataError,
    ImageData,
    label_ids,
    load_image_dataset,
)
from contrastive_accelerate.data.streams import BadRow, ShardStreams, StreamBatches, described

__all__ = [
    "AUGMENTATIONS",
    "NORMALIZE",
    "BadRow",
    "DataError",
    "GlobalBatchSampler",
    "ImageData",
    "MultiCrop",
    "MultiCropBatch",
    "ShardStreams",
    "StreamBatches",
    "TwoViewBatch",
    "TwoViews",
    "UnreadableImage",
    "batches_per_epoch",
    "derive_seed",
    "described",
    "evaluation_images",
    "label_ids",
    "load_image_dataset",
    "read_image",
    "share_sizes",
    "simclr_augmentation",
    "train_loader",
    "workers_stopped_on_exit",
]
