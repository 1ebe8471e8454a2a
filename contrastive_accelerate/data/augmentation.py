"""Augmentation: each sample's random views drawn from (seed, epoch, index) alone.

``TwoViews`` seeds the augmentation of sample i from (seed, epoch, i), so its crops
depend neither on the rank, nor on the dataloader worker, nor on the worker count.
``MultiCrop`` does the same for DINO's global and local crops, drawn in crop order.
Items are ``(epoch, index)`` pairs: the dataset needs no mutable epoch state, and
persistent workers stay correct.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate
from typing import NamedTuple, TypeVar

import torch
from torchvision.transforms import v2

from contrastive_accelerate.config import option
from contrastive_accelerate.data.decoding import NORMALIZE, UnreadableImage, read_image, resize_to
from contrastive_accelerate.data.masks import PatchMasking
from contrastive_accelerate.data.sampler import AUGMENT_STREAM, derive_seed

T = TypeVar("T")


def crop_and_flip(
    image_size: int, crop_min_scale: float, crop_max_scale: float, horizontal_flip: bool
) -> list[v2.Transform]:
    """Where every augmentation's view starts: a random crop of (min, max) of the area
    resized to ``image_size``, then a horizontal flip unless ``horizontal_flip`` is off."""
    return [
        v2.RandomResizedCrop(image_size, scale=(crop_min_scale, crop_max_scale), antialias=True),
        *([v2.RandomHorizontalFlip()] if horizontal_flip else []),
    ]


class ColorJitter(v2.ColorJitter):
    """torchvision's ``ColorJitter``, its draws the same and in the same order, but a grey
    image's hue is left as it is: rotating the hue of a pixel whose channels are equal
    gives it back exactly (its HSV saturation is 0; 0 of 1,000 digits differ), and the
    HSV round trip of each view was nine tenths of the jitter's time on the 8-px digits.
    Brightness, contrast and saturation keep a grey image grey, whatever their order."""

    def transform(self, inpt, params: dict):
        if params["hue_factor"] is not None and bool((inpt[..., :1, :, :] == inpt).all()):
            params = {**params, "hue_factor": None}
        return super().transform(inpt, params)


def simclr_augmentation(
    image_size: int,
    crop_min_scale: float = 0.2,
    crop_max_scale: float = 1.0,
    horizontal_flip: bool = True,
) -> v2.Transform:
    """SimCLR's augmentation (Chen et al., 2020, appendix A), sized for ``image_size``.

    Gaussian blur is used from 64 px up, with a kernel of about 10% of the image,
    as in the paper; for CIFAR-sized images the paper leaves it out. Without
    ``horizontal_flip`` for images whose mirror image is another class (digits).
    """
    transforms = [
        *crop_and_flip(image_size, crop_min_scale, crop_max_scale, horizontal_flip),
        v2.RandomApply([ColorJitter(0.4, 0.4, 0.4, 0.1)], p=0.8),
        v2.RandomGrayscale(p=0.2),
    ]
    if image_size >= 64:
        kernel = int(0.1 * image_size) // 2 * 2 + 1
        transforms.append(v2.RandomApply([v2.GaussianBlur(kernel, sigma=(0.1, 2.0))], p=0.5))
    return v2.Compose(transforms)


def affine_augmentation(
    image_size: int,
    crop_min_scale: float = 0.2,
    crop_max_scale: float = 1.0,
    horizontal_flip: bool = True,
) -> v2.Transform:
    """Views that keep a glyph (a digit, a letter) what it is: a crop at scales
    (``crop_min_scale``, ``crop_max_scale``), a small affine warp (turns of up to 10
    degrees, shifts of up to an eighth of the image, zooms of 10%, bilinear), and
    brightness and contrast jitter (0.4, with probability 0.8).

    SimCLR's hue, saturation and greyscale have nothing to change on grey images, and
    its crops alone cannot turn or shift a stroke by less than a pixel; on the 8x8
    digits it is one axis of the default recipe's search (docs/benchmarks.md).
    """
    transforms = [
        *crop_and_flip(image_size, crop_min_scale, crop_max_scale, horizontal_flip),
        v2.RandomAffine(
            degrees=10,
            translate=(0.125, 0.125),
            scale=(0.9, 1.1),
            interpolation=v2.InterpolationMode.BILINEAR,
        ),
        v2.RandomApply([v2.ColorJitter(brightness=0.4, contrast=0.4)], p=0.8),
    ]
    return v2.Compose(transforms)


#: ``--augmentation``'s choices: each builds a view's transform from (image size, smallest
#: and largest crop scale, flips).
AUGMENTATIONS: dict[str, Callable[[int, float, float, bool], v2.Transform]] = {
    "simclr": simclr_augmentation,
    "affine": affine_augmentation,
}


@dataclass
class ImageOptions:
    """What only images read (their size, their views' draws, unreadable ones): a
    section of ``TrainConfig`` (``contrastive_accelerate.options``)."""

    image_size: int | None = option(None, "none: 8 for the digits, else 32", at_least=1)
    augment: bool = option(True, "random views (--augmentation's); off: the image twice")
    augmentation: str = option(
        "simclr", "the views: simclr's crops and colours, or affine: crops, turns, shifts, zooms",
        choices=AUGMENTATIONS,
    )  # fmt: skip
    crop_min_scale: float | None = option(
        None, "smallest crop area fraction; none: 0.5 for the 8x8 digits, else 0.2",
        above=0.0, at_most=1.0,
    )  # fmt: skip
    horizontal_flip: bool | None = option(
        None, "horizontal flips; none: off for the digits (not mirror-symmetric), else on"
    )
    skip_bad_images: bool = option(False, "skip unreadable images instead of stopping")
    eval_dataset: str | None = option(
        None, "kNN and probe on this labelled table (its evaluation split); none: --dataset's",
        resume="free",
    )  # fmt: skip


def drawn_for_sample(draw: Callable[[], T], seed: int, epoch: int, index: int) -> T:
    """``draw()`` with torchvision's random draws seeded from (seed, epoch, index).

    Reseeds the CPU generator that torchvision draws from, and restores it so the
    caller's stream (e.g. dropout when num_workers=0) is untouched. Not
    ``torch.manual_seed``: it also seeds every accelerator backend, ~100x slower.
    """
    generator = torch.default_generator
    caller_state = generator.get_state()
    generator.manual_seed(derive_seed(seed, AUGMENT_STREAM, epoch, index))
    try:
        return draw()
    finally:
        generator.set_state(caller_state)


class SampleImages:
    """Reads a row's image, resizes it to ``image_size`` and runs ``draw`` on it with its
    random draws from (seed, epoch, index) (``per_sample_seed``), or from the process's
    RNG as most pipelines draw (the control). The reader of ``TwoViews``, ``MultiCrop``
    and ``ImageCaptions``."""

    def __init__(self, image_size: int, seed: int, per_sample_seed: bool = True) -> None:
        self.resize, self.seed, self.per_sample_seed = resize_to(image_size), seed, per_sample_seed

    def __call__(
        self, source, epoch: int, index: int, draw: Callable[[torch.Tensor], T]
    ) -> T | UnreadableImage:
        """``draw(image)``; an unreadable image is returned, not raised, so that the trainer
        can tell every rank about it before the next collective."""
        try:
            image = self.resize(read_image(source, index))
        except UnreadableImage as unreadable:
            # A fresh exception, without the caught one's traceback: its frames would keep
            # the dataset and its Arrow tables alive in a reference cycle until shutdown.
            return UnreadableImage(str(unreadable))
        if not self.per_sample_seed:
            return draw(image)
        return drawn_for_sample(lambda: draw(image), self.seed, epoch, index)


def view_augmentation(
    image_size: int,
    augment: bool,
    crop_min_scale: float,
    horizontal_flip: bool,
    augmentation: str = "simclr",
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The views' augmentation (a row of ``AUGMENTATIONS``), or with ``augment`` off none."""
    if not augment:
        return v2.Identity()
    return AUGMENTATIONS[augmentation](image_size, crop_min_scale, 1.0, horizontal_flip)


def missing_image(row: dict, image_column: str) -> str | None:
    """Why a stream's ``row`` holds no sample of images (a ``BadRow``), naming where it
    came from; None if it holds one."""
    if image_column not in row:
        return f"{row.get('__source__', 'a row')}: no column {image_column!r}"
    return None


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
        horizontal_flip: bool = True,
        augmentation: str = "simclr",
    ) -> None:
        self.dataset, self.image_column, self.image_size = dataset, image_column, image_size
        self.images = SampleImages(image_size, seed, per_sample_seed)
        self.augment = view_augmentation(
            image_size, augment, crop_min_scale, horizontal_flip, augmentation
        )

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(
        self, item: tuple[int, int]
    ) -> tuple[torch.Tensor, torch.Tensor, int] | UnreadableImage:
        """Two views of sample ``index`` (or the unreadable image: see ``SampleImages``)."""
        epoch, index = item
        return self.item(self.dataset[index], epoch, index)

    def problem(self, row: dict) -> str | None:
        """Why a stream's ``row`` cannot be a sample: no image column."""
        return missing_image(row, self.image_column)

    def item(self, row: dict, epoch: int, index: int):
        """Sample ``(epoch, index)``'s two views from its ``row``: of a table or a stream."""

        def draw(image):
            return NORMALIZE(self.augment(image)), NORMALIZE(self.augment(image)), index

        return self.images(row[self.image_column], epoch, index, draw)

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
    """A rank's share of a global batch: both views of each readable sample."""

    view0: torch.Tensor
    view1: torch.Tensor
    indices: torch.Tensor  # each sample's index in the dataset
    unreadable: list[UnreadableImage]

    def split(self, chunks: int) -> list[TwoViewBatch]:
        """Always ``chunks`` pieces (``tensor_split``), empty ones where the share is short,
        so that every rank runs the same collectives."""
        pieces = (tensor.tensor_split(chunks) for tensor in (self.view0, self.view1, self.indices))
        return [TwoViewBatch(*piece, []) for piece in zip(*pieces, strict=True)]


