"""Data for contrastive training that does not depend on the number of processes.

Three pieces make sample i look the same on 1 or N processes:
- ``GlobalBatchSampler`` draws the global batch from (seed, epoch) alone and gives
  each rank a contiguous share, so the concatenation of the shares in rank order
  is the single-process batch. The last, short batch is split without padding
  (a rank may get nothing), so no sample is repeated as a false negative.
- ``TwoViews`` seeds the augmentation of sample i from (seed, epoch, i): the
  crops do not depend on rank, dataloader worker or worker count.
- Items are ``(epoch, index)`` pairs, so the dataset needs no mutable epoch state
  and persistent workers stay correct.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import Sampler
from torchvision.transforms import v2

IMAGE_COLUMNS = ("image", "img", "pixel_values")
LABEL_COLUMNS = ("label", "labels", "fine_label")
EVAL_SPLITS = ("test", "validation", "valid", "val")


class DataError(ValueError):
    """A dataset problem the user must fix: reported as one line, not a traceback."""


def load_image_dataset(name: str | None, image_column: str | None = None):
    """Return ``(train, evaluation, image_column, label_column)`` as HF datasets.

    ``name`` is a hub dataset, a local dataset directory or an image folder (all
    through ``datasets.load_dataset``). ``None`` is the offline default:
    scikit-learn's 8x8 handwritten digits, real images that ship with the package.
    ``evaluation`` is the dataset's test/validation split, or a held-out 20% of a
    labelled train split; ``None`` when there are no labels.
    """
    import datasets

    if name is None:
        dataset = _digits_dataset()
    else:
        looks_like_path = os.sep in name or name.startswith(".") or os.path.exists(name)
        if looks_like_path and not os.path.exists(name):
            raise DataError(f"dataset path {name!r} does not exist")
        try:
            dataset = datasets.load_dataset(name)
        except Exception as error:  # datasets raises many types; the user needs one line
            raise DataError(f"cannot load dataset {name!r}: {_first_line(error)}") from None
    if isinstance(dataset, datasets.DatasetDict):
        if "train" not in dataset:
            raise DataError(f"dataset {name!r} has no 'train' split (splits: {list(dataset)})")
        train = dataset["train"]
        evaluation = next((dataset[split] for split in EVAL_SPLITS if split in dataset), None)
    else:
        train, evaluation = dataset, None

    columns = train.column_names
    if image_column is None:
        image_column = next((c for c in IMAGE_COLUMNS if c in columns), None)
    if image_column not in columns:
        wanted = repr(image_column) if image_column else " or ".join(map(repr, IMAGE_COLUMNS))
        raise DataError(
            f"dataset {name or 'digits'!r} has no image column {wanted} "
            f"(columns: {', '.join(columns)}); pass --image-column"
        )
    label_column = next((c for c in LABEL_COLUMNS if c in columns), None)
    if evaluation is None and label_column is not None and len(train) >= 10:
        split = train.train_test_split(test_size=0.2, seed=0)
        train, evaluation = split["train"], split["test"]
    if label_column is None or (
        evaluation is not None and label_column not in evaluation.column_names
    ):
        evaluation = None
    return train, evaluation, image_column, label_column


def _digits_dataset():
    import datasets
    from sklearn.datasets import load_digits

    digits = load_digits()
    # 0..16 grey levels -> 0..255 uint8 images
    images = (digits.images * (255 / 16)).round().astype(np.uint8)
    features = datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(names=[str(d) for d in range(10)])}
    )
    return datasets.Dataset.from_dict(
        {"image": list(images), "label": digits.target.tolist()}, features=features
    )


def _first_line(error: Exception) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0]


def simclr_augmentation(image_size: int, crop_min_scale: float = 0.2) -> v2.Transform:
    """SimCLR's augmentation (Chen et al., 2020, appendix A), sized for ``image_size``.

    Gaussian blur is used from 64 px up, with a kernel of about 10% of the image,
    as in the paper; for CIFAR-sized images the paper leaves it out.
    """
    transforms = [
        v2.RandomResizedCrop(image_size, scale=(crop_min_scale, 1.0), antialias=True),
        v2.RandomHorizontalFlip(),
        v2.RandomApply([v2.ColorJitter(0.4, 0.4, 0.4, 0.1)], p=0.8),
        v2.RandomGrayscale(p=0.2),
    ]
    if image_size >= 64:
        kernel = int(0.1 * image_size) // 2 * 2 + 1
        transforms.append(v2.RandomApply([v2.GaussianBlur(kernel, sigma=(0.1, 2.0))], p=0.5))
    return v2.Compose(transforms)


def _to_tensor(image_size: int) -> v2.Transform:
    return v2.Compose(
        [
            v2.ToImage(),
            v2.RGB(),
            v2.Resize((image_size, image_size), antialias=True),
        ]
    )


NORMALIZE = v2.Compose([v2.ToDtype(torch.float32, scale=True), v2.Normalize([0.5] * 3, [0.5] * 3)])


_AUGMENT_STREAM, _SHUFFLE_STREAM = 0, 1


def derive_seed(*values: int) -> int:
    """A well-mixed 63-bit seed from integers alone (no process state), in about a microsecond."""
    digest = hashlib.blake2b(repr(values).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class TwoViews(torch.utils.data.Dataset):
    """Two augmented views of one image; items are ``(epoch, index)`` pairs.

    With ``per_sample_seed`` (the default) the views of sample i depend only on
    (seed, epoch, i). Without it, augmentations draw from the process's global RNG
    as most pipelines do, so they change with rank, worker and world size: kept
    as an option to demonstrate exactly that.
    """

    def __init__(
        self,
        dataset,
        image_column: str,
        image_size: int,
        seed: int,
        augment: bool = True,
        per_sample_seed: bool = True,
        crop_min_scale: float = 0.2,
    ) -> None:
        self.dataset, self.image_column, self.image_size = dataset, image_column, image_size
        self.seed, self.per_sample_seed = seed, per_sample_seed
        self.to_tensor = _to_tensor(image_size)
        self.augment = simclr_augmentation(image_size, crop_min_scale) if augment else v2.Identity()

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, item: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        epoch, index = item
        image = self.to_tensor(self.dataset[index][self.image_column])
        if not self.per_sample_seed:
            return NORMALIZE(self.augment(image)), NORMALIZE(self.augment(image))
        # Reseed the CPU generator that torchvision draws from, and restore it so the
        # caller's stream (e.g. dropout when num_workers=0) is untouched. Not
        # torch.manual_seed: it also seeds every accelerator backend, ~100x slower.
        generator = torch.default_generator
        caller_state = generator.get_state()
        generator.manual_seed(derive_seed(self.seed, _AUGMENT_STREAM, epoch, index))
        try:
            return NORMALIZE(self.augment(image)), NORMALIZE(self.augment(image))
        finally:
            generator.set_state(caller_state)

    def collate(self, views: list[tuple[torch.Tensor, torch.Tensor]]):
        """Stack views; an empty share (short last batch on many ranks) gives empty tensors."""
        if not views:
            empty = torch.empty(0, 3, self.image_size, self.image_size)
            return empty, empty.clone()
        first, second = zip(*views, strict=True)
        return torch.stack(first), torch.stack(second)


class GlobalBatchSampler(Sampler[list[tuple[int, int]]]):
    """This rank's share of each global batch of one epoch, as ``(epoch, index)`` items.

    The permutation depends only on (seed, epoch); global batch b is split into
    ``world_size`` contiguous shares of sizes differing by at most one (earlier
    ranks get the extra samples). ``start_batch`` skips batches already trained,
    for an exact mid-epoch resume. ``batch_size`` and ``drop_last`` are there for
    Accelerate's ``BatchSamplerShard``, which only the padded-batches control uses.
    """

    def __init__(
        self,
        dataset_size: int,
        global_batch_size: int,
        epoch: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
        drop_last: bool = False,
        start_batch: int = 0,
    ) -> None:
        self.dataset_size, self.global_batch_size = dataset_size, global_batch_size
        self.epoch, self.seed, self.shuffle, self.drop_last = epoch, seed, shuffle, drop_last
        self.rank, self.world_size, self.start_batch = rank, world_size, start_batch
        self.batch_size = global_batch_size

    def global_batches(self) -> list[torch.Tensor]:
        if self.shuffle:
            generator = torch.Generator().manual_seed(
                derive_seed(self.seed, _SHUFFLE_STREAM, self.epoch)
            )
            order = torch.randperm(self.dataset_size, generator=generator)
        else:
            order = torch.arange(self.dataset_size)
        batches = order.split(self.global_batch_size)
        return list(
            batches[: batches_per_epoch(self.dataset_size, self.global_batch_size, self.drop_last)]
        )

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        for batch in self.global_batches()[self.start_batch :]:
            share = batch.tensor_split(self.world_size)[self.rank]
            yield [(self.epoch, index) for index in share.tolist()]

    def __len__(self) -> int:
        return max(
            0,
            batches_per_epoch(self.dataset_size, self.global_batch_size, self.drop_last)
            - self.start_batch,
        )


def batches_per_epoch(dataset_size: int, global_batch_size: int, drop_last: bool) -> int:
    """Full batches, plus the short last one unless ``drop_last`` or it holds one sample
    (a single pair has no negatives)."""
    remainder = dataset_size % global_batch_size
    return dataset_size // global_batch_size + (not drop_last and remainder >= 2)


def evaluation_images(dataset, image_column: str, image_size: int) -> torch.Tensor:
    """All images of a split, resized and normalised, as one tensor (for kNN evaluation)."""
    to_tensor = _to_tensor(image_size)
    return torch.stack([NORMALIZE(to_tensor(row[image_column])) for row in dataset])
