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
import io
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import Sampler
from torchvision.transforms import v2

IMAGE_COLUMNS = ("image", "img", "pixel_values")
LABEL_COLUMNS = ("label", "labels", "fine_label")
EVAL_SPLITS = ("test", "validation", "valid", "val")
#: Single data files that ``--dataset`` accepts, by suffix, and the ``datasets`` builder for each.
DATA_FILE_BUILDERS = {".parquet": "parquet", ".csv": "csv", ".json": "json", ".jsonl": "json"}


class DataError(ValueError):
    """A dataset problem the user must fix: reported as one line, not a traceback."""


@dataclass
class ImageData:
    """What ``load_image_dataset`` found: the splits, their columns, and where evaluation
    images come from (``evaluation_source``: one line the trainer prints at start-up)."""

    train: Any
    evaluation: Any | None
    image_column: str
    label_column: str | None
    evaluation_source: str


def load_image_dataset(
    name: str | None = None,
    *,
    config_name: str | None = None,
    split: str = "train",
    image_column: str | None = None,
    label_column: str | None = None,
    eval_split: str = "auto",
    eval_holdout: float = 0.2,
    evaluate: bool = True,
) -> ImageData:
    """Load the training split and, if ``evaluate``, an evaluation split, as HF datasets.

    ``name`` is a hub dataset, a local dataset directory or image folder (through
    ``datasets.load_dataset``, with ``config_name``), a directory written by
    ``save_to_disk`` (a ``Dataset`` or ``DatasetDict``), or one ``.parquet``, ``.csv``
    or ``.json(l)`` file. ``None`` is the offline default: scikit-learn's 8x8 digits,
    real images that ship with the package.

    Evaluation uses ``eval_split`` ("auto": the first of test / validation / valid /
    val that exists); a labelled dataset without one gives up ``eval_holdout`` of its
    training split (0 keeps every image for training and turns evaluation off). The
    image column is returned undecoded: ``read_image`` decodes it, so that a broken
    file can be named.
    """
    splits = _load_splits(name, config_name)
    shown = name or "digits"
    if split not in splits:
        raise DataError(f"dataset {shown!r} has no split {split!r} (splits: {', '.join(splits)})")
    train = splits[split]
    columns = train.column_names
    if image_column is None:
        image_column = next((c for c in IMAGE_COLUMNS if c in columns), None)
    if image_column not in columns:
        wanted = repr(image_column) if image_column else " or ".join(map(repr, IMAGE_COLUMNS))
        raise DataError(
            f"dataset {shown!r} has no image column {wanted} "
            f"(columns: {', '.join(columns)}); pass --image-column"
        )
    if label_column is None:
        label_column = next((c for c in LABEL_COLUMNS if c in columns), None)
    elif label_column not in columns:
        raise DataError(
            f"dataset {shown!r} has no label column {label_column!r} "
            f"(columns: {', '.join(columns)})"
        )

    evaluation, source = None, "kNN evaluation: off"
    if evaluate and label_column is None:
        source = "kNN evaluation: off (the dataset has no label column; pass --label-column)"
    elif evaluate:
        candidates = EVAL_SPLITS if eval_split == "auto" else (eval_split,)
        found = next((s for s in candidates if s in splits and s != split), None)
        if eval_split != "auto" and found is None:
            raise DataError(
                f"dataset {shown!r} has no evaluation split {eval_split!r} "
                f"(splits: {', '.join(splits)})"
            )
        if found is not None:
            evaluation = splits[found]
            source = f"kNN evaluation: split {found!r} ({len(evaluation)} images)"
        elif eval_holdout > 0 and len(train) >= 2:
            # Seed 0, not --seed: the same images are held out whatever the run's seed.
            held = train.train_test_split(test_size=eval_holdout, seed=0)
            train, evaluation = held["train"], held["test"]
            source = (
                f"kNN evaluation: {len(evaluation)} images held out of split {split!r} "
                f"(--eval-holdout {eval_holdout:g}); training on the other {len(train)}"
            )
        else:
            source = (
                f"kNN evaluation: off (no evaluation split and --eval-holdout {eval_holdout:g})"
            )
        if evaluation is not None and label_column not in evaluation.column_names:
            raise DataError(f"evaluation split has no label column {label_column!r}")
    train = _undecoded(train, image_column, name)
    if evaluation is not None:
        evaluation = _undecoded(evaluation, image_column, name)
    return ImageData(train, evaluation, image_column, label_column, source)