#: DINO's smallest local crop, as a fraction of the image's area.
LOCAL_CROP_MIN_SCALE = 0.05


class MultiCrop(torch.utils.data.Dataset):
    """DINO's multi-crop (Caron et al., 2020 and 2021): ``global_crops`` views of
    ``image_size`` at scales (``crop_min_scale``, 1) and ``local_crops`` views of
    ``local_crop_size`` at (0.05, ``crop_min_scale``), the rest of ``augmentation``'s
    transforms on each (SimCLR's colour augmentation by default). Items are ``(epoch,
    index)`` pairs; with ``per_sample_seed`` every crop is drawn from (seed, epoch, index)
    in crop order, as ``TwoViews`` draws its two views. With ``masking`` each global crop
    has a patch mask too (iBOT's, ``data.masks``), drawn from (seed, epoch, index, crop),
    or from the process's RNG without ``per_sample_seed``.
    """

    def __init__(
        self,
        dataset,
        image_column: str,
        image_size: int,
        seed: int,
        global_crops: int,
        local_crops: int,
        local_crop_size: int,
        per_sample_seed: bool = True,
        crop_min_scale: float = 0.4,
        horizontal_flip: bool = True,
        augmentation: str = "simclr",
        masking: PatchMasking | None = None,
    ) -> None:
        self.dataset, self.image_column = dataset, image_column
        self.image_size, self.local_crop_size = image_size, local_crop_size
        self.images = SampleImages(image_size, seed, per_sample_seed)
        self.masking, self.seed, self.per_sample_seed = masking, seed, per_sample_seed
        self.global_crops, self.local_crops = global_crops, local_crops
        views = AUGMENTATIONS[augmentation]
        self.global_augment = views(image_size, crop_min_scale, 1.0, horizontal_flip)
        self.local_augment = views(
            local_crop_size, LOCAL_CROP_MIN_SCALE, crop_min_scale, horizontal_flip
        )

    def __len__(self) -> int:
        return len(self.dataset)

    def _crops(self, image, epoch: int, index: int) -> tuple:
        """The global crops, the local ones, the global crops' masks and their counts
        (None without ``masking``), the index."""
        global_crops = [NORMALIZE(self.global_augment(image)) for _ in range(self.global_crops)]
        local_crops = [NORMALIZE(self.local_augment(image)) for _ in range(self.local_crops)]
        masks = None
        if self.masking is not None:  # the control draws its seed from the process's RNG
            seed = self.seed if self.per_sample_seed else int(torch.randint(2**62, ()))
            masks = self.masking.draw(seed, epoch, index, self.global_crops)
        return global_crops, local_crops, masks, index

    def __getitem__(self, item: tuple[int, int]):
        epoch, index = item
        return self.item(self.dataset[index], epoch, index)

    def problem(self, row: dict) -> str | None:
        """Why a stream's ``row`` cannot be a sample: no image column."""
        return missing_image(row, self.image_column)

    def item(self, row: dict, epoch: int, index: int):
        """Sample ``(epoch, index)``'s crops from its ``row``: of a table or a stream."""
        source = row[self.image_column]
        return self.images(source, epoch, index, lambda image: self._crops(image, epoch, index))

    def collate(self, items: list) -> MultiCropBatch:
        """Crops stacked per crop, ``(crops, n, C, H, W)`` per resolution; unreadable images
        left out and listed, an empty share gives empty tensors (see ``TwoViews.collate``)."""
        unreadable = [item for item in items if isinstance(item, UnreadableImage)]
        samples = [item for item in items if not isinstance(item, UnreadableImage)]

        def stacked(crops: list[list[torch.Tensor]], count: int, size: int) -> torch.Tensor:
            if not samples:
                return torch.empty(count, 0, 3, size, size)
            return torch.stack([torch.stack(per_crop) for per_crop in zip(*crops, strict=True)])

        masks, masked = None, ()
        if self.masking is not None:  # (global crops, n, patches); counts per crop and sample
            patches = self.masking.grid[0] * self.masking.grid[1]
            drawn = [sample[2] for sample in samples]
            masks = (torch.stack([m for m, _ in drawn], dim=1) if drawn
                     else torch.zeros(self.global_crops, 0, patches, dtype=torch.bool))  # fmt: skip
            masked = tuple(zip(*(counts for _, counts in drawn), strict=True)) or (
                ((),) * self.global_crops
            )
        if not samples:
            indices = torch.empty(0, dtype=torch.long)
            global_crops = stacked([], self.global_crops, self.image_size)
            local_crops = stacked([], self.local_crops, self.local_crop_size)
            return MultiCropBatch(global_crops, local_crops, indices, unreadable, masks, masked)
        global_crops, local_crops, _, indices = zip(*samples, strict=True)
        return MultiCropBatch(
            stacked(list(global_crops), self.global_crops, self.image_size),
            stacked(list(local_crops), self.local_crops, self.local_crop_size)
            if self.local_crops
            else torch.empty(0, len(samples), 3, self.local_crop_size, self.local_crop_size),
            torch.tensor(indices),
            unreadable,
            masks,
            masked,
        )


