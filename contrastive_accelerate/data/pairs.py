"""Pairs named by columns: text-text (an anchor, its positive, any hard negatives) or
image-text (an image and its caption, or one of its captions).

``load_pair_dataset`` finds each column's kind from the dataset (an ``Image`` feature or
``--image-column`` paths: the image tower; strings or lists of strings: the text tower)
and checks them. ``TextColumns`` and ``ImageCaptions`` tokenize in the loader's workers,
deterministically, and ``collate`` pads each text column to this rank's longest text
with its attention mask, which keeps the padding out of the result.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from contrastive_accelerate.data.augmentation import SampleImages, view_augmentation
from contrastive_accelerate.data.decoding import NORMALIZE, UnreadableImage
from contrastive_accelerate.data.mixture import MixedSources
from contrastive_accelerate.data.sampler import derive_seed
from contrastive_accelerate.data.sources import (
    DataError,
    ImageData,
    evaluation_split,
    is_image,
    is_table,
    load_image_dataset,
    load_splits,
)
from contrastive_accelerate.untrusted import preview

# The tokenizer is used before the loader forks its workers (the truncation count):
# its thread pool must not be inherited half-initialised.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


CAPTION_STREAM = 2
#: The offline digits' captions, made from each label (``--columns image,caption``).
DIGIT_CAPTIONS = ("a handwritten {}", "the digit {}", "a {} written by hand")


@dataclass
class PairData:
    """What ``load_pair_dataset`` found: the training split and its columns; for
    image-text also the image and label columns and the evaluation split."""

    train: Any
    columns: tuple[str, ...]
    image_column: str | None = None  # image-text: which of ``columns`` is the image
    label_column: str | None = None
    evaluation: Any | None = None
    evaluation_source: str = "retrieval evaluation: off"

    @property
    def streamed(self) -> bool:
        """Whether ``train`` is shards read as streams (``data.streams.ShardStreams``)."""
        from contrastive_accelerate.data.streams import ShardStreams

        return isinstance(self.train, ShardStreams)

    @property
    def text_columns(self) -> tuple[str, ...]:
        return tuple(column for column in self.columns if column != self.image_column)


def split_columns(value: str) -> tuple[str, ...]:
    """``--columns a,b,c`` as its names."""
    return tuple(column.strip() for column in value.split(","))


def load_pair_dataset(
    name: str | None, columns: tuple[str, ...], *, config_name: str | None = None,
    split: str = "train", image_column: str | None = None, label_column: str | None = None,
    eval_split: str = "auto", eval_holdout: float = 0.2, evaluate: bool = True,
) -> PairData:  # fmt: skip
    """The ``split`` of dataset ``name`` (any source ``load_image_dataset`` takes), with
    ``columns`` checked: at least two, present, each the image tower's (an ``Image``
    feature, or ``image_column``'s paths) or the text tower's (strings, or lists of
    strings: one drawn per (seed, epoch, index)). One image column makes it image-text,
    loaded by ``load_image_dataset`` (labels, evaluation split); ``name`` None is then
    the offline digits with captions made from their labels. With ``evaluate``, the
    evaluation split is found or held out as ``load_image_dataset`` does."""
    evaluation_options = {"eval_split": eval_split, "eval_holdout": eval_holdout,
                          "evaluate": evaluate, "label_column": label_column}  # fmt: skip
    if len(columns) < 2:
        raise DataError(
            f"--columns {','.join(columns)}: give at least two (anchor,positive[,negative...])"
        )
    if len(set(columns)) != len(columns):
        raise DataError(f"--columns {','.join(columns)} names a column twice")
    if name is None:
        return _digits_with_captions(columns, evaluation_options)
    splits = load_splits(name, config_name)
    if split not in splits:
        raise DataError(f"dataset {name!r} has no split {split!r} (splits: {', '.join(splits)})")
    train = splits[split]
    kinds = {column: _kind(train, column, image_column, name) for column in columns}
    images = [column for column, kind in kinds.items() if kind == "image"]
    texts = [column for column, kind in kinds.items() if kind == "text"]
    check_texts(train, texts, split)  # before a hold-out renumbers the rows
    if not images:
        train = train.select_columns(list(columns))
        evaluation, held_out = None, "off"
        if evaluate:
            train, evaluation, held_out = evaluation_split(
                splits, split, train, eval_split, eval_holdout, name, "pairs"
            )
        if evaluation is not None:
            evaluation = evaluation.select_columns(list(columns))
            check_texts(evaluation, texts, "evaluation")
        source = f"retrieval evaluation (MRR@10, recall@k): {held_out}"
        return PairData(train, tuple(columns), evaluation=evaluation, evaluation_source=source)
    if len(images) > 1 or len(columns) != 2:
        raise DataError(
            f"--columns {','.join(columns)}: image-text pairs are one image column and one "
            f"text column (image columns: {', '.join(images)})"
        )
    data = load_image_dataset(
        name, config_name=config_name, split=split, image_column=images[0], **evaluation_options
    )
    if data.evaluation is not None:
        check_texts(data.evaluation, texts, "evaluation")
    return _image_text(data, columns)


def load_streamed_pairs(
    dataset: str, columns: tuple[str, ...], streams: int | None, shuffle_buffer: int,
    *, config_name: str | None = None, split: str = "train",
) -> PairData:  # fmt: skip
    """The shards of ``dataset`` as streams (``data.streams.find_shards``), ``columns``
    checked on the first shard's first row: each an image (a tar's image member, a
    ``{"bytes", "path"}`` record, a PIL image) or a text (a string, or a list of
    strings). No evaluation split: a stream has no held-out rows."""
    from contrastive_accelerate.data.streams import find_shards

    if len(columns) < 2 or len(set(columns)) != len(columns):
        raise DataError(f"--columns {','.join(columns)}: give two or more different columns")
    source = find_shards(dataset, streams, shuffle_buffer, config_name=config_name, split=split)
    first = source.first_rows(1)
    if not first:
        raise DataError(f"the first shard {source.shards[0]!r} holds no readable rows")
    row = first[0]
    missing = [column for column in columns if column not in row]
    if missing:
        found = ", ".join(name for name in row if not name.startswith("__"))
        raise DataError(f"{row['__source__']}: no column {missing[0]!r} (columns: {found})")
    images = [column for column in columns if is_image(row[column])]
    for column in columns:
        if column not in images and (problem := row_problem(row, [column])):
            raise DataError(problem)
    if images and (len(images) > 1 or len(columns) != 2):
        raise DataError(
            f"--columns {','.join(columns)}: image-text pairs are one image column and one "
            f"text column (image columns: {', '.join(images)})"
        )
    return PairData(
        source, columns, images[0] if images else None,
        evaluation_source="evaluation: off (a stream has no held-out rows)",
    )  # fmt: skip


@dataclass
class MixedPairs(MixedSources):
    """A mixture's sources of pairs (each ``PairData`` with its own columns; all text
    pairs or all image-text)."""

    evaluation_source: str = "retrieval evaluation: off (a mixture has no held-out rows)"

    @property
    def columns(self) -> tuple[str, ...]:
        """Every source's columns, in order."""
        return tuple(dict.fromkeys(c for source in self.sources for c in source.columns))

    @property
    def image_column(self) -> str | None:
        """The first source's image column (image-text; each source reads its own), or
        None (text pairs): every source is of one kind (``load_mixture``)."""
        return self.sources[0].image_column

    @property
    def text_columns(self) -> tuple[str, ...]:
        """Every source's text columns, in order."""
        return tuple(dict.fromkeys(c for source in self.sources for c in source.text_columns))

    @property
    def streamed(self) -> bool:
        return any(source.streamed for source in self.sources)


