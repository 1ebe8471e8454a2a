"""Decoding: any stored image (bytes, path, PIL image, array) as a 3-channel uint8 tensor.

An image that cannot be read raises ``UnreadableImage`` naming its dataset index and
file, which the trainer reports on every rank (or skips, with ``--skip-bad-images``).
"""

from __future__ import annotations

import io
import warnings
from typing import Any

import numpy as np
import torch
from torchvision.transforms import v2

from contrastive_accelerate.data.sources import DataError, first_line


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
            f"image {index} ({source}) cannot be read: {first_line(error)}"
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


def resize_to(image_size: int) -> v2.Transform:
    return v2.Resize((image_size, image_size), antialias=True)


NORMALIZE = v2.Compose([v2.ToDtype(torch.float32, scale=True), v2.Normalize([0.5] * 3, [0.5] * 3)])


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
    resize, images, kept = resize_to(image_size), [], []
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