class MultiCropBatch(NamedTuple):
    """A rank's share of a global batch: every crop of each readable sample, per resolution,
    and with ``MultiCrop``'s ``masking`` the global crops' patch masks."""

    global_crops: torch.Tensor  # (global crops, n, C, H, W)
    local_crops: torch.Tensor  # (local crops, n, C, h, w)
    indices: torch.Tensor
    unreadable: list[UnreadableImage]
    masks: torch.Tensor | None = None  # (global crops, n, patches) boolean
    #: Each global crop's count of masked patches per sample, host integers: the step
    #: selects the masked patches without reading a count from the device.
    masked: tuple[tuple[int, ...], ...] = ()

    def split(self, chunks: int) -> list[MultiCropBatch]:
        """``chunks`` pieces along the samples (see ``TwoViewBatch.split``)."""
        indices = self.indices.tensor_split(chunks)
        ends = list(accumulate((len(piece) for piece in indices), initial=0))
        return [
            MultiCropBatch(
                global_crops,
                local_crops,
                piece,
                [],
                None if self.masks is None else self.masks[:, start:end],
                tuple(counts[start:end] for counts in self.masked),
            )
            for global_crops, local_crops, piece, start, end in zip(
                self.global_crops.tensor_split(chunks, dim=1),
                self.local_crops.tensor_split(chunks, dim=1),
                indices,
                ends[:-1],
                ends[1:],
                strict=True,
            )
        ]