def load_mixture(
    names: tuple[str, ...], columns: list[tuple[str, ...]], *, streaming: bool,
    streams: int | None, shuffle_buffer: int, mixture: str, weights: list[float] | None,
    temperature: float,
) -> MixedPairs:  # fmt: skip
    """Each of ``names`` with its ``columns``: with ``streaming`` a stream
    (``load_streamed_pairs``) unless it is a table (a data file or a ``save_to_disk``
    directory), else a table; all text pairs or all image-text. ``mixture`` "round-robin"
    or "proportional" to ``weights`` or to the tables' rows (``mixture_weights``)."""
    sources = []
    for name, source_columns in zip(names, columns, strict=True):
        if streaming and not is_table(name):
            data = load_streamed_pairs(name, source_columns, streams, shuffle_buffer)
        else:
            data = load_pair_dataset(name, source_columns, evaluate=False)
        sources.append(data)
    with_images = [name for name, data in zip(names, sources, strict=True) if data.image_column]
    if with_images and len(with_images) < len(names):
        without = next(name for name in names if name not in with_images)
        raise DataError(
            f"a mixture is all text pairs or all image-text: --dataset {with_images[0]!r} has "
            f"images, {without!r} none"
        )
    return MixedPairs.of(sources, names, mixture, weights, temperature)


