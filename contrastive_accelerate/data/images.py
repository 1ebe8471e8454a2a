"""The image methods' data from every kind of source: a table
(``sources.load_image_dataset``), streamed shards (``load_streamed_images``: a webdataset
tar of images, a parquet of image bytes, hub streaming) or a mixture of them
(``load_image_mixture``), each an ``ImageData`` or a ``MixedImages`` that the methods'
datasets (``augmentation.TwoViews``, ``augmentation.MultiCrop``) read by the global
sample id ``(epoch, index)``: the same draws on any number of processes.

    data = load_streamed_images("shards/", image_column=None, streams=None, shuffle_buffer=64)
    data.image_column                   # 'png': a webdataset tar's image member
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from contrastive_accelerate.data.mixture import MixedSources, Mixture
from contrastive_accelerate.data.sources import (
    IMAGE_COLUMNS,
    DataError,
    ImageData,
    is_image,
    is_table,
    load_image_dataset,
)
from contrastive_accelerate.data.streams import find_shards

#: What a stream evaluates on: nothing, it has no held-out rows.
STREAM_EVALUATION = "evaluation: off (a stream has no held-out rows)"


def load_streamed_images(
    dataset: str, *, image_column: str | None, streams: int | None, shuffle_buffer: int,
    config_name: str | None = None, split: str = "train",
) -> ImageData:  # fmt: skip
    """The shards of ``dataset`` as streams of images (``streams.find_shards``). The
    image column is ``image_column``, else the first of ``IMAGE_COLUMNS``, else the
    first image of the first shard's first row (a webdataset tar's ``png`` or ``jpg``
    member). A row without it is a bad row (``--skip-bad-rows``). No labels, no
    evaluation: a stream has no held-out rows."""
    source = find_shards(dataset, streams, shuffle_buffer, config_name=config_name, split=split)
    first = source.first_rows(1)
    if not first:
        raise DataError(f"the first shard {source.shards[0]!r} holds no readable rows")
    row = first[0]
    columns = [name for name in row if not name.startswith("__")]
    column = image_column or next((c for c in IMAGE_COLUMNS if c in row), None)
    column = column or next((c for c in columns if is_image(row[c])), None)
    if column not in row:
        wanted = repr(image_column) if image_column else "holding an image"
        raise DataError(
            f"{row['__source__']}: no column {wanted} (columns: {', '.join(columns)}); "
            "pass --image-column"
        )
    return ImageData(source, None, column, None, STREAM_EVALUATION)


@dataclass
class MixedImages(MixedSources):
    """A mixture's sources of images (each an ``ImageData``: a table or a stream, with
    its own image column)."""

    evaluation_source: str = "evaluation: off (a mixture has no held-out rows)"

    @property
    def image_column(self) -> str:
        """The first source's image column (each source reads its own)."""
        return self.sources[0].image_column


def load_image_mixture(
    names: Sequence[str], *, image_column: str | None, streaming: bool, streams: int | None,
    shuffle_buffer: int, mixture: str, weights: list[float] | None, temperature: float,
) -> MixedImages:  # fmt: skip
    """Each of ``names``: with ``streaming`` a stream (``load_streamed_images``) unless it
    is a table (a data file or a ``save_to_disk`` directory), else a table without
    evaluation; ``mixture`` "round-robin" or "proportional" to ``weights`` or to the
    tables' rows (``mixture.mixture_weights``)."""
    sources = []
    for name in names:
        if streaming and not is_table(name):
            sources.append(load_streamed_images(name, image_column=image_column, streams=streams,
                                                shuffle_buffer=shuffle_buffer))  # fmt: skip
        else:
            sources.append(load_image_dataset(name, image_column=image_column, evaluate=False))
    return MixedImages.of(sources, names, mixture, weights, temperature)


def per_source(data: ImageData | MixedImages, dataset: Callable[[Any, str], Any]) -> Any:
    """``dataset(rows, image_column)`` of ``data``'s training rows, or for a mixture a
    ``Mixture`` of one per source, each with its own image column."""
    if isinstance(data, MixedImages):
        return Mixture([dataset(source.train, source.image_column) for source in data.sources],
                       data.names, data.weights)  # fmt: skip
    return dataset(data.train, data.image_column)