def _load_splits(name: str | None, config_name: str | None):
    """``{split: Dataset}`` from any source ``load_image_dataset`` accepts."""
    import datasets

    if name is None:
        return {"train": _digits_dataset()}
    looks_like_path = os.sep in name or name.startswith(".") or os.path.exists(name)
    if looks_like_path and not os.path.exists(name):
        raise DataError(f"dataset path {name!r} does not exist")
    suffix = os.path.splitext(name)[1].lower()
    try:
        if os.path.isdir(name) and (
            os.path.exists(os.path.join(name, "dataset_dict.json"))
            or os.path.exists(os.path.join(name, "state.json"))
        ):
            if config_name:
                raise DataError("--dataset-config does not apply to a save_to_disk directory")
            dataset = datasets.load_from_disk(name)
        elif os.path.isfile(name):
            if suffix not in DATA_FILE_BUILDERS:
                raise DataError(
                    f"dataset file {name!r}: expected one of {', '.join(DATA_FILE_BUILDERS)}"
                )
            if config_name:
                raise DataError("--dataset-config does not apply to a single data file")
            dataset = datasets.load_dataset(DATA_FILE_BUILDERS[suffix], data_files={"train": name})
        else:
            dataset = datasets.load_dataset(name, name=config_name)
    except DataError:
        raise
    except Exception as error:  # datasets raises many types; the user needs one line
        raise DataError(f"cannot load dataset {name!r}: {_first_line(error)}") from None
    if isinstance(dataset, datasets.Dataset):
        return {"train": dataset}
    return dict(dataset)


def _undecoded(dataset, image_column: str, name: str | None):
    """The image column as ``{"bytes", "path"}`` records (file paths become records too).

    Relative paths in a single data file are taken relative to that file's folder.
    """
    import datasets

    feature = dataset.features[image_column]
    if isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string"):
        if name and os.path.isfile(name):
            folder = os.path.dirname(os.path.abspath(name))
            dataset = dataset.map(
                lambda path: {image_column: os.path.join(folder, path)},
                input_columns=image_column,
            )
        return dataset.cast_column(image_column, datasets.Image(decode=False))
    if isinstance(feature, datasets.Image) and feature.decode:
        return dataset.cast_column(image_column, datasets.Image(decode=False))
    return dataset


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


class UnreadableImage(DataError):
    """An image that cannot be decoded; the message names its dataset index and file."""


def read_image(value: Any, index: int) -> torch.Tensor:
    """One image as a 3-channel uint8 CHW tensor, whatever its mode; raises ``UnreadableImage``.

    ``value`` is an undecoded ``{"bytes", "path"}`` record, a PIL image, or an array
    (HW or HWC, with 1, 3 or 4 channels).
    """
    from PIL import Image

    source = "in memory"
    try:
        if isinstance(value, dict):
            source = value.get("path") or "embedded bytes"
            stream = io.BytesIO(value["bytes"]) if value.get("bytes") else value["path"]
            with Image.open(stream) as image:
                image.load()
                return _rgb_tensor(image)
        if isinstance(value, Image.Image):
            return _rgb_tensor(value)
        array = np.asarray(value)
        if array.ndim == 3 and array.shape[0] in (1, 3, 4) and array.shape[-1] not in (1, 3, 4):
            array = array.transpose(1, 2, 0)  # CHW -> HWC
        if array.ndim == 2:
            array = array[:, :, None]
        if array.ndim != 3 or array.shape[-1] not in (1, 3, 4):
            raise ValueError(
                f"expected an HW or HWC array with 1, 3 or 4 channels, got {array.shape}"
            )
        if array.dtype != np.uint8:
            array = _to_uint8(array)
        tensor = torch.from_numpy(np.ascontiguousarray(array)).permute(2, 0, 1)
        return tensor[:3] if tensor.shape[0] != 1 else tensor.expand(3, -1, -1).contiguous()
    except Exception as error:  # PIL raises OSError, SyntaxError, ValueError, bomb errors...
        raise UnreadableImage(
            f"image {index} ({source}) cannot be read: {_first_line(error)}"
        ) from None


def _rgb_tensor(image) -> torch.Tensor:
    if image.mode in ("I", "I;16", "I;16B", "I;16L", "F"):  # 16/32-bit and float greyscale
        from PIL import Image

        image = Image.fromarray(_to_uint8(np.asarray(image)))
    rgb = image.convert("RGB")  # palette, alpha, CMYK and 1-bit images alike
    return torch.from_numpy(np.asarray(rgb).copy()).permute(2, 0, 1)