def row_problem(
    row: dict, text_columns: Sequence[str], image_column: str | None = None
) -> str | None:
    """Why a stream's ``row`` cannot be a sample (a column missing, a text column that is
    neither a text nor a non-empty list of texts), naming where it came from; None if it
    can."""
    for column in (*([image_column] if image_column else []), *text_columns):
        if column not in row:
            return f"{row['__source__']}: no column {column!r}"
    for column in text_columns:
        value = row[column]
        texts = [value] if isinstance(value, str) else value
        if not (isinstance(texts, list) and texts and all(isinstance(t, str) for t in texts)):
            return (
                f"{row['__source__']}: column {column!r} holds {preview(value)}, neither a text "
                "nor a non-empty list of texts"
            )
    return None


def training_texts(data: PairData, columns: Sequence[str]) -> list[str]:
    """Every text of ``columns`` in the training split, each of a row's list; of a
    stream, those of its first shard: what start-up can read (a scratch tower's
    vocabulary, the truncation notice)."""
    if isinstance(data, MixedPairs):
        return [text for source in data.sources
                for text in training_texts(source, source.text_columns)]  # fmt: skip
    if data.streamed:
        rows = data.train.first_rows()
        values = [
            row[column] for row in rows for column in columns if not row_problem(row, [column])
        ]
    else:
        values = [value for column in columns for value in data.train[column]]
    return [text for value in values for text in ([value] if isinstance(value, str) else value)]


def check_texts(dataset, columns: Sequence[str], split: str) -> None:
    """A one-line ``DataError`` for the first cell of ``columns`` that is neither a text
    nor a non-empty list of texts (a JSON null, an empty CSV cell, ``[]``), naming its
    column, row (the dataset's own numbering) and value."""
    for column in columns:
        for row, value in enumerate(dataset[column]):
            texts = [value] if isinstance(value, str) else value
            if not (isinstance(texts, list) and texts and all(isinstance(t, str) for t in texts)):
                raise DataError(
                    f"column {column!r}, row {row} of split {split!r}: {preview(value)} is "
                    "neither a text nor a non-empty list of texts"
                )


def _kind(train, column: str, image_column: str | None, name: str) -> str:
    """ "image" or "text", from the column's feature; a one-line error for anything else."""
    import datasets

    if column not in train.column_names:
        found = ", ".join(train.column_names)
        raise DataError(f"dataset {name!r} has no column {column!r} (columns: {found})")
    feature = train.features[column]
    if isinstance(feature, datasets.Image) or column == image_column:
        return "image"
    if isinstance(feature, (datasets.Sequence, datasets.List)):
        feature = feature.feature
    if getattr(feature, "dtype", None) in ("string", "large_string"):
        return "text"
    kind = feature.dtype if hasattr(feature, "dtype") else type(feature).__name__
    raise DataError(
        f"--columns: column {column!r} holds {kind}: neither text (strings) nor images "
        "(an Image feature, or paths named by --image-column)"
    )


def _image_text(data: ImageData, columns: tuple[str, ...]) -> PairData:
    source = data.evaluation_source.replace(
        "kNN evaluation", "kNN, zero-shot and retrieval evaluation"
    )
    return PairData(
        data.train, columns, data.image_column, data.label_column, data.evaluation, source
    )


def _digits_with_captions(columns: tuple[str, ...], image_options: dict) -> PairData:
    if columns != ("image", "caption"):
        raise DataError(
            f"--columns {','.join(columns)}: the offline digits have the columns image,caption; "
            "pass --dataset for others"
        )
    data = load_image_dataset(None, **image_options)

    def with_captions(split):
        names = split.features["label"].names
        captions = [[t.format(names[label]) for t in DIGIT_CAPTIONS] for label in split["label"]]
        return split.add_column("caption", captions)

    data.train = with_captions(data.train)
    if data.evaluation is not None:
        data.evaluation = with_captions(data.evaluation)
    return _image_text(data, columns)


