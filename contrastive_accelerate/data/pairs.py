"""Text pairs named by columns: an anchor, its positive and any hard negatives per row.

``load_pair_dataset`` checks the columns (sentence-transformers' convention: anchor,
positive, then hard negatives); ``TextColumns`` tokenizes each row in the loader's
workers, deterministically, and ``collate`` pads each column to this rank's longest
text with its attention mask, which keeps the padding out of the result.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from contrastive_accelerate.data.sources import DataError, load_splits

# The tokenizer is used before the loader forks its workers (the truncation count):
# its thread pool must not be inherited half-initialised.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@dataclass
class PairData:
    """What ``load_pair_dataset`` found: the training split and its text columns."""

    train: Any
    columns: tuple[str, ...]
    evaluation: Any | None = None
    evaluation_source: str = "evaluation: none for text pairs (retrieval metrics: not built yet)"


def load_pair_dataset(
    name: str | None, columns: tuple[str, ...], *, config_name: str | None = None,
    split: str = "train",
) -> PairData:  # fmt: skip
    """The ``split`` of dataset ``name`` (any source ``load_image_dataset`` takes), with
    ``columns`` checked: at least two, present, and holding strings."""
    if name is None:
        raise DataError("--columns needs --dataset: the offline digits have no text columns")
    if len(columns) < 2:
        raise DataError(
            f"--columns {','.join(columns)}: give at least two (anchor,positive[,negative...])"
        )
    if len(set(columns)) != len(columns):
        raise DataError(f"--columns {','.join(columns)} names a column twice")
    splits = load_splits(name, config_name)
    if split not in splits:
        raise DataError(f"dataset {name!r} has no split {split!r} (splits: {', '.join(splits)})")
    train = splits[split]
    for column in columns:
        if column not in train.column_names:
            found = ", ".join(train.column_names)
            raise DataError(f"dataset {name!r} has no column {column!r} (columns: {found})")
        feature = train.features[column]
        if getattr(feature, "dtype", None) not in ("string", "large_string"):
            kind = type(feature).__name__ if not hasattr(feature, "dtype") else feature.dtype
            raise DataError(
                f"--columns: column {column!r} holds {kind}, not text; the text tower takes "
                "strings (image-text pairs are not built yet)"
            )
    return PairData(train.select_columns(list(columns)), tuple(columns))


def count_truncated(texts: list[str], tokenizer, max_length: int) -> int:
    """How many of ``texts`` have more than ``max_length`` tokens (special tokens included)."""
    lengths = tokenizer(texts, truncation=False, add_special_tokens=True)["input_ids"]
    return sum(len(ids) > max_length for ids in lengths)


class PairBatch(NamedTuple):
    """A rank's share of a global batch: each column's token ids and attention mask."""

    columns: list[tuple[torch.Tensor, torch.Tensor]]
    indices: torch.Tensor  # each row's index in the dataset
    unreadable: list  # texts are always readable: kept for the loop's image checks

    def split(self, chunks: int) -> list[PairBatch]:
        """Always ``chunks`` pieces (``tensor_split``), empty ones where the share is short."""
        parts = [
            list(zip(ids.tensor_split(chunks), mask.tensor_split(chunks), strict=True))
            for ids, mask in self.columns
        ]
        indices = self.indices.tensor_split(chunks)
        return [
            PairBatch([column[chunk] for column in parts], indices[chunk], [])
            for chunk in range(chunks)
        ]


class TextColumns(torch.utils.data.Dataset):
    """Items are ``(epoch, index)``: row ``index``'s columns tokenized (truncated to
    ``max_length``), which depends on the row alone."""

    def __init__(self, dataset, columns: tuple[str, ...], tokenizer, max_length: int) -> None:
        self.dataset, self.columns = dataset, columns
        self.tokenizer, self.max_length = tokenizer, max_length
        self.pad_id = tokenizer.pad_token_id

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, item: tuple[int, int]) -> tuple[list[list[int]], int]:
        _, index = item
        row = self.dataset[index]
        texts = [row[column] for column in self.columns]
        encoded = self.tokenizer(texts, truncation=True, max_length=self.max_length)
        return encoded["input_ids"], index

    def collate(self, items: list[tuple[list[list[int]], int]]) -> PairBatch:
        columns = []
        for column in range(len(self.columns)):
            texts = [ids[column] for ids, _ in items]
            longest = max((len(ids) for ids in texts), default=1)
            input_ids = torch.full((len(texts), longest), self.pad_id, dtype=torch.long)
            attention_mask = torch.zeros((len(texts), longest), dtype=torch.long)
            for row, ids in enumerate(texts):
                input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
                attention_mask[row, : len(ids)] = 1
            columns.append((input_ids, attention_mask))
        indices = torch.tensor([index for _, index in items], dtype=torch.long)
        return PairBatch(columns, indices, [])