def _to_uint8(array: np.ndarray) -> np.ndarray:
    """Integer images scaled from their type's range, float images from [0, 1]."""
    if np.issubdtype(array.dtype, np.integer):
        top = 65535 if array.max(initial=0) > 255 else 255
        return (array.astype(np.float64) * (255 / top)).round().clip(0, 255).astype(np.uint8)
    return (array.astype(np.float64) * 255).round().clip(0, 255).astype(np.uint8)


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


def _resize(image_size: int) -> v2.Transform:
    return v2.Resize((image_size, image_size), antialias=True)


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
        self.resize = _resize(image_size)
        self.augment = simclr_augmentation(image_size, crop_min_scale) if augment else v2.Identity()

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(
        self, item: tuple[int, int]
    ) -> tuple[torch.Tensor, torch.Tensor, int] | UnreadableImage:
        """Two views of sample ``index``; an unreadable image is returned, not raised, so
        that the trainer can tell every rank about it before the next collective."""
        epoch, index = item
        try:
            image = self.resize(read_image(self.dataset[index][self.image_column], index))
        except UnreadableImage as unreadable:
            # A fresh exception, without the caught one's traceback: its frames would keep
            # this dataset and its Arrow tables alive in a reference cycle until shutdown.
            return UnreadableImage(str(unreadable))
        if not self.per_sample_seed:
            return NORMALIZE(self.augment(image)), NORMALIZE(self.augment(image)), index
        # Reseed the CPU generator that torchvision draws from, and restore it so the
        # caller's stream (e.g. dropout when num_workers=0) is untouched. Not
        # torch.manual_seed: it also seeds every accelerator backend, ~100x slower.
        generator = torch.default_generator
        caller_state = generator.get_state()
        generator.manual_seed(derive_seed(self.seed, _AUGMENT_STREAM, epoch, index))
        try:
            return NORMALIZE(self.augment(image)), NORMALIZE(self.augment(image)), index
        finally:
            generator.set_state(caller_state)

    def collate(self, items: list) -> TwoViewBatch:
        """Stack the readable items' views and dataset indices; an empty share (short last
        batch on many ranks) gives empty tensors. Unreadable images are left out and
        listed in ``unreadable``."""
        unreadable = [item for item in items if isinstance(item, UnreadableImage)]
        views = [item for item in items if not isinstance(item, UnreadableImage)]
        if not views:
            empty = torch.empty(0, 3, self.image_size, self.image_size)
            return TwoViewBatch(empty, empty.clone(), torch.empty(0, dtype=torch.long), unreadable)
        first, second, indices = zip(*views, strict=True)
        return TwoViewBatch(
            torch.stack(first), torch.stack(second), torch.tensor(indices), unreadable
        )


class TwoViewBatch(NamedTuple):
    view0: torch.Tensor
    view1: torch.Tensor
    indices: torch.Tensor  # each sample's index in the dataset
    unreadable: list[UnreadableImage]


def label_ids(dataset, label_column: str) -> torch.Tensor:
    """Every sample's label as an integer class id (string labels are numbered in sorted order)."""
    labels = dataset[label_column]
    if all(isinstance(label, int) and not isinstance(label, bool) for label in labels):
        return torch.tensor(labels, dtype=torch.long)
    classes = {label: i for i, label in enumerate(sorted(set(map(str, labels))))}
    return torch.tensor([classes[str(label)] for label in labels], dtype=torch.long)


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

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Continue with ``epoch`` from its batch ``start_batch``: one DataLoader, and its
        persistent workers, serve every epoch (items carry their epoch)."""
        self.epoch, self.start_batch = epoch, start_batch

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


def evaluation_images(
    dataset,
    image_column: str,
    image_size: int,
    skip_unreadable: bool = False,
    indices: list[int] | None = None,
) -> tuple[torch.Tensor | None, list[int]]:
    """The images of ``dataset`` (or of its rows ``indices``), resized and normalised, as
    one tensor, and the dataset indices they came from. An unreadable image raises
    ``UnreadableImage`` naming its dataset index, or is left out with a warning when
    ``skip_unreadable``. ``(None, [])`` when none is readable."""
    indices = list(range(len(dataset))) if indices is None else indices
    resize, images, kept = _resize(image_size), [], []
    for index, row in zip(indices, dataset.select(indices), strict=True):
        try:
            images.append(NORMALIZE(resize(read_image(row[image_column], index))))
            kept.append(index)
        except UnreadableImage as unreadable:
            if not skip_unreadable:
                raise
            warnings.warn(f"skipping {unreadable} (--skip-bad-images)", stacklevel=2)
    if not images:
        return None, []
    return torch.stack(images), kept