def count_truncated(texts: list[str], tokenizer, max_length: int) -> tuple[int, int]:
    """How many of ``texts`` have more than ``max_length`` tokens, special tokens
    included, and how many texts there are."""
    lengths = tokenizer(texts, truncation=False, add_special_tokens=True)["input_ids"]
    return sum(len(ids) > max_length for ids in lengths), len(texts)


def text_keys(dataset, columns: Sequence[str]) -> list[tuple[int, ...]]:
    """Each row's texts (every column, every caption of a list) as integer ids, equal
    for equal texts: what ``GlobalBatchSampler(duplicate_keys=...)`` keeps apart."""
    ids: dict[str, int] = {}
    rows = zip(*(dataset[column] for column in columns), strict=True)
    return [
        tuple(ids.setdefault(text, len(ids)) for value in row
              for text in ([value] if isinstance(value, str) else value))
        for row in rows
    ]  # fmt: skip


def text_identity(text: str) -> int:
    """A text as a signed 64-bit integer, equal for equal texts on every process and
    every run (8 bytes of BLAKE2b: a collision is a 2**-64 event per pair)."""
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


class PairBatch(NamedTuple):
    """A rank's share of a global batch: each column's token ids and attention mask, and
    each column's texts as ``text_identity`` (``identities[column, row]``; None for an
    image-text batch's captions), without their prompts."""

    columns: list[tuple[torch.Tensor, torch.Tensor]]
    indices: torch.Tensor  # each row's index in the dataset
    unreadable: list  # texts are always readable: kept for the loop's image checks
    identities: torch.Tensor | None = None

    def split(self, chunks: int) -> list[PairBatch]:
        """Always ``chunks`` pieces (``tensor_split``), empty ones where the share is short."""
        parts = [
            list(zip(ids.tensor_split(chunks), mask.tensor_split(chunks), strict=True))
            for ids, mask in self.columns
        ]
        indices = self.indices.tensor_split(chunks)
        identities = [None] * chunks
        if self.identities is not None:
            identities = self.identities.tensor_split(chunks, dim=1)
        return [
            PairBatch([column[chunk] for column in parts], indices[chunk], [], identities[chunk])
            for chunk in range(chunks)
        ]


