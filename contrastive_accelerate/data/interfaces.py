"""The written interfaces between a method's data and the loop, as ``Protocol``s: what a
method's dataset is (``TableDataset`` or ``StreamDataset``, or a ``data.mixture.Mixture``
of them), what its batches are (``Batch``) and what the loop's sampler is
(``BatchPlan``). Every class of the data layer keeps them by shape, and
``tests/test_data_interfaces.py`` checks each method's dataset and batch and each
sampler against them.

A sample's global id is ``(epoch, index)``: its index in a table, or its place in the
stream of a pass; every draw it takes (crops, flips, dropout masks) is keyed by it,
which is what makes a batch the same on any number of processes.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class Batch(Protocol):
    """This rank's share of one global batch, as the loop uses it."""

    #: Each sample's index (its id within the epoch): the key of its randomness.
    indices: torch.Tensor
    #: The images that could not be decoded (``data.UnreadableImage``): the loop stops on
    #: every rank, or skips them with ``--skip-bad-images``.
    unreadable: list

    def split(self, chunks: int) -> list[Any]:
        """The batch in ``chunks`` consecutive chunks of the same kind (gradient caching)."""
        ...


@runtime_checkable
class TableDataset(Protocol):
    """A method's samples over a table: item ``(epoch, index)`` of ``len`` rows."""

    def __len__(self) -> int: ...

    def __getitem__(self, key: tuple[int, int]) -> Any:
        """Row ``index``'s sample in ``epoch``, its draws keyed by both."""
        ...

    def collate(self, items: list) -> Batch:
        """This rank's items as one ``Batch``."""
        ...


@runtime_checkable
class StreamDataset(Protocol):
    """A method's samples over a stream: ``dataset`` holds the shards
    (``data.streams.ShardStreams``), which ``data.streams.StreamBatches`` reads."""

    dataset: Any

    def item(self, row: dict, epoch: int, index: int) -> Any:
        """A stream row's sample, its draws keyed by ``(epoch, index)``."""
        ...

    def problem(self, row: dict) -> str | None:
        """Why this method cannot use ``row`` (a ``BadRow`` message), else None."""
        ...

    def collate(self, items: list) -> Batch: ...


@runtime_checkable
class BatchPlan(Protocol):
    """The loop's sampler: which global batch comes at each step, and every rank's
    share of it (``data.GlobalBatchSampler``, ``StreamBatches``, ``MixtureBatches``)."""

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Start ``epoch`` (a stream's pass) at its batch ``start_batch``."""
        ...

    def share_sizes(self, step: int) -> list[int]:
        """Every rank's number of samples in batch ``step`` of the epoch."""
        ...