class TextColumns(torch.utils.data.Dataset):
    """Items are ``(epoch, index)``: row ``index``'s columns tokenized (truncated to
    ``max_length``; a list of texts gives the one ``caption_of`` draws), each after its
    column's prompt (``prompts``, by column name; none: no prefix)."""

    def __init__(
        self, dataset, columns: tuple[str, ...], tokenizer, max_length: int, seed: int = 0,
        prompts: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        self.dataset, self.columns, self.seed = dataset, columns, seed
        self.prefixes = [(prompts or {}).get(column, "") for column in columns]
        self.tokenizer, self.max_length = tokenizer, max_length
        self.pad_id = tokenizer.pad_token_id

    def __len__(self) -> int:
        return len(self.dataset)

    def duplicate_keys(self) -> list[tuple[int, ...]]:
        """Each row's texts as ids, for ``--unique-texts``."""
        return text_keys(self.dataset, self.columns)

    def __getitem__(self, item: tuple[int, int]) -> tuple[list[list[int]], int]:
        epoch, index = item
        return self.item(self.dataset[index], epoch, index)

    def problem(self, row: dict) -> str | None:
        """Why a stream's ``row`` cannot be a sample, if it cannot (``row_problem``)."""
        return row_problem(row, self.columns)

    def item(self, row: dict, epoch: int, index: int) -> tuple[list[list[int]], int, list[int]]:
        """Sample ``(epoch, index)`` from its ``row``: of a table, or of a stream."""
        texts = [caption_of(row[column], self.seed, epoch, index) for column in self.columns]
        prompted = [prefix + text for prefix, text in zip(self.prefixes, texts, strict=True)]
        encoded = self.tokenizer(prompted, truncation=True, max_length=self.max_length)
        return encoded["input_ids"], index, [text_identity(text) for text in texts]

    def collate(self, items: list[tuple[list[list[int]], int, list[int]]]) -> PairBatch:
        columns = []
        for column in range(len(self.columns)):
            texts = [ids[column] for ids, _, _ in items]
            longest = max((len(ids) for ids in texts), default=1)
            input_ids = torch.full((len(texts), longest), self.pad_id, dtype=torch.long)
            attention_mask = torch.zeros((len(texts), longest), dtype=torch.long)
            for row, ids in enumerate(texts):
                input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
                attention_mask[row, : len(ids)] = 1
            columns.append((input_ids, attention_mask))
        indices = torch.tensor([index for _, index, _ in items], dtype=torch.long)
        identities = torch.tensor([keys for _, _, keys in items], dtype=torch.long)
        return PairBatch(columns, indices, [], identities.reshape(len(items), len(self.columns)).T)


def caption_of(value, seed: int, epoch: int, index: int) -> str:
    """The caption of a row: the string itself, or one of a list drawn from
    (seed, epoch, index) alone, so that 1 and N processes draw the same one."""
    if isinstance(value, str):
        return value
    if not value:
        raise DataError(f"row {index} has an empty list of captions")
    return value[derive_seed(seed, CAPTION_STREAM, epoch, index) % len(value)]


class ImageTextBatch(NamedTuple):
    """A rank's share of a global batch: each image's view, its caption's token ids and
    attention mask (one text column)."""

    images: torch.Tensor
    columns: list[tuple[torch.Tensor, torch.Tensor]]
    indices: torch.Tensor
    unreadable: list[UnreadableImage]

    def split(self, chunks: int) -> list[ImageTextBatch]:
        """Always ``chunks`` pieces (``tensor_split``), empty ones where the share is short."""
        texts = PairBatch(self.columns, self.indices, []).split(chunks)
        images = self.images.tensor_split(chunks)
        return [
            ImageTextBatch(image, text.columns, text.indices, [])
            for image, text in zip(images, texts, strict=True)
        ]


class ImageCaptions(torch.utils.data.Dataset):
    """Items are ``(epoch, index)``: one augmented view of row ``index``'s image (SimCLR's
    augmentation, drawn from (seed, epoch, index) with ``per_sample_seed``) and its
    caption tokenized."""

    def __init__(
        self,
        dataset,
        image_column: str,
        caption_column: str,
        tokenizer,
        max_length: int,
        image_size: int,
        seed: int,
        augment: bool = True,
        per_sample_seed: bool = True,
        crop_min_scale: float = 0.2,
        horizontal_flip: bool = True,
        augmentation: str = "simclr",
    ) -> None:
        self.dataset, self.image_column, self.caption_column = dataset, image_column, caption_column
        self.text = TextColumns(dataset, (caption_column,), tokenizer, max_length)
        self.image_size, self.seed = image_size, seed
        self.images = SampleImages(image_size, seed, per_sample_seed)
        self.augment = view_augmentation(
            image_size, augment, crop_min_scale, horizontal_flip, augmentation
        )

    def __len__(self) -> int:
        return len(self.dataset)

    def duplicate_keys(self) -> list[tuple[int, ...]]:
        """Each row's captions as ids, for ``--unique-texts``."""
        return text_keys(self.dataset, (self.caption_column,))

    def __getitem__(self, item: tuple[int, int]):
        epoch, index = item
        return self.item(self.dataset[index], epoch, index)

    def problem(self, row: dict) -> str | None:
        """Why a stream's ``row`` cannot be a sample, if it cannot (``row_problem``)."""
        return row_problem(row, [self.caption_column], self.image_column)

    def item(self, row: dict, epoch: int, index: int):
        """Sample ``(epoch, index)`` from its ``row``: of a table, or of a stream."""
        view = self.images(
            row[self.image_column], epoch, index, lambda image: NORMALIZE(self.augment(image))
        )
        if isinstance(view, UnreadableImage):
            return view
        caption = caption_of(row[self.caption_column], self.seed, epoch, index)
        encoded = self.text.tokenizer(caption, truncation=True, max_length=self.text.max_length)
        return view, [encoded["input_ids"]], index, [text_identity(caption)]

    def collate(self, items: list) -> ImageTextBatch:
        unreadable = [item for item in items if isinstance(item, UnreadableImage)]
        kept = [item for item in items if not isinstance(item, UnreadableImage)]
        texts = self.text.collate([text for _, *text in kept])
        images = (
            torch.stack([view for view, *_ in kept])
            if kept
            else torch.empty(0, 3, self.image_size, self.image_size)
        )
        return ImageTextBatch(images, texts.columns, texts.indices, unreadable)
